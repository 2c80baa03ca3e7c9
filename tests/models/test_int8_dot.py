"""``--cpu-int8-dot`` on the shipped SmolLM2 GGUF (Q4_1 projections, Q8_0 LM head): it changes
the outputs (the activations are rounded to 8 bits), by a bounded amount: perplexity on
held-out text (a play the quantizer never calibrates on) within 1% of the exact dequantized
path's, and the greedy continuation of a plain prompt starts the same. Off by default.
"""

from __future__ import annotations

import math

import pytest

from heron import LLM, SamplingParams
from heron.kernels import cpu
from heron.quantizer.calibration import held_out_text

CHUNKS, CHUNK_LEN = 4, 192
ENGINE = dict(max_model_len=512, num_threads=2, max_num_batched_tokens=1024)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.load():
        pytest.skip("heron's CPU kernels did not build")


def _perplexity_and_greedy(int8: bool) -> tuple[float, list[int], object]:
    llm = LLM(None, cpu_int8_dot=int8, **ENGINE)
    ids = llm.get_tokenizer()(held_out_text(), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - CHUNK_LEN) // CHUNKS
    chunks = [ids[i * stride:i * stride + CHUNK_LEN] for i in range(CHUNKS)]
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    nll = -sum(out.prompt_logprobs[pos][chunk[pos]][0]
               for chunk, out in zip(chunks, outs) for pos in range(1, CHUNK_LEN))
    greedy = llm.generate(["The capital of France is"],
                          SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    worker = llm.engine.core.executor.worker
    return math.exp(nll / (CHUNKS * (CHUNK_LEN - 1))), list(greedy.token_ids), worker


def test_int8_dot_costs_under_one_percent_perplexity():
    exact_ppl, exact_tokens, worker = _perplexity_and_greedy(False)
    grouped = [m.grouped for m in worker.runner.model.modules()
               if getattr(m, "grouped", None) is not None]
    assert grouped and not any(g.int8_activations for g in grouped)  # off by default
    int8_ppl, int8_tokens, worker = _perplexity_and_greedy(True)
    grouped = [m.grouped for m in worker.runner.model.modules()
               if getattr(m, "grouped", None) is not None]
    assert grouped and all(g.int8_activations for g in grouped)
    assert int8_ppl != exact_ppl  # it does change the arithmetic
    assert abs(int8_ppl / exact_ppl - 1) < 0.01, (exact_ppl, int8_ppl)
    assert int8_tokens[:4] == exact_tokens[:4]
