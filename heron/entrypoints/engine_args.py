"""The engine's command-line flags, shared by `heron generate`, `heron chat` and `heron serve`,
and the configs built from them."""

from __future__ import annotations

import argparse
import functools

from heron.quant import QUANTIZATION_CHOICES

SPEC_HELP = ('''JSON, vLLM's keys: {"method": "ngram"|"draft"|"eagle"|"layer_skip", "num_speculative_tokens": K, "prompt_lookup_max"/"prompt_lookup_min" (ngram), "model" (draft model or EAGLE head dir), "num_layers" (layer_skip), "disable_by_batch_size"}''')


HF_OVERRIDES_HELP = ("JSON object merged into the model's config.json (nested objects "
                     "merged), as vLLM's flag; e.g. with a --max-model-len past the model's "
                     "native length: '{\"rope_scaling\": {\"rope_type\": \"yarn\", "
                     "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}}'")


def speculative_config(args):
    """``--speculative-config`` parsed and checked (None when not given)."""
    from heron.config import SpeculativeConfig

    return SpeculativeConfig.from_dict(args.speculative_config)


def engine_args(p: argparse.ArgumentParser, multi_node: bool = False) -> None:
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
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help=HF_OVERRIDES_HELP)
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
    g.add_argument("--streaming-kv", default=None, metavar="JSON",
                   help='StreamingLLM for every request that does not set its own: '
                        '{"sink_tokens": S, "window": W} keeps the first S tokens and the '
                        'last W in the KV cache and evicts the middle as generation runs '
                        '(unbounded generation in bounded memory; default: off)')
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
    g.add_argument("--custom-ops", default=None, metavar="NAMES",
                   help="comma-separated plugin ops (entry-point group heron.ops; `heron "
                        "check-kernels --list` shows them) to run in place of the built-in "
                        "path of the slot each plugs into, e.g. swiglu_limit; a leading + as "
                        "in vLLM's compilation_config.custom_ops is accepted (default: none)")
    g.add_argument("--cpu-int8-dot", action="store_true",
                   help="CPU: quantized layers (GGUF, GPTQ, AWQ, ...) round each token's "
                        "activations to 8 bits per 32 features and multiply with integer dot "
                        "products, as llama.cpp does: faster decoding, not exact against the "
                        "default dequantized path (README: its perplexity cost). Default off")
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


def sampling_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("-cp", "--context-parallel-size", type=int, default=1,
                   help="ranks that split every request's KV cache by block (each attends "
                        "over its share; the outputs merge exactly)")
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


serve_engine_args = functools.partial(engine_args, multi_node=True)


def parallel_config(args):
    from heron import envs
    from heron.config import ParallelConfig

    addr, port = envs.MASTER_ADDR, envs.MASTER_PORT
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          context_parallel_size=args.context_parallel_size,
                          nnodes=getattr(args, "nnodes", 1),
                          node_rank=getattr(args, "node_rank", 0),
                          master_addr=getattr(args, "master_addr", None) or addr,
                          master_port=getattr(args, "master_port", None) or port)
