"""`heron bench latency`: prefill and decode speed of one batch of equal prompts.

For each batch size B, B prompts of ``input_len`` random tokens generate ``output_len``
tokens (greedy, EOS ignored). Prefill time runs from the submit until every request has its
first token; decode time from then to the end. Reported (medians over ``--iters`` runs, each
with fresh prompts so no prefix cache helps): prefill tok/s = B x input_len / prefill s;
decode tok/s = B x (output_len - 1) / decode s; ms per decode step. With the roofline on,
also the fraction of the ceilings reached (see roofline.py).
"""

from __future__ import annotations

import gc
import statistics

from heron.bench.heron_offline import HeronOffline, resolve_dtype
from heron.bench.machine import machine_info
from heron.bench.results import emit
from heron.bench.table import format_table
from heron.bench.workloads import Sample, random_workload


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"bad --batch-sizes {text!r}: use e.g. 1,8,32") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def measure(engine, batch: int, input_len: int, output_len: int, iters: int,
            vocab_size: int) -> dict:
    """Median prefill/decode times of ``iters`` runs of one batch, after a warmup run."""
    def prompts(seed):
        return [s.prompt for s in random_workload(batch, str(input_len), "1", seed, vocab_size)]

    engine.timed_batch(prompts(10_000 + batch), min(output_len, 4))
    runs = [engine.timed_batch(prompts(20_000 + 100 * batch + i), output_len)
            for i in range(iters)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    steps = max(output_len - 1, 0)
    return {"batch_size": batch, "prefill_s": prefill, "decode_s": decode,
            "prefill_tok_s": batch * input_len / prefill,
            "decode_tok_s": batch * steps / decode if steps and decode > 0 else None,
            "decode_ms_per_step": 1000 * decode / steps if steps else None}


def add_roofline(row: dict, ceil: dict, shapes: dict, input_len: int, output_len: int) -> None:
    """Add the ideal times and the fractions of the ceilings reached to one result row."""
    from heron.bench import roofline

    b = row["batch_size"]
    flops = roofline.prefill_flops(shapes["body"], shapes["head"], shapes["layers"],
                                   shapes["q_size"], b, input_len)
    ideal_prefill = flops / (ceil["gemm_tflop_s"] * 1e12)
    row["prefill_roofline_frac"] = ideal_prefill / row["prefill_s"]
    if row["decode_ms_per_step"]:
        moved = roofline.decode_step_bytes(shapes["weight_bytes"], shapes["kv_per_token"], b,
                                           input_len + output_len / 2)
        ideal_step = moved / (ceil["copy_gb_s"] * 1e9)
        row["decode_roofline_frac"] = ideal_step / (row["decode_ms_per_step"] / 1000)


def model_shapes(llm) -> dict:
    """The sizes the roofline needs, read from heron's loaded model."""
    from heron.bench import roofline
    from heron.worker.memory import KVLayout, bytes_per_block

    engine = llm.engine
    model, arch = engine.runner.model, engine.arch
    body, head = roofline.projection_params(model)
    dtype = next(model.parameters()).dtype
    return {"body": body, "head": head, "layers": arch.num_layers, "q_size": arch.q_size,
            "weight_bytes": roofline.weight_bytes(model),
            "kv_per_token": bytes_per_block(KVLayout.of(arch), 1, dtype), "dtype": dtype,
            "device": engine.runner.device}


def _want_roofline(flag: str) -> bool:
    import torch

    return flag == "on" or (flag == "auto" and torch.cuda.is_available())


def run(args) -> dict:
    """Measure heron (and the peer) at every batch size; print the table and JSON."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.input_len < 1 or args.output_len < 1 or args.iters < 1:
        raise ValueError("--input-len, --output-len and --iters must be >= 1")
    machine, dtype, sizes = machine_info(), resolve_dtype(args.dtype), parse_batch_sizes(
        args.batch_sizes)
    budget = args.max_num_batched_tokens or max(2048, max(sizes) * args.input_len)
    heron = HeronOffline(args, max_num_batched_tokens=budget,
                         max_num_seqs=max(max(sizes), args.max_num_seqs or 1))
    vocab = heron.vocab_size
    heron.check_fits([Sample([0] * args.input_len, args.output_len)])
    results = {"heron": [measure(heron, b, args.input_len, args.output_len, args.iters, vocab)
                         for b in sizes]}
    roof = None
    if _want_roofline(args.roofline):
        from heron.bench import roofline

        shapes = model_shapes(heron.llm)
        roof = roofline.ceilings(shapes["device"], shapes["dtype"])
        for row in results["heron"]:
            add_roofline(row, roof, shapes, args.input_len, args.output_len)
    heron.close()
    del heron
    gc.collect()
    if args.peer == "hf":
        from heron.bench.hf_peer import HFPeer

        peer = HFPeer(args.model, args.load_format, dtype, "padded")
        results["hf"] = [measure(peer, b, args.input_len, args.output_len, args.iters, vocab)
                         for b in sizes]
        peer.close()
    ratios = _ratios(results)
    print_table(results, ratios, roof)
    record = {"kind": "latency", "machine": machine, "roofline": roof, "results": results,
              "ratios": ratios, "config": {
                  "model": args.model, "load_format": args.load_format, "dtype": dtype,
                  "batch_sizes": sizes, "input_len": args.input_len,
                  "output_len": args.output_len, "iters": args.iters, "peer": args.peer,
                  "max_num_batched_tokens": budget, "threads": args.threads,
                  "attention_backend": args.attention_backend,
                  "enforce_eager": args.enforce_eager}}
    emit(record, args.json_out)
    return record


def _ratios(results: dict) -> list[dict]:
    if "hf" not in results:
        return []
    out = []
    for h, p in zip(results["heron"], results["hf"]):
        row = {"batch_size": h["batch_size"], "prefill_tok_s": h["prefill_tok_s"] / p[
            "prefill_tok_s"]}
        if h["decode_tok_s"] and p["decode_tok_s"]:
            row["decode_tok_s"] = h["decode_tok_s"] / p["decode_tok_s"]
        out.append(row)
    return out


def print_table(results: dict, ratios: list[dict], roof: dict | None) -> None:
    headers = ["engine", "batch", "prefill tok/s", "decode tok/s", "ms/step"]
    if roof:
        headers += ["prefill % roof", "decode % roof"]
    rows = []
    for name, runs in results.items():
        for r in runs:
            row = [name, r["batch_size"], r["prefill_tok_s"], r["decode_tok_s"],
                   r["decode_ms_per_step"]]
            if roof:
                row += [_pct(r.get("prefill_roofline_frac")), _pct(r.get("decode_roofline_frac"))]
            rows.append(row)
    print(format_table(headers, rows))
    for r in ratios:
        print(f"heron/hf at batch {r['batch_size']}: prefill {r['prefill_tok_s']:.2f}x, decode "
              f"{r.get('decode_tok_s', float('nan')):.2f}x")
    if roof:
        print(f"ceilings measured on {roof['device']}: copy {roof['copy_gb_s']:,.0f} GB/s "
              f"(read+write), {roof['dtype']} GEMM {roof['gemm_tflop_s']:,.2f} TFLOP/s")


def _pct(frac: float | None) -> str:
    return "-" if frac is None else f"{100 * frac:.1f}%"
