"""torch.compile (inductor's CPU codegen) of the model forward, for CPU decode and prefill.

``compile_forward(model)`` returns ``forward(input_ids, positions) -> hidden`` to call inside
the step's forward context instead of ``model(input_ids, positions)``. It fuses the small ops
(RMSNorm with its residual add, rotary, SiLU-and-mul) into a few C++ loops and drops the
per-module Python overhead; on SmolLM2-135M float32 with 2 threads it measured ~1.15-1.25x per
decode step at batch 1 and, with frozen (prepacked) weights for the batched graph, ~1.2-1.3x
at batch 64 (benchmarks/cpu_small_ops.py). The price is a cold compile of roughly a minute
per graph on two cores, and float32 rounding that differs from eager (reassociated
reductions, vectorised exp): logits move by up to ~1e-2 at batch 64 while greedy tokens stay
those of HF transformers.

How it stays one graph per token-count class:

* Attention is an opaque custom op, ``heron::attention`` (``heron.layers.attention``), that
  reads the step's forward context (backend, KV caches, metadata) at run time, so per-step
  metadata and the KV cache tensors never enter the graph and never cause a recompile.
* Two compiled callables: one for one-token steps (a batch-1 decode; dynamo would specialise
  size 1 anyway) and one with a dynamic token count for everything else (decode batches,
  prefill chunks, mixed steps), so there are two graphs in all, whatever the batch sizes.
* Rotary tables are read from the module: reserve them (``RotaryEmbedding.reserve``) before
  the first call, as the runner does; a rebuild later makes dynamo recompile, not misread.
"""

from __future__ import annotations

import types

import torch

from heron.layers.cpu_gemm import drop_cpu_gemm


def _own_forward(model, name: str):
    """``model(input_ids, positions)`` as a function with a code object of its own. Dynamo
    keeps compiled graphs (and counts recompiles) per code object of the compiled frame; two
    callables sharing one could run each other's graphs or exhaust each other's limit."""
    def forward(input_ids, positions):
        return model(input_ids, positions)

    code = forward.__code__.replace(co_name=name)
    return types.FunctionType(code, forward.__globals__, name, None, forward.__closure__)


def compile_forward(model, *, freeze_batched: bool = True):
    """``forward(input_ids, positions) -> hidden``: ``model``'s forward compiled by inductor.

    Compiles lazily: each of the two graphs on its first call (one token; more than one).
    ``freeze_batched`` compiles the multi-token graph with inductor's freezing (weights become
    constants, linears run on prepacked weights: faster from a few rows up, slower than the
    column-major GEMV at one row, hence not for the one-token graph); it keeps a packed copy
    of the projection weights and assumes they never change. Call under ``torch.no_grad`` or
    ``torch.inference_mode``, inside a forward context, with rotary tables reserved.
    """
    import torch._inductor.config as inductor_config

    drop_cpu_gemm(model)  # inductor packs (freezes) the weights itself

    one = torch.compile(_own_forward(model, "heron_forward_one_token"), dynamic=False,
                        fullgraph=True)
    many = torch.compile(_own_forward(model, "heron_forward_tokens"), fullgraph=True)
    # Freezing must be on while dynamo traces (it decides then to keep parameters as graph
    # constants); torch.compile(options={"freezing": True}) is applied too late and does not
    # freeze. Patched per call: cheap, and it only matters on the call that compiles.
    freezing = inductor_config.patch(freezing=freeze_batched)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            return one(input_ids, positions)
        # Only the token count is dynamic. (dynamic=True would make every input size symbolic,
        # and duck shaping then gives a token count equal to some other size, e.g. 64 tokens
        # and head_dim 64, one symbol: the graph specialises to that count and recompiles.)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        with freezing:
            return many(input_ids, positions)

    return forward
