"""Tensor, pipeline and context parallelism over gloo on 127.0.0.1: TP=2, PP=2, TP=2 x PP=2
and CP=2 give the single process's greedy tokens and logprobs (within 1e-4) on every tiny
architecture, with KV heads split (2) and replicated (1), under chunked prefill, preemption
and prefix hits; each rank reads only its shards of a safetensors checkpoint."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hf_reference import assert_same_outputs, make_tiny_model
from heron import LLM, SamplingParams
from heron.loader.lazy_tensor import LazyTensor

MAX_NEW = 12
# block_size 4 x 24 blocks < the demand of 6 requests: preemption; a 16-token budget chunks
# the longer prompts; prompts 0, 2 and 4 share a 12-token prefix (3 blocks): prefix hits
ENGINE = dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=24, max_num_seqs=4,
              max_model_len=96)
ARCHS = {"llama": 2, "mistral": 1, "qwen2": 1, "qwen3": 2}  # arch -> KV heads
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2xpp2": (2, 2, 1), "cp2": (1, 1, 2)}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts = []
    for i, n in enumerate((9, 23, 5, 41, 17, 3)):
        tail = [rng.randrange(3, 512) for _ in range(n)]
        prompts.append(shared + tail if i % 2 == 0 else tail)
    return prompts


def _run(path, prompts, **kwargs):
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
        # the first prompt alone, with prompt logprobs (they bypass prefix hits), caches the
        # shared prefix for the batch after it
        warm = llm.generate(prompts[:1], dataclasses.replace(params, prompt_logprobs=2))
        outputs = warm + llm.generate(prompts, params)
        stats = llm.engine.stats()
        return outputs, stats
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def single(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    make_tiny_model(arch, path, num_key_value_heads=ARCHS[arch])
    prompts = _prompts(len(arch))
    outputs, stats = _run(path, prompts)
    assert stats.scheduler.num_preemptions > 0 and stats.prefix_cache.hits > 0, stats
    return path, prompts, outputs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_equals_single_process(single, layout):
    path, prompts, reference = single
    tp, pp, cp = LAYOUTS[layout]
    outputs, stats = _run(path, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          context_parallel_size=cp)
    assert stats.scheduler.num_preemptions > 0 and stats.prefix_cache.hits > 0, stats
    assert_same_outputs(reference, outputs, 1e-4)
    _assert_rank_stats(stats.ranks, tp, pp, cp)


def _assert_rank_stats(ranks, tp: int, pp: int, cp: int) -> None:
    """Every rank reports its steps, busy time, and the communication its layout needs."""
    assert [r.rank for r in ranks] == list(range(tp * pp * cp))
    for r in ranks:
        assert r.steps > 0 and r.busy_s > 0, r
        assert (r.collective_calls > 0 and r.collective_s > 0) == (tp * cp > 1), r
        assert (r.kv_tokens_stored > 0) == (cp > 1), r
        # point to point: pipeline stages, and CP's ring pass of K/V in split prefills
        assert (r.p2p_bytes > 0) == (pp > 1 or r.split_prefill_tokens > 0), r
        assert cp > 1 or r.split_prefill_tokens == 0, r


def _checkpoint_bytes(path) -> tuple[int, int]:
    """(all tensor bytes, bytes of the tensors every rank reads whole: the norms)."""
    from safetensors import safe_open

    total = replicated = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = LazyTensor(f.get_slice(name))
            n = t.dtype.itemsize * t.shape.numel()
            total += n
            replicated += n if "norm" in name else 0
    return total, replicated


def test_each_rank_reads_only_its_shards(tmp_path):
    make_tiny_model("llama", tmp_path, num_key_value_heads=2)
    total, replicated = _checkpoint_bytes(tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=8, block_size=4)
    try:
        per_rank = llm.engine.core.executor.bytes_read
    finally:
        llm.engine.shutdown()
    # every projection, the embedding and the LM head split in halves; norms read whole
    assert per_rank == {0: (total - replicated) // 2 + replicated,
                        1: (total - replicated) // 2 + replicated}


def test_a_killed_rank_is_an_engine_fault_from_its_exit(tmp_path):
    import os
    import signal

    from heron.errors import EngineFault

    make_tiny_model("llama", tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=16, block_size=4)
    try:
        executor = llm.engine.core.executor
        os.kill(executor.pids[1], signal.SIGKILL)
        # noticed from the process's exit status, not from the heartbeat timeout
        with pytest.raises(EngineFault, match=r"rank 1 exited \(code -9\)"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    finally:
        llm.engine.shutdown()


def test_two_nodes_on_one_host(tmp_path):
    """--nnodes 2: node 0 runs the core and rank 0, `heron serve --node-rank 1` only rank 1;
    they meet over TCP on 127.0.0.1 and equal one process."""
    import socket
    import subprocess
    import sys

    from heron.config import CacheConfig, EngineConfig, ParallelConfig
    from heron.engine.llm_engine import LLMEngine

    make_tiny_model("llama", tmp_path, num_key_value_heads=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # the core's step socket takes port + 1
    prompts = _prompts(7)[:3]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    single = LLM(str(tmp_path), block_size=4, num_kv_blocks=32)
    reference = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    single.engine.shutdown()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--model", str(tmp_path),
         "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--block-size", "4", "--num-kv-blocks", "32"])
    try:
        par = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=0,
                             master_addr="127.0.0.1", master_port=port)
        engine = LLMEngine(EngineConfig(model=str(tmp_path), parallel=par,
                                        cache=CacheConfig(block_size=4, num_blocks=32)))
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            done = {}
            for _ in range(200):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
                if len(done) == len(prompts):
                    break
            assert [done[str(i)] for i in range(len(prompts))] == reference
        finally:
            engine.shutdown()
        assert node1.wait(30) == 0  # its rank exited when the core shut down
    finally:
        if node1.poll() is None:
            node1.kill()


def test_master_address_comes_from_the_environment_unless_given(monkeypatch):
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.engine_args import parallel_config

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29600")
    par = parallel_config(build_parser().parse_args(["serve", "-tp", "2", "--nnodes", "2"]))
    assert (par.master_addr, par.master_port, par.world_size) == ("10.0.0.5", 29600, 2)
    par = parallel_config(build_parser().parse_args(
        ["serve", "--master-addr", "10.0.0.9", "--master-port", "1234"]))
    assert (par.master_addr, par.master_port) == ("10.0.0.9", 1234)


@pytest.mark.parametrize("heads,kv_heads,layout,message", [
    (4, 2, dict(tensor_parallel_size=3), r"attention heads \(4\) is not divisible"),
    (12, 3, dict(tensor_parallel_size=4), "exceeds the 3 KV heads"),
    (4, 2, dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
])
def test_layouts_that_do_not_fit_fail_before_any_rank_starts(tmp_path, heads, kv_heads, layout,
                                                             message):
    make_tiny_model("llama", tmp_path, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    hidden_size=16 * heads)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), **layout)
