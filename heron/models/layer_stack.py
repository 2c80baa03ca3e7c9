"""A Llama-family decoder's layers in one C++ call per step on CPU (``heron_cpu``'s LayerStack,
``heron/kernels/cpu/layer_stack.cpp``), the CPU's counterpart of a captured CUDA graph.

At batch 1 a decode step on the 2-core machine spent about as long in Python between its
kernels (module calls, dispatch checks, views: ~14 ms of 37 on the shipped GGUF) as in its
weight reads. The stack makes the same kernel calls, on the same tensors, in the same order,
as ``DecoderLayer.forward`` does on CPU float32 without autograd, so its output is the Python
loop's, bit for bit (tests/models/test_layer_stack.py).

It runs when the runner allows it (``ForwardContext.use_cpu_layer_stack``: the cpu attention
backend, not ``--enforce-eager``) and the step is one it has a form for; otherwise the model
runs its layers in Python, as always:

- built once per model, on its first eligible step: every layer a plain ``DecoderLayer``
  (its attention, MLP and norms heron's own classes, no plugin module swapped in), one
  tensor-parallel rank, no bias on the row-parallel projections, and every projection's
  method with a ``stack_form`` (float32 dense, oneDNN-packed, or heron's grouped integer
  layout without an input permutation);
- per step: float32 CPU hidden states without autograd, outside dynamo, no plugin op selected
  for the running model (``--custom-ops``), no tree-attention masks and no StreamingLLM
  request in the batch.
"""

from __future__ import annotations

import torch

from heron.attention.metadata import ForwardContext, current_forward_context
from heron.distributed import get_tp_group
from heron.layers import cpu_gemm
from heron.layers.dispatch import cpu_ops_enabled, custom_ops_selected
from heron.layers.norm import RMSNorm

UNBUILT = object()  # a decoder's cpu_layer_stack before its first eligible step


def step_stack(decoder, hidden: torch.Tensor):
    """``decoder``'s LayerStack for the running step, or None when the Python loop must run.
    ``decoder``: a ``heron.models.llama.DecoderModel`` (its ``cpu_layer_stack`` caches the
    build, or None once it is known to be unavailable)."""
    ctx = current_forward_context()
    if ctx is None or not ctx.use_cpu_layer_stack or not _step_fits(ctx, hidden):
        return None
    stack = decoder.cpu_layer_stack
    if stack is UNBUILT:
        stack = decoder.cpu_layer_stack = build(decoder)
    return stack


def _step_fits(ctx: ForwardContext, hidden: torch.Tensor) -> bool:
    return (hidden.dim() == 2 and cpu_ops_enabled(hidden) and not custom_ops_selected()
            and not ctx.use_triton_ops and not ctx.attn_metadata.tree_masks
            and ctx.attn_metadata.streaming is None and ctx.backend.name == "cpu")


def run(stack, decoder, hidden: torch.Tensor, residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor], layers: range):
    """``layers`` (consecutive, this stage's) of ``decoder`` on the step: (hidden, residual)
    as the Python loop leaves them. rope: cos, sin (T, 1, D)."""
    ctx = current_forward_context()
    md = ctx.attn_metadata
    cos, sin = (t.reshape(hidden.shape[0], -1) for t in rope)
    first = layers.start - decoder.layer_range.start
    gemv_rows = -1 if cpu_gemm.BATCH_INVARIANT else cpu_gemm.GEMV_MAX_ROWS
    kv_caches = ctx.kv_caches[decoder.layer_range.start:decoder.layer_range.stop]
    return stack.forward(hidden, residual, cos, sin, kv_caches, md.slot_mapping,
                         md.block_tables, md.seq_lens, md.query_start_loc, first, len(layers),
                         gemv_rows)


def build(decoder):
    """A LayerStack over ``decoder``'s layers (this stage's), or None where a layer has a part
    the stack has no exact form for."""
    layer_cls, attention_cls, mlp_cls = decoder.exact_layer_types
    if get_tp_group().world_size > 1:
        return None
    layers = [decoder.layers[i] for i in decoder.layer_range]
    if not layers or any(type(layer) is not layer_cls or type(layer.self_attn) is not attention_cls
                         or type(layer.mlp) is not mlp_cls for layer in layers):
        return None
    attn = layers[0].self_attn
    eps = layers[0].input_layernorm.eps
    try:
        stack = torch.classes.heron_cpu.LayerStack(attn.num_heads, attn.num_kv_heads,
                                                   attn.head_dim, eps, attn.scale)
    except (AttributeError, RuntimeError):  # the library was built without the stack
        return None
    for layer in layers:
        parts = _layer_parts(layer, eps)
        if parts is None:
            return None
        stack.add_layer(*parts)
    return stack


def _layer_parts(layer, eps: float):
    """(tensors, ints) of ``LayerStack.add_layer`` for one layer, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    head_norms = [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
    if any(type(n) is not RMSNorm or n.eps != eps for n in norms + head_norms):
        return None
    if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return None  # row-parallel biases are added outside the matmul
    tensors = [n.weight for n in norms] + ([n.weight for n in head_norms] or [None, None])
    ints = [attn.sliding_window or 0]
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        form = linear.quant_method.stack_form(linear)
        if form is None:
            return None
        row_parallel = linear is attn.o_proj or linear is mlp.down_proj
        tensors += [form.a, form.b, form.c, None if row_parallel else linear.bias]
        ints += [form.kind, form.group_size, form.bits]
    return tensors, ints
