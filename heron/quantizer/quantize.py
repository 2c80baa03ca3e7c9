"""``heron quantize``: load an HF (or GGUF) Llama-family model with transformers, float32 on
CPU, quantize its decoder layers' linears one layer at a time on calibration data, and
write a published checkpoint format (``writers``).

Per layer (``sequential``): gptq visits the linears by shared input in execution order
(q/k/v, o, gate/up, down; "true sequential"), each group's Hessian taken with the earlier
groups already quantized; awq and smoothquant take their statistics in one pass, fold their
scales, and round; fp8 needs no data. The layer's outputs with its quantized weights then
feed the next layer. The LM head and the embeddings stay as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from heron.quantizer import awq_search
from heron.quantizer import sequential as seq
from heron.quantizer import writers
from heron.quantizer.fp8_weights import fp8_quantize
from heron.quantizer.gptq_solver import HessianAccumulator, gptq_quantize
from heron.quantizer.intgrid import rtn_quantize
from heron.quantizer.smoothquant import AbsMax, int8_channel_quantize, smooth_scales

METHODS = ("gptq", "awq", "smoothquant", "fp8")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class QuantizeOptions:
    method: str = "gptq"
    bits: int = 4
    group_size: int | None = None  # None: choose_group_size (128, or less where it must)
    act_order: bool = False
    sym: bool = True
    damp: float = 0.01
    alpha: float = 0.5  # smoothquant migration strength
    fp8_scheme: str = "per-channel"
    calib: str = "shakespeare"
    num_samples: int = 64
    seq_len: int = 512
    dtype: str = "float32"  # the checkpoint's non-quantized tensors (and ct scales)

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.group_size is None:  # chosen from the model's shapes in quantize()
            return
        if self.method == "gptq":
            if self.bits not in (4, 8):
                raise ValueError(f"gptq: --bits must be 4 or 8, got {self.bits}")
            if self.group_size != -1 and self.group_size <= 0:
                raise ValueError("--group-size must be positive or -1 (one group per row)")
        if self.method == "awq" and (self.bits != 4 or self.group_size <= 0):
            raise ValueError("awq: 4-bit weights in groups (--bits 4, --group-size > 0)")

    @property
    def needs_data(self) -> bool:
        return self.method != "fp8"


def load_model(model: str | None):
    """(model, tokenizer) from an HF directory or a .gguf file (None: embedded SmolLM2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        from heron.loader.gguf_loader import find_default_gguf

        model = str(find_default_gguf())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found (an HF directory or a .gguf file)")
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if path.is_dir() and not (path / "config.json").is_file() and len(ggufs) == 1:
        path = ggufs[0]  # a directory holding one GGUF, as heron's loader takes it
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    where = str(path.parent if path.is_file() else path)
    lm = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    lm.eval()
    try:
        tok = AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError):
        tok = None
    return lm, tok


def _set_weight(linear, w: torch.Tensor) -> None:
    linear.weight.data.copy_(w.to(linear.weight.dtype))


def _gptq_layer(layer, groups, states, opts, records, names, log) -> None:
    for g in groups:
        acc = HessianAccumulator(g.in_features)
        seq.collect(layer, states, {g.linears[0]: acc.add}, stop_at=g.linears[0])
        for lin in g.linears:
            r = gptq_quantize(lin.weight, acc.H, opts.bits, opts.group_size, opts.sym,
                              opts.act_order, opts.damp)
            _set_weight(lin, r.dequantize())
            records[names[lin]] = r


def _can_fold(g) -> bool:
    """Scales fold into the producing op only when its outputs are exactly the input
    channels (a GQA v_proj has fewer output channels than o_proj has inputs)."""
    if isinstance(g.prev, torch.nn.Linear):
        return g.prev.out_features == g.in_features
    return hasattr(g.prev, "weight") and g.prev.weight.shape == (g.in_features,)


