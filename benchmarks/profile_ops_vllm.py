"""Runs inside vLLM's own venv (stdlib + vllm only; never imports heron): profiles one
offline ``LLM.generate`` with vLLM's own torch profiler, for ``benchmarks/profile_ops.py``.

argv: model_dir prompts_json trace_dir result_json max_tokens.
``prompts_json`` holds ``{"prompts": [[ids]], "warmup": [[ids]]}``. vLLM is configured with
``profiler_config={"profiler": "torch", ...}`` (0.32 has no VLLM_TORCH_PROFILER_DIR): its
engine-core worker records CPU ops between ``start_profile()`` and ``stop_profile()`` and
writes a chrome trace (``*.pt.trace.json.gz``) under ``trace_dir``. The thread binding comes
from the environment (VLLM_CPU_OMP_THREADS_BIND). ``result_json`` gets the generate's wall
time and the output token ids.
"""

import json
import sys
import time


def main() -> None:
    model, prompts_json, trace_dir, result_json, max_tokens = sys.argv[1:6]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(prompts_json) as f:
        work = json.load(f)
    profiler = {"profiler": "torch", "torch_profiler_dir": trace_dir,
                "torch_profiler_with_stack": False, "ignore_frontend": True}
    llm = LLM(model, dtype="float32", gpu_memory_utilization=0.4, seed=0,
              enable_prefix_caching=False, profiler_config=profiler)
    warm = [TokensPrompt(prompt_token_ids=p) for p in work["warmup"]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    llm.start_profile()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.stop_profile()
    with open(result_json, "w") as f:
        json.dump({"elapsed_s": elapsed,
                   "outputs": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":
    main()
