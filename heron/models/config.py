"""Architecture hyper-parameters read from an HF ``config.json`` dict (transformers 4 or 5 keys)."""

from __future__ import annotations

from dataclasses import dataclass, field


def architecture_of(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    return archs[0]


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # HF ``layer_types``: per layer "full_attention" or "sliding_attention" (mixed models such as
    # Gemma 3); None when every layer is alike (all sliding when ``sliding_window`` is set)
    layer_types: tuple[str, ...] | None = None
    # the whole config.json (after overrides): what an architecture reads beyond the fields above
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """The attention window of one layer: None for full attention."""
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArchConfig":
        try:
            return cls._from_hf(cfg)
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e}") from None

    @classmethod
    def _from_hf(cls, cfg: dict) -> "ModelArchConfig":
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:  # Qwen2/3 carry a window they do not use
            window = None
        return cls(
            architecture=architecture_of(cfg),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_types=_layer_types(cfg, window),
            hf_config=dict(cfg),
        )


def _layer_types(cfg: dict, window: int | None) -> tuple[str, ...] | None:
    types = cfg.get("layer_types")
    if not types:
        return None
    if len(types) != cfg["num_hidden_layers"]:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                         f"{cfg['num_hidden_layers']} layers")
    known = {"full_attention", "sliding_attention"}
    if not set(types) <= known:
        raise ValueError(f"config.json: unsupported layer_types {sorted(set(types) - known)} "
                         f"(supported: {sorted(known)})")
    if "sliding_attention" in types and window is None:
        raise ValueError("config.json: layer_types has sliding_attention layers but no "
                         "sliding_window")
    return tuple(types)
