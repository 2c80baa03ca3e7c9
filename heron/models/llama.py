"""The Llama decoder, which Mistral, Qwen2 and Qwen3 specialise with a few flags.

Shapes: the batch is flat, ``input_ids``/``positions`` are (T,), hidden states (T, hidden).
Tensor parallelism splits attention by heads (QKV column-parallel, o_proj row-parallel) and
the MLP by intermediate features (gate_up column-, down row-parallel): two all-reduces per
layer. Pipeline parallelism builds only this stage's layers (``MissingLayer`` elsewhere); the
first stage embeds, the last norms and projects to logits.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.layers.activation import silu_and_mul
from heron.layers.attention import attention
from heron.distributed import get_pp_group
from heron.distributed.pipeline import IntermediateTensors, MissingLayer, stage_layers
from heron.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from heron.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from heron.layers.norm import RMSNorm
from heron.layers.rotary import RotaryEmbedding, apply_rotary, sink_rope
from heron.models import layer_stack
from heron.models.config import ModelArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.sliding_window = cfg.sliding_window_of(layer_idx)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, qkv_bias)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                rope_sink: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``rope_sink``: cos, sin at each query's StreamingLLM cache position (only in steps
        with StreamingLLM requests): a second copy of q rotated there scores the sink keys."""
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads,
                                         self.head_dim)  # (T, H + 2 * KVH, D)
        qk_raw, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            qk_raw = torch.cat([self.q_norm(qk_raw[:, :self.num_heads]),
                                self.k_norm(qk_raw[:, self.num_heads:])], dim=1)
        qk = apply_rotary(qk_raw, *rope)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q_sink = None if rope_sink is None else \
            apply_rotary(qk_raw[:, :self.num_heads].contiguous(), *rope_sink)
        out = attention(q, k, v, self.layer_idx, self.scale, self.sliding_window, q_sink)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope,
                rope_sink=None):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it).

        The residual add of each sub-block is fused into the next norm (one kernel on GPU):
        the stream after this layer is ``mlp_out + residual``, added by the next norm.
        """
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(
            self.self_attn(hidden, rope, rope_sink), residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """This pipeline stage's part of the decoder (all of it without pipeline parallelism)."""

    # the layer, attention and MLP classes the CPU LayerStack reproduces exactly (a plugin
    # module swapped in for one of them keeps the Python loop)
    exact_layer_types = (DecoderLayer, Attention, MLP)

    def __init__(self, cfg: ModelArchConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.layer_range = stage_layers(cfg.num_layers, pp.rank_in_group, pp.world_size)
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, qkv_bias, qk_norm) if i in self.layer_range else MissingLayer()
            for i in range(cfg.num_layers))
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cpu_layer_stack = layer_stack.UNBUILT  # built on the first step that can use it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None,
                num_layers: int | None = None):
        """The first stage starts from ``input_ids``, the others from the previous stage's
        ``intermediate``; the last stage returns normed hidden states (T, hidden), the
        others ``IntermediateTensors`` for the next stage. ``num_layers``: run only the
        first layers, then the final norm (a layer-skip draft; one stage only)."""
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary_emb(positions, hidden.dtype)
        rope_sink = sink_rope(self.rotary_emb, hidden.dtype)
        layers = self.layer_range if num_layers is None else self.layer_range[:num_layers]
        stack = layer_stack.step_stack(self, hidden)
        if stack is not None:
            hidden, residual = layer_stack.run(stack, self, hidden, residual, rope, layers)
        else:
            for i in layers:
                hidden, residual = self.layers[i](hidden, residual, rope, rope_sink)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 (incl. llama3 rope scaling), SmolLM2, and the base of the variants below."""

    qkv_bias = False
    qk_norm = False
    # HF checkpoint projection name -> (fused parameter, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self._qkv_bias(cfg), self.qk_norm)
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def _qkv_bias(cls, cfg: ModelArchConfig) -> bool:
        return cls.qkv_bias or cfg.attention_bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, intermediate)

    def kv_cache_layout(self) -> tuple[range, int, int]:
        """(the layers this stage computes, KV heads per layer on this rank, head dim): what
        this rank's KV cache holds."""
        first = self.model.layers[self.model.layer_range[0]].self_attn
        return self.model.layer_range, first.num_kv_heads, first.head_dim

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (N, hidden) -> float32 logits (N, vocab) on the TP group's first rank of
        the last stage; None on the other TP ranks (each computes its vocabulary slice)."""
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding attention window (read from the config)."""
