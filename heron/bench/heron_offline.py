"""heron's side of the offline benchmarks: an in-process ``LLM`` built from the CLI flags."""

from __future__ import annotations

import time

from heron.bench.workloads import Sample


def add_engine_args(p) -> None:
    """Model and engine flags shared by `bench throughput` and `bench latency`."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights from config.json alone (shapes, not answers)")
    g.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, else float32)")
    g.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="JSON merged into heron's model config.json (as `heron serve "
                        "--hf-overrides`)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="heron's token budget per step (default: the engine's)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="heron's max running sequences")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix heron's KV pool size")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GB",
                   help="cap heron's KV pool")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="disable heron's prefix cache")
    g.add_argument("--attention-backend", default=None,
                   help="heron's attention backend (default: the engine's choice)")
    g.add_argument("--enforce-eager", action="store_true", help="heron: no CUDA graphs")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every engine (use 1 on a shared machine)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="heron's tensor-parallel ranks")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="heron's pipeline stages")
    g.add_argument("-cp", "--context-parallel-size", type=int, default=1,
                   help="heron's context-parallel ranks (KV sharded by block, long prefills "
                        "split round a ring)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="heron's speculative decoding (as `heron serve --speculative-config`)")


def resolve_dtype(dtype: str | None) -> str:
    import torch

    return dtype or ("bfloat16" if torch.cuda.is_available() else "float32")


def make_llm(args, **overrides):
    """heron's ``LLM`` from the engine flags; ``overrides`` win over flags (None = unset)."""
    from heron import LLM

    kwargs = {"dtype": resolve_dtype(args.dtype), "load_format": args.load_format,
              "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks,
              "kv_cache_memory_gb": args.kv_cache_memory,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_num_seqs": args.max_num_seqs,
              "tensor_parallel_size": args.tensor_parallel_size,
              "pipeline_parallel_size": args.pipeline_parallel_size,
              "context_parallel_size": getattr(args, "context_parallel_size", None),
              "speculative_config": getattr(args, "speculative_config", None),
              "hf_overrides": getattr(args, "hf_overrides", None)}
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    kwargs["attention_backend"] = args.attention_backend
    kwargs |= overrides
    return LLM(args.model, **{k: v for k, v in kwargs.items() if v is not None})


class HeronOffline:
    """Runs batches through ``LLM.generate`` (greedy, EOS ignored: every request produces
    exactly its ``output_len`` tokens, so both engines do the same work)."""

    name = "heron"
    path = "LLM.generate (continuous batching)"

    def __init__(self, args, **overrides) -> None:
        self.llm = make_llm(args, **overrides)
        self.engine = self.llm.engine

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    @property
    def kv_tokens(self) -> int:
        """Tokens heron's KV pool holds (the peer gets as many)."""
        return self.engine.kv_cache.num_blocks * self.engine.config.cache.block_size

    @property
    def step_tokens(self) -> int:
        """heron's token budget per step (the peer gets the same)."""
        return self.engine.config.scheduler.max_num_batched_tokens

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_fits(self, samples: list[Sample]) -> None:
        """ValueError unless every prompt plus its output fits heron's context."""
        need = max(len(s.prompt) + s.output_len for s in samples)
        if need > self.max_model_len:
            raise ValueError(f"a request needs {need} tokens (prompt + output) but "
                             f"max_model_len is {self.max_model_len}: raise --max-model-len "
                             f"or shorten the workload")

    def generate(self, samples: list[Sample]) -> tuple[list[list[int]], float]:
        """(generated ids per sample, seconds the ``generate`` call took)."""
        from heron import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
                  for s in samples]
        start = time.perf_counter()
        outs = self.llm.generate([s.prompt for s in samples], params)
        elapsed = time.perf_counter() - start
        return [list(o.outputs[0].token_ids) for o in outs], elapsed

    def timed_batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """Run one batch step by step; (seconds until every request has its first token,
        seconds from then until all finished)."""
        from heron import SamplingParams
        from heron.engine.core_outputs import RequestOutputKind

        engine, params = self.engine, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                     ignore_eos=True)
        pending = set()
        for prompt in prompts:
            request_id = engine.new_request_id()
            engine.add_request(request_id, prompt, params, output_kind=RequestOutputKind.DELTA)
            pending.add(request_id)
        start, first = time.perf_counter(), None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids:
                    pending.discard(out.request_id)
            if first is None and not pending:
                first = time.perf_counter()
        end = time.perf_counter()
        return first - start, end - first

    def close(self) -> None:
        self.llm = self.engine = None
