"""``heron check-kernels``: every Triton kernel (and heron's C++ CPU attention kernels) against its
float64 torch reference on random inputs, across shapes and dtypes; prints the max relative
error per kernel and dtype.

Small shapes run on CPU under the Triton interpreter (``TRITON_INTERPRET=1``); real shapes
(Llama-3.1-8B and Qwen3-0.6B layers) run on a GPU. Relative error is
max |out - ref| / max |ref|. Tolerances: float32 1e-5, float16 1e-3, bfloat16 1e-2 (bf16
rounding of an output element alone is up to 2^-8 = 3.9e-3 of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from heron.kernels import cases, reference
from heron.kernels.runtime import num_sms

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Attention shapes: (num_kv_heads, group, head_dim, q_lens, seq_lens, block_size, window)
_SMALL_ATTENTION = [
    (4, 1, 64, [6, 7, 1, 20], [6, 16, 30, 53], 16, None),
    (2, 4, 128, [6, 7, 1, 20], [6, 16, 30, 53], 16, None),
    (1, 8, 64, [6, 7, 1, 20], [6, 16, 30, 53], 16, None),
    (2, 4, 64, [5, 19, 12], [5, 40, 70], 4, 9),
]
_REAL_ATTENTION = [  # Llama-3.1-8B (8 KV heads x 4), Qwen3-0.6B (8 KV heads x 2)
    (8, 4, 128, [512, 300, 1, 1000], [512, 1000, 2001, 1024], 16, None),
    (8, 2, 128, [1024, 100, 37], [1024, 1000, 4000], 16, None),
]
# Decode shapes: (num_kv_heads, group, head_dim, batch, longest context); the other context
# lengths are drawn at random below the longest
_SMALL_DECODE = [(4, 1, 64, 4, 150), (2, 4, 128, 4, 150), (1, 8, 64, 4, 150)]
_REAL_DECODE = [(8, 4, 128, 32, 4096), (8, 2, 128, 256, 1536)]


@dataclass
class KernelCheck:
    kernel: str
    dtype: torch.dtype
    num_cases: int
    max_rel_error: float

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    @property
    def ok(self) -> bool:
        return self.max_rel_error <= self.tolerance


Case = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (kernel output, reference)


def _prefill_cases(dtype, device, real: bool) -> Iterator[Case]:
    for i, (kvh, group, dim, q_lens, seq_lens, bs, window) in enumerate(
            _REAL_ATTENTION if real else _SMALL_ATTENTION):
        def run(kvh=kvh, group=group, dim=dim, q_lens=q_lens, seq_lens=seq_lens, bs=bs,
                window=window, seed=i):
            case = cases.attention_case(q_lens, seq_lens, kvh, group, dim, bs, dtype, device,
                                        seed, window)
            return cases.run_prefill(case), case.reference()
        yield run


def _decode_cases(dtype, device, real: bool) -> Iterator[Case]:
    gen = torch.Generator().manual_seed(0)
    shapes = _REAL_DECODE if real else _SMALL_DECODE
    for i, (kvh, group, dim, batch, top) in enumerate(shapes):
        seq_lens = torch.randint(1, top + 1, (batch,), generator=gen).tolist()
        seq_lens[0] = top

        def run(kvh=kvh, group=group, dim=dim, seq_lens=seq_lens, seed=i):
            case = cases.attention_case([1] * len(seq_lens), seq_lens, kvh, group, dim, 16,
                                        dtype, device, seed)
            # real: the engine's choice for the batch; small: several splits, most non-empty
            splits = _splits(len(seq_lens), kvh, device) if real else 4
            return cases.run_decode(case, splits), case.reference()
        yield run


def _cpu_decode_cases(dtype, device, real: bool) -> Iterator[Case]:
    """heron's C++ paged decode kernel, always on the CPU (none without a compiler)."""
    from heron.kernels import cpu

    if not cpu.load():
        return
    gen = torch.Generator().manual_seed(0)
    shapes = _REAL_DECODE if real else _SMALL_DECODE
    for i, (kvh, group, dim, batch, top) in enumerate(shapes):
        seq_lens = torch.randint(1, top + 1, (batch,), generator=gen).tolist()
        seq_lens[0] = top
        for window in (None, top // 3):
            def run(kvh=kvh, group=group, dim=dim, seq_lens=seq_lens, seed=i, window=window):
                case = cases.attention_case([1] * len(seq_lens), seq_lens, kvh, group, dim, 16,
                                            dtype, "cpu", seed, window)
                _, lens, tables = case.device_tensors()
                out = torch.ops.heron_cpu.paged_decode_attention(
                    case.q, case.key_cache, case.value_cache, tables, lens, case.scale,
                    window or 0)
                return out, case.reference()
            yield run


def _cpu_attention_cases(dtype, device, real: bool) -> Iterator[Case]:
    """heron's C++ paged attention on the prefill shapes (ragged chunks, prefix hits, a
    decode, windows), always on the CPU (none without a compiler)."""
    from heron.kernels import cpu

    if not cpu.load():
        return
    for i, (kvh, group, dim, q_lens, seq_lens, bs, window) in enumerate(
            _REAL_ATTENTION if real else _SMALL_ATTENTION):
        def run(kvh=kvh, group=group, dim=dim, q_lens=q_lens, seq_lens=seq_lens, bs=bs,
                window=window, seed=i):
            case = cases.attention_case(q_lens, seq_lens, kvh, group, dim, bs, dtype, "cpu",
                                        seed, window)
            return cases.run_cpu_attention(case), case.reference()
        yield run


def _splits(batch: int, num_kv_heads: int, device) -> int:
    from heron.kernels.attention_decode import choose_num_splits

    return choose_num_splits(batch, num_kv_heads, num_sms(torch.device(device)))


def _store_cases(dtype, device, real: bool) -> Iterator[Case]:
    for tokens, kvh, dim in ([(2048, 8, 128)] if real else [(16, 2, 64), (9, 4, 128)]):
        def run(tokens=tokens, kvh=kvh, dim=dim):
            from heron.kernels.kv_store import store_kv

            bs, blocks = 16, -(-tokens // 16) + 4
            slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(1))
            slots = slots[:tokens].tolist()
            slots[tokens // 2] = -1  # a skipped (padding) token
            k = cases.randn(tokens, kvh, dim, dtype=dtype, device=device, seed=2)
            v = cases.randn(tokens, kvh, dim, dtype=dtype, device=device, seed=3)
            k_cache = cases.randn(blocks, bs, kvh, dim, dtype=dtype, device=device, seed=4)
            v_cache = cases.randn(blocks, bs, kvh, dim, dtype=dtype, device=device, seed=5)
            ref_k, ref_v = reference.store_kv(k, v, k_cache, v_cache, slots)
            store_kv(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
            return torch.stack([k_cache, v_cache]), torch.stack([ref_k, ref_v])
        yield run


def _norm_cases(dtype, device, real: bool, residual: bool) -> Iterator[Case]:
    for rows, hidden in ([(512, 4096), (512, 1024)] if real else [(6, 200), (4, 1024)]):
        def run(rows=rows, hidden=hidden):
            from heron.kernels.rmsnorm import rms_norm

            x = cases.randn(rows, hidden, dtype=dtype, device=device)
            w = cases.randn(hidden, dtype=dtype, device=device, seed=1)
            r = cases.randn(rows, hidden, dtype=dtype, device=device, seed=2) if residual \
                else None
            out, ref = rms_norm(x, w, 1e-6, r), reference.rms_norm(x, w, 1e-6, r)
            if residual:
                return torch.cat([out[0], out[1]]), torch.cat([ref[0], ref[1]])
            return out, ref
        yield run


def _rotary_cases(dtype, device, real: bool) -> Iterator[Case]:
    for tokens, heads, dim in ([(512, 40, 128), (512, 24, 128)] if real else
                               [(5, 12, 64), (5, 10, 128)]):
        def run(tokens=tokens, heads=heads, dim=dim):
            from heron.kernels.rotary import apply_rotary

            qkv = cases.randn(tokens, heads + 8, dim, dtype=dtype, device=device)
            x = qkv[:, :heads]  # strided, as the model passes q and k
            angles = cases.randn(tokens, 1, dim // 2, dtype=torch.float32, device=device,
                                 seed=1) * 3
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            return apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin)
        yield run


def _silu_cases(dtype, device, real: bool) -> Iterator[Case]:
    for rows, d in ([(512, 14336), (512, 3072)] if real else [(3, 1100), (4, 300)]):
        def run(rows=rows, d=d):
            from heron.kernels.activation import silu_and_mul

            x = cases.randn(rows, 2 * d, dtype=dtype, device=device) * 4
            return silu_and_mul(x), reference.silu_and_mul(x)
        yield run


def _grouped_int_gemm_cases(dtype, device, real: bool) -> Iterator[Case]:
    """W4A16 (g128, g32), W6 (g16, GGUF Q6_K's) and W8 per-channel on decode and prefill
    row counts; real: the Llama-3.1-8B MLP's gate_up (28672 x 4096) and down (4096 x 14336)."""
    shapes = ([(1, 28672, 4096), (64, 4096, 14336)] if real else [(1, 100, 128), (37, 64, 96)])
    for (m, n, k), (bits, group) in zip(shapes * 2, [(4, 128), (4, 32), (6, 16), (8, -1)]):
        def run(m=m, n=n, k=k, bits=bits, group=group):
            from heron.kernels.grouped_int_gemm import grouped_int_gemm
            from heron.kernels.int_pack import dequantize, pack_values

            group = k if group == -1 else group
            gen = torch.Generator().manual_seed(m + n + bits)
            q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
            scales = torch.rand(n, k // group, generator=gen) * 0.02
            mins = -scales * (1 << (bits - 1))
            qweight = pack_values(q, bits)
            x = cases.randn(m, k, dtype=dtype, device="cpu")
            expected = x.double() @ dequantize(qweight, scales, mins, group, bits).double().T
            dev = [t.to(device) for t in (x, qweight, scales, mins)]
            return grouped_int_gemm(*dev, group, bits).cpu(), expected
        yield run


def _fp8_scaled_mm_cases(dtype, device, real: bool) -> Iterator[Case]:
    """FP8 W8A8 (per-token x, per-channel weight scales) through torch._scaled_mm, where the
    device has fp8 tensor cores; real: the Llama-3.1-8B gate_up and down at decode and
    prefill row counts. The reference multiplies the same fp8 values in float64."""
    from heron.kernels.fp8_gemm import scaled_mm_is_fast, scaled_mm_rowwise

    if dtype != torch.bfloat16 or not scaled_mm_is_fast(torch.empty(0, device=device)):
        return  # its output is bfloat16 whatever the model dtype: checked at that tolerance
    shapes = [(1, 28672, 4096), (64, 4096, 14336)] if real else [(1, 96, 128), (37, 64, 96)]
    for m, n, k in shapes:
        def run(m=m, n=n, k=k):
            fp8_max = torch.finfo(torch.float8_e4m3fn).max
            x = cases.randn(m, k, dtype=torch.float32, device=device)
            w = cases.randn(n, k, dtype=torch.float32, device=device, seed=1) * 0.02
            sx = x.abs().amax(dim=1, keepdim=True) / fp8_max
            sw = w.abs().amax(dim=1) / fp8_max
            xq = (x / sx).to(torch.float8_e4m3fn)
            wq = (w / sw[:, None]).to(torch.float8_e4m3fn)
            expected = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).T
            return scaled_mm_rowwise(xq, sx, wq.t(), sw).cpu(), expected.cpu()
        yield run


SUITE = {
    "prefill_attention": _prefill_cases,
    "decode_attention": _decode_cases,
    "paged_decode_cpu": _cpu_decode_cases,
    "paged_attention_cpu": _cpu_attention_cases,
    "store_kv": _store_cases,
    "rms_norm": lambda *a: _norm_cases(*a, residual=False),
    "rms_norm+residual": lambda *a: _norm_cases(*a, residual=True),
    "rotary": _rotary_cases,
    "silu_and_mul": _silu_cases,
    "grouped_int_gemm": _grouped_int_gemm_cases,
    "fp8_scaled_mm": _fp8_scaled_mm_cases,
}


def run_checks(device: str | torch.device, dtypes: list[torch.dtype], real_shapes: bool,
               kernels: list[str] | None = None) -> Iterator[KernelCheck]:
    """One KernelCheck per (kernel, dtype), yielded as each finishes."""
    for name in kernels or list(SUITE):
        for dtype in dtypes:
            errors = [reference.max_rel_error(*run())
                      for run in SUITE[name](dtype, device, real_shapes)]
            if errors:  # a kernel this machine cannot build has no cases
                yield KernelCheck(name, dtype, len(errors), max(errors))


def format_row(check: KernelCheck) -> str:
    return (f"{check.kernel:<20} {DTYPE_NAMES[check.dtype]:<9} {check.num_cases:>5} "
            f"{check.max_rel_error:>13.2e} {check.tolerance:>9.0e}  "
            f"{'ok' if check.ok else 'FAIL'}")


HEADER = f"{'kernel':<20} {'dtype':<9} {'cases':>5} {'max rel err':>13} {'tol':>9}  result"
