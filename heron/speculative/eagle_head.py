"""An EAGLE-1 style draft head: one decoder layer on top of the target's hidden states.

Layout (``H`` = the target's hidden size)::

    x   = fc([embed(token_{p+1}) ; target_hidden_p])      fc: (2H -> H), no bias
    h,r = layer(x)                                         one heron DecoderLayer (index 0)
    out = norm(h + r)                                      RMSNorm(H)

The token embedding and the LM head are the target's (shared, never part of the head nor of
its checkpoint): ``forward`` takes the target's ``embed_tokens`` module, and its output goes
straight into the target's ``compute_logits``.

Semantics, on a flat batch: row ``t`` at position ``p = positions[t]`` takes
``input_ids[t]`` (the token at position ``p + 1`` of its sequence) and ``target_hidden[t]``
(the target's final *normed* hidden state at position ``p``). Its output approximates the
target's hidden state at ``p + 1`` and its logits predict the token at ``p + 2``.

Two paths over the same weights:

* ``forward`` (inference): attention goes through heron's call site
  ``heron.layers.attention.attention``, i.e. the forward context's backend, metadata and
  ``kv_caches[0]``: the head's own paged KV cache, shaped like one layer of the target's,
  ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (see ``kv_cache_layout``).
* ``forward_train`` (training): (B, S) batches with plain causal SDPA, no KV cache
  (``heron.speculative.dense_attention``), autograd on. Identical to a whole-sequence
  prefill on the paged path (tests/unit/test_eagle_head.py).

Weights are created like heron's models (``requires_grad=False``); ``build_eagle_head``
initialises them, the trainer switches gradients on. Saving and loading:
``heron.speculative.eagle_checkpoint``.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.attention.metadata import ForwardContext, forward_context
from heron.layers.linear import ReplicatedLinear
from heron.layers.norm import RMSNorm
from heron.layers.rotary import RotaryEmbedding
from heron.models import ModelArchConfig, get_model_class
from heron.models.llama import DecoderLayer
from heron.speculative.dense_attention import DenseCausalAttention


def target_attention_flags(cfg: ModelArchConfig) -> tuple[bool, bool]:
    """(qkv_bias, qk_norm) of the target architecture's decoder layers (Qwen2: bias,
    Qwen3: q/k norms): the head's layer has the same shape of attention."""
    cls = get_model_class(cfg.architecture)
    return cls._qkv_bias(cfg), bool(cls.qk_norm)


class EagleHead(nn.Module):
    """The draft head of a target with architecture config ``cfg`` (its hidden size,
    heads, MLP size, norm eps and rope)."""

    # checkpoint projection name -> (fused heron parameter, shard), as the target models'
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig, qkv_bias: bool | None = None,
                 qk_norm: bool | None = None) -> None:
        super().__init__()
        bias_default, norm_default = target_attention_flags(cfg)
        self.qkv_bias = bias_default if qkv_bias is None else qkv_bias
        self.qk_norm = norm_default if qk_norm is None else qk_norm
        self.config = cfg  # read by heron.loader.weights.load_weights
        hidden = cfg.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(cfg, layer_idx=0, qkv_bias=self.qkv_bias,
                                  qk_norm=self.qk_norm)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                positions: torch.Tensor, embed_tokens: nn.Module) -> torch.Tensor:
        """input_ids (T,) int64, target_hidden (T, H), positions (T,) -> normed hidden (T, H)
        in the head's dtype, for the target's ``compute_logits``. Attention runs through the
        current forward context (its backend, metadata and ``kv_caches[0]``)."""
        embeds = embed_tokens(input_ids)
        x = self.fc(torch.cat([embeds.to(self.fc.weight.dtype),
                               target_hidden.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rotary_emb(positions, x.dtype)
        hidden, residual = self.layer(x, None, rope)
        return self.norm(hidden, residual)[0]

    def forward_train(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                      embed_tokens: nn.Module, positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """input_ids (B, S), target_hidden (B, S, H), positions (B, S) (default: 0..S-1 in
        every row) -> normed hidden (B, S, H). Row ``s`` of a sequence attends causally to
        rows ``<= s`` of that sequence only; no KV cache. Pad at the end of a sequence."""
        b, s = input_ids.shape
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        ctx = ForwardContext(attn_metadata=None, kv_caches=[None],
                             backend=DenseCausalAttention(b, s), use_triton_ops=False)
        with forward_context(ctx):
            out = self.forward(input_ids.reshape(-1), target_hidden.reshape(b * s, -1),
                               positions.reshape(-1), embed_tokens)
        return out.view(b, s, -1)

    def kv_cache_layout(self) -> tuple[range, int, int]:
        """(layers, KV heads per layer on this rank, head dim) of the head's KV cache: one
        layer, ``(2, num_blocks, block_size, num_kv_heads, head_dim)``."""
        attn = self.layer.self_attn
        return range(1), attn.num_kv_heads, attn.head_dim


@torch.no_grad()
def init_from_target(head: EagleHead, final_norm_weight: torch.Tensor,
                     min_scale: float = 1e-2) -> EagleHead:
    """Start from "the next feature is this one": with ``w`` the target's final norm weight
    (H,), set fc's target-hidden half to ``diag(1 / w)``, the head's norm weight to ``w`` and
    the residual branches' output projections (o_proj, down_proj) to zero. Then
    ``out = w * rmsnorm(target_hidden / w + E embed) ~= target_hidden`` (exactly when the
    embedding half ``E`` of fc is zero; it keeps its small random values so the token
    counts from the first step). Training learns the correction from feature p to p + 1,
    which generalises better from little data than a random start. ``|w|`` is clamped to
    ``min_scale`` before inverting."""
    hidden = head.config.hidden_size
    w = final_norm_weight.detach().to(head.fc.weight)
    safe = torch.where(w.abs() < min_scale, torch.full_like(w, min_scale).copysign(w), w)
    head.fc.weight[:, hidden:] = torch.diag(1.0 / safe)
    head.layer.self_attn.o_proj.weight.zero_()
    head.layer.mlp.down_proj.weight.zero_()
    head.norm.weight.copy_(w)
    return head


def build_eagle_head(cfg: ModelArchConfig, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", seed: int | None = 0) -> EagleHead:
    """A head built on the meta device, then allocated on ``device`` in ``dtype``; with a
    ``seed``, initialised (matrices N(0, 0.02), norm scales 1, biases 0), else uninitialised
    (for a checkpoint to fill). In eval mode, gradients off (as heron's models)."""
    from heron.loader.dummy_weights import init_dummy_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            head = EagleHead(cfg)
    finally:
        torch.set_default_dtype(previous)
    head.to_empty(device=torch.device(device))
    if seed is not None:
        init_dummy_weights(head, seed)
    return head.eval()
