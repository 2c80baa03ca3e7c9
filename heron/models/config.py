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
        theta, scaling = rope_of(_rope_params(cfg), cfg.get("max_position_embeddings", 2048),
                                 cfg.get("original_max_position_embeddings"))
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
            rope_theta=theta,
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


_SCALED_FROM_ORIGINAL = ("llama3", "yarn", "longrope")  # HF fills their original length


def rope_of(params: dict | None, max_position_embeddings: int | None = None,
            original_max_position_embeddings: int | None = None,
            default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """One set of HF rope parameters (transformers 5 ``rope_parameters``, one layer type's
    entry of it, or an older ``rope_scaling`` with ``rope_theta``) -> (theta, scaling).

    ``scaling`` is None for plain RoPE, else the HF dict standardized as HF does before use:
    ``rope_type`` set (from an old ``type``), ``original_max_position_embeddings`` filled for
    llama3 / yarn / longrope (``original_max_position_embeddings``: a top-level config value,
    which wins as in HF), ``max_position_embeddings`` for dynamic (the length HF's dynamic NTK
    scales from), and a yarn / longrope ``factor`` left None derived as max / original
    (without ``max_position_embeddings`` only what the dict holds: the rotary module then
    names a missing key)."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", None) or default_theta)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind, **params}
    if max_position_embeddings is None:
        return theta, scaling
    if kind in _SCALED_FROM_ORIGINAL:
        if original_max_position_embeddings is not None:
            scaling["original_max_position_embeddings"] = original_max_position_embeddings
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        original = scaling["original_max_position_embeddings"]
        if kind != "llama3" and scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / original
    elif kind == "dynamic":
        scaling["original_max_position_embeddings"] = max_position_embeddings
    return theta, scaling


def rope_parameters_by_layer_type(cfg: dict) -> dict[str, dict] | None:
    """Gemma-3 style ``rope_parameters`` keyed by layer type ({"full_attention": {...},
    "sliding_attention": {...}}), else None. Pass an entry to ``rope_of``."""
    rope = cfg.get("rope_parameters")
    if rope and all(isinstance(v, dict) or v is None for v in rope.values()):
        return rope
    return None


def _rope_params(cfg: dict) -> dict:
    """The rope parameters of full-attention layers, with ``rope_theta``.

    A ``rope_scaling`` object (transformers 4 configs; an ``--hf-overrides`` of it) wins over
    ``rope_parameters``, as in HF; its theta is its own, else the top-level ``rope_theta``,
    else ``rope_parameters``' (HF would fall back to 10000 there). Otherwise transformers 5's
    ``rope_parameters`` (its "full_attention" entry when keyed by layer type)."""
    by_type = rope_parameters_by_layer_type(cfg)
    if by_type is not None:
        rope = dict(by_type.get("full_attention") or next(v for v in by_type.values() if v))
    else:
        rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling")
    if legacy:
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        return {"rope_theta": theta, **legacy}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def _layer_types(cfg: dict, window: int | None) -> tuple[str, ...] | None:
    types = cfg.get("layer_types") or _gemma3_layer_types(cfg)
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


def _gemma3_layer_types(cfg: dict) -> list[str] | None:
    """Gemma 3 configs saved without ``layer_types``: HF's rule, every
    ``sliding_window_pattern``-th layer (default 6) global, the others sliding."""
    if cfg.get("model_type") != "gemma3_text" and architecture_of(cfg) != "Gemma3ForCausalLM":
        return None
    pattern = cfg.get("sliding_window_pattern") or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(cfg["num_hidden_layers"])]
