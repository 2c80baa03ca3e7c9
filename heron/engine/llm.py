"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages)``."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from heron.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig,
                          SpeculativeConfig)
from heron.engine.core_outputs import RequestOutputKind
from heron.engine.llm_engine import LLMEngine
from heron.logging_config import configure_default
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams

Prompt = str | list[int] | dict
Message = dict[str, str]


def _as_prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


def _normalise_prompts(prompts) -> list[str | list[int]]:
    """Accept one prompt (text, token ids, or a dict) or a list of them."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [_as_prompt(prompts)]
    return [_as_prompt(p) for p in prompts]


class LLM:
    """A model plus engine, used in-process. Outputs come back in prompt order."""

    def __init__(self, model: str | None = None, *, dtype: str = "float32",
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory_gb: float | None = None, attention_backend: str = "auto",
                 seed: int = 0, enable_prefix_caching: bool = True,
                 scheduling_policy: str = "fcfs", load_format: str = "auto",
                 enforce_eager: bool = False, num_threads: int | None = None,
                 distributed_executor_backend: str | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 context_parallel_size: int = 1,
                 speculative_config: dict | str | None = None,
                 quantization: str | None = None, gpu_memory_utilization: float | None = None,
                 tokenizer: str | None = None, custom_ops: str | list[str] | None = None,
                 cpu_int8_dot: bool = False, hf_overrides: dict | str | None = None,
                 streaming_kv: dict | str | None = None) -> None:
        configure_default()  # heron's INFO lines (startup phases) on stderr, like vLLM's
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, max_model_len=max_model_len, quantization=quantization,
            tokenizer=tokenizer, custom_ops=custom_ops, cpu_int8_dot=cpu_int8_dot,
            hf_overrides=hf_overrides,
            attention_backend=attention_backend, seed=seed, load_format=load_format,
            enforce_eager=enforce_eager, num_threads=num_threads,
            distributed_executor_backend=distributed_executor_backend,
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    context_parallel_size=context_parallel_size),
            speculative=SpeculativeConfig.from_dict(speculative_config),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                              max_memory_gb=kv_cache_memory_gb,
                              memory_fraction=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              streaming_kv=streaming_kv),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs, policy=scheduling_policy),
        ))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Free every cached KV block no request is using; returns how many were freed."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        prompt_list = _normalise_prompts(prompts)
        params = sampling_params or SamplingParams()
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(
            prompt_list)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} sampling params for {len(prompt_list)} prompts")
        ids = self._add_all(prompt_list, param_list)
        finals = {out.request_id: out for out in self._run(len(ids), use_tqdm) if out.finished}
        return [finals[i] for i in ids]

    def _add_all(self, prompts, params) -> list[str]:
        """Queue every prompt, or none: a bad one aborts those already queued and raises."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = self.engine.new_request_id()
                self.engine.add_request(request_id, prompt, p,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, total: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="requests")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and bar is not None:
                    bar.update(1)
                yield out
        if bar is not None:
            bar.close()

    def apply_chat_template(self, messages: list[Message],
                            add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def chat(self, messages: list[Message] | Iterable[list[Message]],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)