def _awq_layer(layer, groups, states, opts, records, names, log) -> None:
    stats = {id(g): awq_search.InputStats(g.in_features) for g in groups}
    seq.collect(layer, states, {g.linears[0]: stats[id(g)].add for g in groups})
    found = []
    for g in groups:  # all searches on the unscaled layer, then all folds (as AutoAWQ)
        if _can_fold(g):
            st = stats[id(g)]
            found.append((g, awq_search.search_scales(st.xtx, st.mean_abs,
                                                      [lin.weight for lin in g.linears],
                                                      4, opts.group_size)))
    for g, res in found:
        if isinstance(g.prev, torch.nn.Linear):
            awq_search.fold_into_linear(g.prev, g.linears, res.scales)
        else:
            awq_search.fold_into_norm(g.prev, g.linears, res.scales)
    log("    awq alphas: " + " ".join(f"{'/'.join(n.split('.')[-1] for n in g.names)}="
                                      f"{res.alpha:.2f}" for g, res in found))
    for g in groups:
        for lin in g.linears:
            r = rtn_quantize(lin.weight, 4, opts.group_size, sym=False, grid="awq")
            _set_weight(lin, r.dequantize())
            records[names[lin]] = r


def _smoothquant_layer(layer, groups, states, opts, records, names, log) -> None:
    norm_groups = [g for g in groups if not isinstance(g.prev, torch.nn.Linear)]
    stats = {id(g): AbsMax(g.in_features) for g in norm_groups}
    seq.collect(layer, states, {g.linears[0]: stats[id(g)].add for g in norm_groups})
    for g in norm_groups:
        s = smooth_scales(stats[id(g)].value, [lin.weight for lin in g.linears], opts.alpha)
        awq_search.fold_into_norm(g.prev, g.linears, s)
    scale_dtype = DTYPES[opts.dtype]
    for g in groups:
        for lin in g.linears:
            r = int8_channel_quantize(lin.weight, scale_dtype)
            _set_weight(lin, r.dequantize())
            records[names[lin]] = r


LAYER_METHODS = {"gptq": _gptq_layer, "awq": _awq_layer, "smoothquant": _smoothquant_layer}


GROUP_SIZES = (128, 64, 32)  # preferred first: the tools' default, then finer


def choose_group_size(model) -> int:
    """The largest of 128, 64, 32 dividing every decoder linear's input size (SmolLM2: 64,
    as 576 = 9 x 64), so that every group is whole: vLLM's GPTQ kernels and AWQ GEMM need
    that. 32 when none divides (check_shapes then says what is wrong)."""
    sizes = {lin.in_features for layer in seq.decoder_layers(model)
             for g in seq.layer_groups(layer) for lin in g.linears}
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in sizes)), GROUP_SIZES[-1])


def resolve_group_size(model, opts: QuantizeOptions, log=print) -> None:
    """Fill in ``opts.group_size`` when it was left to heron (gptq / awq)."""
    if opts.group_size is None and opts.method in ("gptq", "awq"):
        opts.group_size = choose_group_size(model)
        log(f"--group-size {opts.group_size} (the largest of {GROUP_SIZES} dividing every "
            f"input size)")
        opts.check()


def check_shapes(model, opts: QuantizeOptions, log=print) -> None:
    """Refuse shapes the format cannot store; warn about those vLLM's kernels refuse."""
    warned = False
    for layer in seq.decoder_layers(model):
        for g in seq.layer_groups(layer):
            for lin in g.linears:
                k, n = lin.in_features, lin.out_features
                if opts.method in ("gptq", "awq"):
                    per = 32 // opts.bits
                    if n % per or (opts.method == "gptq" and k % per):
                        raise ValueError(f"{opts.method}: {per} values per int32 need "
                                         f"features divisible by {per}; a linear is {n}x{k}")
                    if opts.group_size > 0 and k % opts.group_size:
                        msg = (f"{opts.method}: input size {k} is not a multiple of "
                               f"--group-size {opts.group_size}")
                        if opts.method == "awq":
                            raise ValueError(msg + " (AWQ GEMM needs whole groups)")
                        if not warned:
                            log(f"warning: {msg}: the last group is partial, which the "
                                f"format allows but vLLM's GPTQ kernels and GPTQModel's CPU "
                                f"int4 kernel refuse (pick a group size dividing every "
                                f"input size, e.g. 64 for SmolLM2, or -1)")
                        warned = True


