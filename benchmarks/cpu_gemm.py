"""Which float32 weight layout multiplies fastest on this CPU, per number of rows?

    .venv/bin/python benchmarks/cpu_gemm.py                 # SmolLM2-135M shapes, 1 thread
    .venv/bin/python benchmarks/cpu_gemm.py --threads 2 --rows 1,32

One "step" multiplies ``--rows`` rows through 30 layers of q/k/v (576 -> 960), o
(576 -> 576), gate/up (576 -> 3072) and down (1536 -> 576) projections, each layer with its
own weights (so they come from memory, as in a real forward, not from cache), then the
49152-wide LM head. Layouts:

* ``row``: the checkpoint's (out, in) row-major weight and ``F.linear``;
* ``col``: column-major (a transposed view of a contiguous (in, out) buffer): heron's layout
  before ``layers/cpu_gemm.py``;
* ``dnnl``: oneDNN's packed weight (``torch.ops.mkldnn._reorder_linear_weight`` +
  ``_linear_pointwise``);
* ``heron``: what ``layers.cpu_gemm.CpuGemm`` picks (``col`` up to GEMV_MAX_ROWS rows, else
  ``dnnl``).

Prints ms per step (median of ``--reps``) and each layout's speed relative to ``col``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from heron.layers.cpu_gemm import CpuGemm

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LM_HEAD = (576, 49152)


def _weights(num_layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for _ in range(num_layers) for k, n in LAYER_SHAPES]
    return ws + [torch.randn(LM_HEAD[1], LM_HEAD[0], generator=g)]


def _layouts(weights: list[torch.Tensor]) -> dict[str, list]:
    col = [w.t().contiguous().t() for w in weights]
    dnnl = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    heron = [CpuGemm(w, dual=True) for w in weights]
    return {
        "row": [lambda x, w=w: F.linear(x, w) for w in weights],
        "col": [lambda x, w=w: F.linear(x, w) for w in col],
        "dnnl": [lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                 for w in dnnl],
        "heron": heron,
    }


def _step_ms(matmuls: list, weights: list[torch.Tensor], rows: int, reps: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    xs = [inputs[w.shape[1]] for w in weights]

    def step():
        for mm, x in zip(matmuls, xs):
            mm(x)

    step()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,32,64")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weights = _weights(args.layers)
    layouts = _layouts(weights)
    print(f"# {args.layers} layers + LM head, float32, {args.threads} thread(s); "
          f"ms per step (median of {args.reps}); x = speed relative to col")
    print(f"{'rows':>5} " + " ".join(f"{name:>16}" for name in layouts))
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            ms = {name: _step_ms(mms, weights, rows, args.reps) for name, mms in layouts.items()}
            print(f"{rows:>5} " + " ".join(f"{v:>8.1f} ({ms['col'] / v:4.2f}x)"
                                           for v in ms.values()))


if __name__ == "__main__":
    main()
