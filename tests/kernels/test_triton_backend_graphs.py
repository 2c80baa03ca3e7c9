"""Decode CUDA graphs, minus CUDA: bucketing and padding of the static inputs, and HF-exact
generation when decode steps replay captured "graphs" (``EagerGraph`` re-runs the captured
function on the same static buffers, which is what a CUDA graph replay does)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton kernel is defined

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hf_reference import hf_greedy, make_tiny_model  # noqa: E402
from test_triton_backend import generate_and_compare  # noqa: E402
from heron import LLM, SamplingParams  # noqa: E402
from heron.worker.batch import HostBatch  # noqa: E402
from heron.worker.cuda_graphs import (EagerGraph, StaticDecodeInputs, bucket_for,  # noqa: E402
                                      decode_buckets)


@pytest.mark.parametrize("max_batch", [1, 3, 8, 100, 256])
def test_buckets_cover_every_batch_size(max_batch):
    buckets = decode_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] >= max_batch
    for n in range(1, max_batch + 1):
        b = bucket_for(n, buckets)
        assert b >= n and (b == buckets[0] or buckets[buckets.index(b) - 1] < n)
    assert bucket_for(buckets[-1] + 1, buckets) is None


def _decode_batch(seq_lens: list[int], tables: list[list[int]], block_size: int) -> HostBatch:
    n = len(seq_lens)
    pos = torch.tensor(seq_lens) - 1
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = table_t[torch.arange(n), pos // block_size] * block_size + pos % block_size
    # one KV cache group: slots (1, T), tables (1, N, width)
    return HostBatch(torch.arange(100, 100 + n), pos, slots.unsqueeze(0),
                     torch.tensor(seq_lens), torch.arange(n + 1), table_t.unsqueeze(0),
                     list(range(n + 1)), [1] * n, seq_lens, list(range(n)), {})


def test_stage_writes_inputs_and_pads_the_rest():
    inputs = StaticDecodeInputs.allocate(8, 6, 4, torch.device("cpu"))
    inputs.stage(_decode_batch([9, 3, 20, 14], [[5, 2, 7], [1], [3, 4, 6, 8, 9], [0, 10, 11, 12]],
                               4), bucket=8)
    assert inputs.scalars[2, 4:8].tolist() == [-1] * 4
    # a smaller step next: its 4th row, real a step ago, must become padding
    inputs.stage(_decode_batch([10, 4, 2], [[5, 2, 7], [1], [13]], 4), bucket=4)
    md = inputs.metadata(4)
    assert md.seq_lens.tolist() == [10, 4, 2, 0]  # the 4th row is padding
    assert md.slot_mapping.tolist() == [7 * 4 + 1, 1 * 4 + 3, 13 * 4 + 1, -1]
    assert inputs.scalars[0, :4].tolist() == [100, 101, 102, 0]
    assert inputs.scalars[1, :4].tolist() == [9, 3, 1, 0]
    assert md.block_tables[:3, :3].tolist() == [[5, 2, 7], [1, 0, 0], [13, 0, 0]]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4] and md.query_lens_cpu == [1] * 4


class CountingEagerGraph(EagerGraph):
    replays = 0

    def replay(self) -> None:
        CountingEagerGraph.replays += 1
        super().replay()


def test_greedy_matches_hf_when_decode_steps_replay_padded_graphs(tmp_path):
    """Three requests decode in bucket 4 (one padding row), then fewer as none finish early:
    outputs stay HF-exact and every decode-only step replays a graph."""
    hf = make_tiny_model("qwen3", tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 11)]
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    llm = LLM(str(tmp_path), attention_backend="triton", max_num_batched_tokens=64,
              block_size=4)
    runner = llm.engine.runner
    runner.enable_decode_graphs(max_batch=4, graph_factory=CountingEagerGraph)
    assert sorted(runner.graphs.graphs) == [1, 2, 4]
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.num_blocks
    CountingEagerGraph.replays = 0
    generate_and_compare(llm, prompts, refs)
    assert CountingEagerGraph.replays == 5  # 6 tokens: 1 from the prefill step, 5 decodes


def test_speculation_replays_plain_decodes_and_runs_verify_steps_eagerly(tmp_path):
    """While two sequences run, speculation is off (disable_by_batch_size 2) and one-token
    decodes replay graphs; the last one speculates (its own model as the draft), and its
    verifying steps run eagerly. Output stays HF-exact."""
    hf = make_tiny_model("llama", tmp_path)
    prompts = [[5, 6, 7, 8, 9] * 2, [11, 12, 13] * 3]
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, (4, 12))]
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tmp_path),
            "disable_by_batch_size": 2}
    llm = LLM(str(tmp_path), attention_backend="triton", max_num_batched_tokens=64,
              block_size=4, speculative_config=spec)
    llm.engine.runner.enable_decode_graphs(max_batch=4, graph_factory=CountingEagerGraph)
    CountingEagerGraph.replays = 0
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 12)]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == [r[0] for r in refs]
    assert CountingEagerGraph.replays > 0
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