@torch.no_grad()
def quantize_model(model, samples: list[torch.Tensor] | None, opts: QuantizeOptions,
                   log=print) -> dict:
    """Quantize ``model``'s decoder linears in place (weights become their dequantized
    values; AWQ / SmoothQuant scales folded into the norms) -> {module name: IntQuant |
    ScaledQuant}."""
    resolve_group_size(model, opts, log)
    opts.check()
    names = {id(m): n for n, m in model.named_modules()}
    layers = seq.decoder_layers(model)
    records: dict = {}
    if opts.method == "fp8":
        for layer in layers:
            for g in seq.layer_groups(layer):
                for lin in g.linears:
                    r = fp8_quantize(lin.weight, opts.fp8_scheme, DTYPES[opts.dtype])
                    _set_weight(lin, r.dequantize())
                    records[names[id(lin)]] = r
        return records
    if not samples:
        raise ValueError(f"{opts.method} needs calibration samples")
    states = seq.capture_layer0_inputs(model, samples)
    run_layer = LAYER_METHODS[opts.method]
    lin_names = _NameMap(names)
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        groups = seq.layer_groups(layer)
        run_layer(layer, groups, states, opts, records, lin_names, log)
        if i + 1 < len(layers):
            seq.advance(layer, states)
        log(f"  layer {i + 1}/{len(layers)} {opts.method}: {time.perf_counter() - t0:.1f}s")
    return records


class _NameMap:
    """Module -> its name in the model (modules are unhashable-by-value friendly: by id)."""

    def __init__(self, by_id: dict[int, str]):
        self.by_id = by_id

    def __getitem__(self, module) -> str:
        return self.by_id[id(module)]


def format_of(opts: QuantizeOptions, records: dict) -> tuple[dict, dict, dict]:
    """(module -> tensors, quantization_config, side files) of the method's format."""
    if opts.method == "gptq":
        cfg = writers.gptq_config(opts.bits, opts.group_size, opts.act_order, opts.sym,
                                  opts.damp)
        return ({n: writers.gptq_tensors(r) for n, r in records.items()}, cfg,
                {"quantize_config.json": cfg})
    if opts.method == "awq":
        return ({n: writers.awq_tensors(r) for n, r in records.items()},
                writers.awq_config(opts.group_size), {})
    kind = "int8" if opts.method == "smoothquant" else "fp8"
    strategy = "tensor" if opts.method == "fp8" and opts.fp8_scheme == "per-tensor" else "channel"
    return ({n: writers.compressed_tensors_tensors(r) for n, r in records.items()},
            writers.compressed_tensors_config(kind, strategy), {})


def quantize(model: str | None, out: str | Path, opts: QuantizeOptions, log=print) -> dict:
    """Load, calibrate, quantize, write ``out``; returns a summary."""
    from heron.quantizer.calibration import calibration_samples

    opts.check()
    t0 = time.perf_counter()
    lm, tok = load_model(model)
    resolve_group_size(lm, opts, log)
    check_shapes(lm, opts, log)
    samples = None
    if opts.needs_data:
        if tok is None:
            raise ValueError(f"{opts.method} calibrates on text: the model needs a tokenizer")
        samples = calibration_samples(tok, opts.calib, opts.num_samples, opts.seq_len)
        log(f"calibration: {len(samples)} sequences, {sum(len(s) for s in samples)} tokens "
            f"from {opts.calib}")
    t1 = time.perf_counter()
    records = quantize_model(lm, samples, opts, log)
    t2 = time.perf_counter()
    tensors, cfg, side = format_of(opts, records)
    path = writers.write_checkpoint(out, lm, tok, tensors, cfg, DTYPES[opts.dtype], side)
    t3 = time.perf_counter()
    summary = {"out": str(path), "method": opts.method, "linears": len(records),
               "load_s": round(t1 - t0, 2), "quantize_s": round(t2 - t1, 2),
               "write_s": round(t3 - t2, 2), "quantization_config": cfg}
    log(f"wrote {path}: {len(records)} linears quantized ({opts.method}) in "
        f"{t2 - t1:.1f}s")
    return summary
