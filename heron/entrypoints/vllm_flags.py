"""vLLM's `vllm serve` flags that heron does not have, in one table: each is refused with one
line naming heron's equivalent (or why it does not apply), or accepted when it asks for what
heron does anyway (its note is logged at startup).

The flags heron does implement under vLLM's names (``--enable-prefix-caching``,
``--served-model-name``, ``--max-logprobs``, ...) are ordinary flags of ``heron serve``; this
module only holds the others, so that every "heron does not do that" message lives here.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("heron.server")

NOT_DOWNLOADED = "heron does not download models: pass a local Hugging Face directory or .gguf file"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag heron has no flag for.

    ``nargs`` is how many values it takes (0: a switch). ``accepts`` says which values ask for
    what heron does anyway (None: none do, the flag is always refused); for those ``note`` is
    logged, for the others ``message`` is the error. A switch with ``accepts`` set is always
    accepted."""

    flags: tuple[str, ...]
    message: str
    nargs: int = 1
    accepts: Callable[[str | None], bool] | None = None
    note: str = ""


def _one_of(*values: str) -> Callable[[str | None], bool]:
    return lambda value: value is not None and value.lower() in values


def _always(_value) -> bool:
    return True


TOOLS = ("tool calling is not supported (a request with `tools` gets 400); "
         "heron answers with plain text")
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--lora-modules",), "LoRA adapters are not supported: merge the adapter into "
             "the base weights (peft's merge_and_unload) and serve the merged directory",
             nargs=-1),
    VllmFlag(("--enable-lora",), "LoRA adapters are not supported: merge the adapter into the "
             "base weights (peft's merge_and_unload) and serve the merged directory", nargs=0),
    VllmFlag(("--max-loras", "--max-lora-rank", "--max-cpu-loras"),
             "LoRA adapters are not supported (merge them into the weights)"),
    VllmFlag(("--enable-auto-tool-choice",), TOOLS, nargs=0),
    VllmFlag(("--tool-call-parser", "--tool-parser-plugin"), TOOLS),
    VllmFlag(("--reasoning-parser",), "reasoning parsers are not supported: the reasoning "
             "text stays in `content`"),
    VllmFlag(("--guided-decoding-backend", "--structured-outputs-config"),
             "structured outputs (guided decoding) are not supported: `response_format` other "
             "than text and guided_* fields get 400"),
    VllmFlag(("--download-dir", "--hf-token"), NOT_DOWNLOADED),
    VllmFlag(("--revision", "--tokenizer-revision", "--code-revision"),
             NOT_DOWNLOADED + "; check out that revision and pass its directory"),
    VllmFlag(("--num-gpu-blocks-override",), "heron's flag is --num-kv-blocks"),
    VllmFlag(("--cpu-offload-gb",), "weight offloading is not supported: quantize the model "
             "(heron quantize) or split it with -tp / -pp"),
    VllmFlag(("--data-parallel-size", "-dp"), "data parallelism is not built in: run one "
             "heron serve per replica (each on its own --port) behind a load balancer"),
    VllmFlag(("--api-server-count",), "heron runs one API server process"),
    VllmFlag(("--headless",), "use --nnodes / --node-rank: nodes with rank > 0 run only "
             "their worker ranks, no server", nargs=0),
    VllmFlag(("--speculative-model", "--num-speculative-tokens"),
             "heron's flag is --speculative-config (JSON, vLLM's keys), e.g. "
             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    VllmFlag(("--uds",), "heron listens on TCP only: use --host / --port"),
    VllmFlag(("--middleware",), "custom ASGI middleware is not supported"),
    VllmFlag(("--config",), "heron reads its settings from flags only (no YAML config file)"),
    VllmFlag(("--limit-mm-per-prompt", "--mm-processor-kwargs"),
             "multimodal inputs are not supported: heron serves text models"),
    VllmFlag(("--kv-cache-dtype",), "heron keeps the KV cache in the model's dtype (--dtype); "
             "an fp8 KV cache is not supported", accepts=_one_of("auto"),
             note="--kv-cache-dtype auto: the KV cache is kept in the model's dtype"),
    VllmFlag(("--tokenizer-mode",), "heron loads the model's Hugging Face tokenizer "
             "(tokenizer mode 'auto')", accepts=_one_of("auto", "hf"), note=""),
    VllmFlag(("--swap-space",), "", accepts=_always,
             note="--swap-space is ignored: heron recomputes a preempted request's KV instead "
                  "of swapping it to CPU memory"),
    VllmFlag(("--enable-chunked-prefill",), "", nargs=0, accepts=_always,
             note="--enable-chunked-prefill: heron always chunks prefills longer than "
                  "--max-num-batched-tokens"),
    VllmFlag(("--no-enable-chunked-prefill",), "heron always chunks prefills longer than "
             "--max-num-batched-tokens: raise it to at least --max-model-len to prefill every "
             "prompt in one step", nargs=0),
    VllmFlag(("--disable-custom-all-reduce",), "", nargs=0, accepts=_always,
             note="--disable-custom-all-reduce: heron uses torch.distributed's all-reduce "
                  "(no custom kernel to disable)"),
    VllmFlag(("--max-log-len",), "", accepts=_always,
             note="--max-log-len is ignored: heron's request log lines hold no prompt text"),
    VllmFlag(("--enable-prompt-tokens-details",), "", nargs=0, accepts=_always,
             note="--enable-prompt-tokens-details: heron always reports "
                  "usage.prompt_tokens_details.cached_tokens"),
)


class _VllmFlagAction(argparse.Action):
    """Refuses (one line on stderr, exit status 2, as argparse does) or records a note."""

    def __init__(self, option_strings, dest, spec: VllmFlag, **kwargs) -> None:
        nargs = {0: 0, 1: None, -1: "*"}[spec.nargs]
        super().__init__(option_strings, dest, nargs=nargs, help=argparse.SUPPRESS, **kwargs)
        self.spec = spec

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        spec = self.spec
        value = values if isinstance(values, str) or values is None else None
        if spec.accepts is not None and (spec.nargs == 0 or spec.accepts(value)):
            if spec.note:
                namespace.vllm_notes = [*getattr(namespace, "vllm_notes", []), spec.note]
            return
        shown = option_string if value is None else f"{option_string} {value}"
        refuse(parser, f"{shown}: {spec.message}")


def refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error line, without the usage block: ``heron serve: error: ...``, exit 2."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of ``VLLM_FLAGS`` on ``parser`` (hidden from --help)."""
    parser.set_defaults(vllm_notes=[])
    for spec in VLLM_FLAGS:
        dest = "vllm_" + spec.flags[0].lstrip("-").replace("-", "_")
        parser.add_argument(*spec.flags, dest=dest, action=_VllmFlagAction, spec=spec,
                            default=argparse.SUPPRESS)


def log_notes(args) -> None:
    """Log what the accepted vLLM flags mean in heron (collected while parsing)."""
    for note in getattr(args, "vllm_notes", []):
        logger.warning("%s", note)
