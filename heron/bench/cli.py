"""`heron bench throughput | latency | serve | report`: flags and dispatch.

Only argparse is imported here; each subcommand imports its module when it runs, so the
offline subcommands never import the HTTP client and `serve`/`report` never build an engine.
"""

from __future__ import annotations

import argparse
import sys

from heron.cli_help import HelpFormatter

EPILOG = """examples:
  heron bench throughput --peer hf                       # nano-vllm workload, heron vs HF
  heron bench throughput --peer vllm --num-prompts 64 --input-len 100:512 --output-len 100:256
  heron bench throughput --num-prompts 32 --input-len 128 --output-len 128 --threads 1
  heron bench throughput --model ./llama-8b-config --load-format dummy --dtype bfloat16
  heron bench latency --batch-sizes 1,8 --peer hf
  heron bench serve --launch --request-rates 1,4,inf --slo ttft=1000,tpot=100 --json-out s.json
  heron bench serve --url http://127.0.0.1:8080 --label llama.cpp --json-out l.json
  heron bench report s.json l.json --out-dir benchmarks/results --gpu-hour-price 2.5
  heron bench kernels --ops swiglu_limit                 # a plugin op vs the built-in path
"""

_FMT = HelpFormatter  # each default stated once


def _common(p) -> None:
    p.add_argument("--json-out", default=None, help="also write the full result record here")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")


def _peer_args(p, paths: bool) -> None:
    g = p.add_argument_group("peer")
    g.add_argument("--peer", choices=("none", "hf", "vllm") if paths else ("none", "hf"),
                   default="none", help="also run HF transformers (hf) or vLLM's CPU build "
                   "(vllm, in .venv/peers/vllm, installed on first use) on the same model and "
                   "workload")
    if paths:
        g.add_argument("--peer-path", choices=("auto", "cb", "padded"), default="auto",
                       help="HF path: continuous batching (cb), padded generate, or cb with "
                            "fallback (auto)")
        g.add_argument("--peer-batch-size", type=int, default=32,
                       help="micro-batch size of the padded-generate path")


def _throughput_parser(sub) -> None:
    from heron.bench.heron_offline import add_engine_args
    from heron.bench.workloads import add_workload_args

    p = sub.add_parser("throughput", formatter_class=_FMT,
                       help="offline batch throughput (default: 256 prompts, U[100,1024] in/out)")
    add_engine_args(p)
    add_workload_args(p, default_input="100:1024", default_output="100:1024")
    _peer_args(p, paths=True)
    _common(p)


def _latency_parser(sub) -> None:
    from heron.bench.heron_offline import add_engine_args

    p = sub.add_parser("latency", formatter_class=_FMT,
                       help="prefill and decode speed at batch 1 (and N), roofline fractions")
    add_engine_args(p)
    p.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3, help="timed runs per batch size (median)")
    p.add_argument("--roofline", choices=("auto", "on", "off"), default="auto",
                   help="measure copy bandwidth and GEMM rate and report fractions "
                        "(auto: on a GPU only)")
    _peer_args(p, paths=False)
    _common(p)


def _serve_parser(sub) -> None:
    from heron.bench.arrivals import PROCESSES
    from heron.bench.server_metrics import DEFAULT_PATTERN
    from heron.bench.workloads import add_workload_args

    p = sub.add_parser("serve", formatter_class=_FMT,
                       help="load an OpenAI-compatible server at a sweep of request rates")
    g = p.add_argument_group("server")
    g.add_argument("--url", default=None, help="base URL, e.g. http://127.0.0.1:8000[/v1]")
    g.add_argument("--launch", action="store_true", help="start `heron serve` on a free port")
    g.add_argument("--server-args", default="", help="extra `heron serve` flags with --launch")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--model", default=None, help="'model' field to send (default: server's)")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--label", default=None, help="name in the report (default: server owner)")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir to count sharegpt tokens (default: estimate)")
    add_workload_args(p, default_input="128", default_output="128")
    g = p.add_argument_group("load")
    g.add_argument("--request-rates", default="1,2,4,inf", help="req/s sweep; inf = all at once")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: < 1 burstier than Poisson, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--timeout", type=float, default=300.0, help="per-request limit (s)")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    g.add_argument("--no-stream", action="store_true", help="TTFT then equals E2E")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject unknown fields)")
    g.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft=500,tpot=50")
    g.add_argument("--no-scrape-metrics", action="store_true",
                   help="do not read the server's /metrics before and after each rate")
    g.add_argument("--metrics-pattern", default=DEFAULT_PATTERN,
                   help="regex of /metrics samples to record")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(p)


def _report_parser(sub) -> None:
    p = sub.add_parser("report", formatter_class=_FMT,
                       help="Markdown + HTML report with plots and cost from result files")
    p.add_argument("files", nargs="+", help="result files (--json-out of the other commands)")
    p.add_argument("--out-dir", default="bench-report")
    p.add_argument("--title", default="heron benchmark report")
    p.add_argument("--no-html", action="store_true")
    g = p.add_argument_group("cost & efficiency")
    g.add_argument("--gpu-hour-price", type=float, default=None, help="$ per GPU-hour")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs per measured deployment")
    g.add_argument("--slo", default=None, help="rescore serve runs under this SLO (ms)")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLO")
    g.add_argument("--target-rate", type=float, default=None, help="req/s for a capacity plan")
    g.add_argument("--target-input-len", type=float, default=None)
    g.add_argument("--target-output-len", type=float, default=None)
    g.add_argument("--prefill-tok-s", type=float, default=None,
                   help="prefill rate for the cost split (default: from latency results)")
    p.add_argument("-v", "--verbose", action="store_true")


def _kernels_parser(sub) -> None:
    p = sub.add_parser("kernels", formatter_class=_FMT,
                       help="registered ops (plugins too) vs the built-in path they replace")
    p.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per row (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    _common(p)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to the `heron` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, report",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for build in (_throughput_parser, _latency_parser, _serve_parser, _report_parser,
                  _kernels_parser):
        build(bsub)
    return bench


def _report(args) -> None:
    from heron.bench import report
    from heron.bench.metrics import SLO

    opts = report.ReportOptions(
        title=args.title, gpu_hour_price=args.gpu_hour_price, num_gpus=args.num_gpus,
        slo=SLO.parse(args.slo) if args.slo else None, attainment=args.slo_attainment,
        target_rate=args.target_rate, target_input_len=args.target_input_len,
        target_output_len=args.target_output_len, prefill_tok_s=args.prefill_tok_s)
    if args.num_gpus < 1:
        raise ValueError("--num-gpus must be >= 1")
    for path in report.write(args.files, args.out_dir, opts, html=not args.no_html):
        print(path)


def run(args) -> int:
    """Run the parsed `heron bench ...` command; 2 with a one-line message on bad input."""
    try:
        if args.bench_command == "throughput":
            from heron.bench import throughput

            throughput.run(args)
        elif args.bench_command == "latency":
            from heron.bench import latency

            latency.run(args)
        elif args.bench_command == "serve":
            from heron.bench import serve

            serve.run(args)
        elif args.bench_command == "kernels":
            from heron.bench import kernels

            kernels.run(args)
        else:
            _report(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"heron bench: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m heron.bench.cli ...`, the same as `heron bench ...`."""
    parser = argparse.ArgumentParser(prog="heron")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
