"""Gemma 3 text decoder (``Gemma3ForCausalLM``): 5 local (sliding window) : 1 global layers.

Shapes as in llama.py: a flat batch, ``input_ids``/``positions`` (T,), hidden states
(T, hidden). Differences from Llama, all from HF's Gemma 3:

- ``GemmaRMSNorm`` (scale ``1 + w`` in float32) everywhere; four norms per layer (input,
  post-attention, pre- and post-feedforward) and per-head q/k norms;
- embeddings scaled by sqrt(hidden), rounded to the embedding's dtype;
- attention scale ``query_pre_attn_scalar ** -0.5``; each layer's own window
  (``cfg.sliding_window_of``) and its own RoPE (local base for sliding layers, the global base
  and scaling for full ones);
- GELU-tanh gated MLP; tied LM head; optional ``final_logit_softcapping``.

Tensor and pipeline parallelism split exactly as Llama's (the same linear layers). It always
runs its layers in Python: the CPU LayerStack (``layer_stack``) knows only Llama's layer.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.distributed import get_pp_group
from heron.distributed.pipeline import IntermediateTensors, MissingLayer, stage_layers
from heron.layers.activation import gelu_tanh_and_mul
from heron.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from heron.layers.linear import RowParallelLinear
from heron.layers.norm import GemmaRMSNorm
from heron.layers.rotary import RotaryEmbedding, sink_rope
from heron.models.config import ModelArchConfig, rope_of, rope_parameters_by_layer_type
from heron.models.llama import MLP, Attention

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")  # one formula


def gemma3_rope(cfg: ModelArchConfig) -> dict[str, tuple[float, dict | None]]:
    """Layer type -> (rope theta, scaling or None). Global layers: the config's rope (its
    "full_attention" entry in a transformers 5 config, else ``rope_theta`` and
    ``rope_scaling``); local layers: the "sliding_attention" entry, else
    ``rope_local_base_freq`` (10000 when absent, as in HF) without scaling."""
    hf = cfg.hf_config
    by_type = rope_parameters_by_layer_type(hf) or {}
    global_rope = (cfg.rope_theta, cfg.rope_scaling)
    if not by_type and "rope_theta" not in hf and not hf.get("rope_parameters"):
        global_rope = (1e6, cfg.rope_scaling)  # HF Gemma 3's default global base
    local = by_type.get("sliding_attention")
    if local is not None:
        local_rope = rope_of(local, cfg.max_position_embeddings,
                             hf.get("original_max_position_embeddings"), default_theta=1e4)
    else:
        local_rope = (float(hf.get("rope_local_base_freq") or 1e4), None)
    return {"full_attention": global_rope, "sliding_attention": local_rope}


def check_gemma3_config(cfg: ModelArchConfig) -> None:
    """ValueError for Gemma 3 settings heron does not run."""
    hf = cfg.hf_config
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3: attn_logit_softcapping is not supported (heron's attention "
                         "backends have no logit softcap); Gemma 3 checkpoints set it to null")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3: use_bidirectional_attention (embedding models) is not "
                         "supported; heron runs causal Gemma 3 decoders")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"Gemma 3: unsupported hidden_activation {act!r} "
                         f"(supported: {', '.join(_GELU_TANH)})")


class Gemma3Attention(Attention):
    """Llama's attention (its forward: projections, q/k norms, rotary, the attention call)
    with Gemma's q/k norms, its ``query_pre_attn_scalar`` scale and the o_proj bias of the
    config; ``rope_kind`` names the layer's RoPE (local or global)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx, cfg.attention_bias, qk_norm=False)
        self.scale = float(cfg.hf_config.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        self.rope_kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        if cfg.attention_bias:
            self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=True)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3MLP(MLP):
    """Llama's gated MLP with GELU-tanh in place of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ropes: dict):
        """(hidden, residual) -> (this layer's normed MLP output, the residual stream before
        it); each residual add is fused into the norm after it, as in Llama's layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attn = self.self_attn
        # StreamingLLM's sink queries (global layers only; local ones keep their window)
        rope_sink = ropes["sink"] if attn.sliding_window is None else None
        hidden = self.post_attention_layernorm(attn(hidden, ropes[attn.rope_kind], rope_sink))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    """This pipeline stage's part of the decoder (all of it without pipeline parallelism)."""

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.layer_range = stage_layers(cfg.num_layers, pp.rank_in_group, pp.world_size)
        self.hidden_size = cfg.hidden_size
        self._embed_scales: dict[torch.dtype, float] = {}
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = gemma3_rope(cfg)
        self.rotary_global = RotaryEmbedding(cfg.head_dim, *rope["full_attention"])
        self.rotary_local = RotaryEmbedding(cfg.head_dim, *rope["sliding_attention"])
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i) if i in self.layer_range else MissingLayer()
            for i in range(cfg.num_layers))
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to float32, then to ``dtype`` (HF multiplies by a float32
        buffer cast to the embedding's dtype); exact in ``dtype``, so a Python scalar
        multiplies the same as that tensor would."""
        if dtype not in self._embed_scales:
            scale = torch.tensor(self.hidden_size ** 0.5, dtype=torch.float32, device="cpu")
            self._embed_scales[dtype] = float(scale.to(dtype))
        return self._embed_scales[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None,
                num_layers: int | None = None):
        """As ``llama.DecoderModel.forward``: normed hidden states (T, hidden) on the last
        stage, ``IntermediateTensors`` on the others; ``num_layers`` runs only the first
        layers (a layer-skip draft)."""
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)
            hidden, residual = hidden * self.embed_scale(hidden.dtype), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        ropes = {"full_attention": self.rotary_global(positions, hidden.dtype),
                 "sliding_attention": self.rotary_local(positions, hidden.dtype),
                 "sink": sink_rope(self.rotary_global, hidden.dtype)}
        layers = self.layer_range if num_layers is None else self.layer_range[:num_layers]
        for i in layers:
            hidden, residual = self.layers[i](hidden, residual, ropes)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text models (270M, 1B, and the text part of the larger ones saved as
    ``Gemma3ForCausalLM``)."""

    # HF checkpoint projection name -> (fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        check_gemma3_config(cfg)
        self.config = cfg
        self.final_logit_softcapping = cfg.hf_config.get("final_logit_softcapping")
        self.model = Gemma3Model(cfg)
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, intermediate)

    def kv_cache_layout(self) -> tuple[range, int, int]:
        """(the layers this stage computes, KV heads per layer on this rank, head dim)."""
        first = self.model.layers[self.model.layer_range[0]].self_attn
        return self.model.layer_range, first.num_kv_heads, first.head_dim

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (N, hidden) -> float32 logits (N, vocab), soft-capped when the config says
        so; None on the TP ranks that do not sample."""
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
