"""The HF transformers peer: the same model and workload, run by transformers in-process.

Batches go through transformers' continuous batching (``ContinuousBatchingManager``, the
engine behind ``generate_batch``, which also takes a per-request ``max_new_tokens``) where
available, else through left-padded ``generate`` in micro-batches. Greedy, EOS ignored.
Setting up the continuous-batching manager (cache sizing, warmup) is not timed, just as
building heron's engine is not. Its paged cache gets as many tokens as heron's KV pool
(``kv_tokens``; fewer if the whole workload fits in fewer) and its steps the same token budget
(``step_tokens``), so neither engine wins by holding more sequences or batching more tokens
(transformers' CPU path also builds attention masks as wide as its cache); left to size itself,
transformers takes most of the free memory, which on a CPU host costs seconds of page faults
inside the timed region.
"""

from __future__ import annotations

import logging
import time

import torch

from heron.bench.workloads import Sample

logger = logging.getLogger(__name__)

PATHS = ("auto", "cb", "padded")
CB_PATH = "generate_batch (continuous batching)"
CB_PAGE_SIZE = 256  # tokens per block of transformers' paged cache (its default)


def load_hf_model(model: str | None, load_format: str, dtype: str, device: torch.device):
    """The HF model heron would run for ``model`` (dir, .gguf, or None = embedded SmolLM2);
    random weights from the config when ``load_format == "dummy"``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from heron.config import parse_dtype
    from heron.loader.model_source import resolve_model

    name, torch_dtype = resolve_model(model, load_format).name, parse_dtype(dtype)
    if name.endswith(".gguf"):
        directory, _, file = name.rpartition("/")
        kwargs = {"gguf_file": file}
    else:
        directory, kwargs = name, {}
    if load_format == "dummy":  # initialised on the device: large shapes never touch the host
        config = AutoConfig.from_pretrained(directory, **kwargs)
        with device:
            hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **kwargs)
    return hf.to(device).eval()


class _Timestamps:
    """A generate() streamer that records when each new token batch arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    """``generate(samples)`` and ``timed_batch(prompts, n)`` like HeronOffline, on HF."""

    name = "hf"

    def __init__(self, model: str | None, load_format: str, dtype: str, path: str = "auto",
                 padded_batch_size: int = 32, timeout: float = 3600.0,
                 kv_tokens: int | None = None, step_tokens: int | None = None) -> None:
        if path not in PATHS:
            raise ValueError(f"--peer-path must be one of {PATHS}, got {path!r}")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_hf_model(model, load_format, dtype, self.device)
        self.use_cb = path != "padded" and hasattr(self.model,
                                                   "continuous_batching_context_manager")
        self.forced = path != "auto"
        self.batch_size, self.timeout = padded_batch_size, timeout
        self.kv_tokens, self.step_tokens = kv_tokens, step_tokens
        self.path = CB_PATH if self.use_cb else self._padded_name()

    def _padded_name(self) -> str:
        return f"generate (left-padded micro-batches of {self.batch_size})"

    def _config(self, max_new_tokens: int, **extra):
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                **extra)

    def generate(self, samples: list[Sample]) -> tuple[list[list[int]], float]:
        """(generated ids per sample, seconds spent generating, setup excluded)."""
        prompts = [list(s.prompt) for s in samples]
        lens = [s.output_len for s in samples]
        if self.use_cb:
            try:
                return self._continuous(prompts, lens)
            except Exception as exc:  # noqa: BLE001 - any CB failure: fall back, and say so
                if self.forced:
                    raise
                logger.warning("continuous batching failed (%r); using padded generate", exc)
                self.use_cb, self.path = False, self._padded_name()
        start = time.perf_counter()
        outs = [out for i in range(0, len(prompts), self.batch_size)
                for out in self._padded(prompts[i:i + self.batch_size],
                                        lens[i:i + self.batch_size])]
        return outs, time.perf_counter() - start

    def _continuous(self, prompts: list[list[int]], lens: list[int]
                    ) -> tuple[list[list[int]], float]:
        cfg = self._config(max(lens), eos_token_id=-1)  # -1: no token ends a request
        results = {}
        # warmup pre-captures CUDA graphs: worth it (and untimed) on a GPU, pointless on CPU
        with self.model.continuous_batching_context_manager(
                generation_config=cfg, block=True, timeout=30,
                continuous_batching_config=self._cb_config(prompts, lens),
                warmup=self.device.type == "cuda") as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, request_id=f"req{i}", max_new_tokens=n)
                   for i, (p, n) in enumerate(zip(prompts, lens))]
            deadline = time.monotonic() + self.timeout
            while len(results) < len(ids) and time.monotonic() < deadline:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
            elapsed = time.perf_counter() - start
        if len(results) < len(ids):
            raise RuntimeError(f"continuous batching returned {len(results)} of {len(ids)}")
        failed = [r.error for r in results.values() if getattr(r, "error", None)]
        if failed:
            raise RuntimeError(f"continuous batching failed: {str(failed[0])[:300]}")
        return [list(results[i].generated_tokens) for i in ids], elapsed

    def _cb_config(self, prompts: list[list[int]], lens: list[int]):
        """Cache blocks for ``kv_tokens`` (at most the whole workload, at least the longest
        request) and ``step_tokens`` per step; None (transformers decides) if neither is
        given."""
        from transformers import ContinuousBatchingConfig

        if self.kv_tokens is None and self.step_tokens is None:
            return None
        kw = {"page_size": CB_PAGE_SIZE, "max_batch_tokens": self.step_tokens}
        if self.kv_tokens is not None:
            sizes = [len(p) + n for p, n in zip(prompts, lens)]
            tokens = max(min(self.kv_tokens, sum(sizes)), max(sizes))
            kw["num_blocks"] = -(-tokens // CB_PAGE_SIZE) + 1
        return ContinuousBatchingConfig(**kw)

    @torch.inference_mode()
    def _padded(self, prompts: list[list[int]], lens: list[int], streamer=None
                ) -> list[list[int]]:
        width, n = max(len(p) for p in prompts), max(lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, streamer=streamer,
                                  generation_config=self._config(n, min_new_tokens=n))
        return [row[:k] for row, k in zip(out[:, width:].tolist(), lens)]

    def timed_batch(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """One padded ``generate`` of equal-length prompts; (prefill s, decode s) from the
        streamer: its first call carries the prompt, its second the first new tokens."""
        stamps = _Timestamps()
        start = time.perf_counter()
        self._padded(prompts, [output_len] * len(prompts), streamer=stamps)
        end = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        first = stamps.times[1] if len(stamps.times) > 1 else end
        return first - start, end - first

    def close(self) -> None:
        self.model = None
