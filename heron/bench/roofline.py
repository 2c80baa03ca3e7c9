"""The two ceilings a step cannot beat, measured here, and the work a step must do.

* Decode is memory-bound: a step reads at least every weight once plus each sequence's KV
  cache. Its floor is those bytes over the measured copy bandwidth (counted, as a copy is,
  as bytes read + bytes written per second).
* Prefill is compute-bound: about 2 FLOPs per weight per token in the projections, plus
  causal attention (QK^T and PV: 2 x 2 x layers x q_size x tokens x (tokens + 1) / 2 per
  sequence); logits only for the last token. Its floor is those FLOPs over the measured
  dense GEMM rate in the model's dtype.
"""

from __future__ import annotations

import time

import torch
from torch import nn

# Sizes of the probes: big enough to leave caches and reach steady state, small enough to be
# quick (a few hundred ms on a GPU, about a second on a CPU).
PROBE = {"cuda": {"copy_bytes": 1 << 30, "gemm_n": 8192, "iters": 20},
         "cpu": {"copy_bytes": 1 << 28, "gemm_n": 1024, "iters": 5}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, iters: int) -> float:
    """Fastest of ``iters`` timed calls after one warmup call."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second moved by a device-to-device copy (read + write)."""
    probe = PROBE["cuda" if device.type == "cuda" else "cpu"]
    nbytes = nbytes or probe["copy_bytes"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), device, probe["iters"])


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    """FLOP/s of an n x n x n matrix product in ``dtype``."""
    probe = PROBE["cuda" if device.type == "cuda" else "cpu"]
    n = n or probe["gemm_n"]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / _best_time(lambda: torch.mm(a, b), device, probe["iters"])


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads for the weights: every parameter once (a tied embedding once,
    an untied input embedding not at all: only its gathered rows are read)."""
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.model.embed_tokens.weight
    skip = set() if tied else {id(model.model.embed_tokens.weight)}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def projection_params(model: nn.Module) -> tuple[int, int]:
    """(weights of the per-token matrices in the layers, weights of the LM head)."""
    head = model.lm_head.weight
    body = sum(p.numel() for name, p in model.named_parameters()
               if p.dim() == 2 and p is not head and "embed_tokens" not in name)
    return body, head.numel()


def decode_step_bytes(w_bytes: int, kv_bytes_per_token: int, batch: int, context: float
                      ) -> float:
    """Least bytes one decode step moves: weights, plus each sequence's KV over ``context``
    tokens (read) and one new token's KV (written)."""
    return w_bytes + batch * (context + 1) * kv_bytes_per_token


def prefill_flops(body: int, head: int, num_layers: int, q_size: int, batch: int,
                  input_len: int) -> float:
    """FLOPs of prefilling ``batch`` prompts of ``input_len`` tokens (see module doc)."""
    projections = 2 * body * batch * input_len + 2 * head * batch
    attention = 2 * num_layers * q_size * batch * input_len * (input_len + 1)
    return float(projections + attention)


def ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """Measure both ceilings now (GB/s read+write, TFLOP/s)."""
    return {"copy_gb_s": copy_bandwidth(device) / 1e9,
            "gemm_tflop_s": gemm_rate(device, dtype) / 1e12, "device": str(device),
            "dtype": str(dtype).removeprefix("torch.")}
