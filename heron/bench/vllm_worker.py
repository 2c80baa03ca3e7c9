"""Runs inside vLLM's own venv (stdlib + vllm only; never imports heron): vLLM's offline
``LLM`` serving generate requests for ``heron bench --peer vllm``.

argv: model_dir dtype max_model_len max_num_seqs max_num_batched_tokens prefix_caching (0/1)
reply_fd.
Requests arrive as JSON lines on stdin: ``{"prompts": [[ids]], "max_tokens": [n]}``; each
reply is one JSON line on ``reply_fd`` (vLLM logs to stdout/stderr, so replies get their own
pipe): ``{"outputs": [[ids]], "elapsed_s": seconds spent in generate}``. Greedy, EOS ignored.
"""

import json
import os
import sys
import time


def main() -> None:
    model, dtype, max_model_len, max_seqs, max_tokens_step, prefix, reply_fd = sys.argv[1:8]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype=dtype, max_model_len=int(max_model_len), max_num_seqs=int(max_seqs),
              max_num_batched_tokens=int(max_tokens_step), gpu_memory_utilization=0.4,
              enable_prefix_caching=prefix == "1", seed=0)
    replies = os.fdopen(int(reply_fd), "w")
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in request["max_tokens"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        replies.write(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                  "elapsed_s": elapsed}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
