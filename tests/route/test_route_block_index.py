"""The precise side of `heron route`'s cache_aware policy: the per-worker block index rebuilt
from KV events, and the ZMQ subscriber that feeds it.

The oracle is the engine itself: a scheduler with a small prefix cache (so blocks are evicted)
runs a seeded multi-tenant workload while publishing events; after every step the index built
from the events holds exactly the hashes of the blocks the cache holds, and for every new
request the router's predicted hit (its chained block hashes, the salt, the match limit) is
the engine's own lookup.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager
from heron.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                    KVEventPublisher, event_to_dict)
from heron.engine.prefix_cache import block_hashes
from heron.engine.request import Request
from heron.engine.scheduler import Scheduler
from heron.route.policies.block_index import BlockIndex, PromptHashes
from heron.route.policies.kv_subscriber import KVEventSubscriber, connect_address
from heron.sampling_params import SamplingParams
from scheduler_steps import complete, schedule


def _stored(hashes, parent=None):
    return event_to_dict(BlockStored(list(hashes), parent, [], 4))


def test_index_applies_events_and_matches_leading_blocks():
    index = BlockIndex(block_size=4)
    index.apply(_stored([1, 2, 3]))
    assert index.matched_blocks([1, 2, 3, 4]) == 3
    index.apply(event_to_dict(BlockRemoved([2])))
    assert index.matched_blocks([1, 2, 3]) == 1  # a hole ends the prefix
    index.apply(event_to_dict(AllBlocksCleared()))
    assert len(index) == 0 and index.matched_blocks([1]) == 0
    index.apply({"type": "SomethingNew"})  # ignored
    assert index.events_applied == 3


def test_speculative_blocks_expire_unless_confirmed():
    index = BlockIndex(block_size=4, speculative_ttl_s=5.0)
    index.add_speculative([10, 11, 12], now=100.0)
    assert index.matched_blocks([10, 11, 12], now=101.0) == 3
    index.apply(_stored([10]))  # confirmed: no longer speculative
    assert 10 not in index.speculative
    assert index.matched_blocks([10, 11, 12], now=106.0) == 1  # 11, 12 expired
    assert index.expire(now=106.0) == 2 and not index.speculative
    index.add_speculative([20], now=0.0)
    index.apply(event_to_dict(BlockRemoved([20])))  # removed before it was ever confirmed
    assert index.matched_blocks([20], now=1.0) == 0


def test_prompt_hashes_follow_the_salt_and_the_match_limit():
    tokens = list(range(17))  # 4 full blocks of 4; the engine reuses at most (17-1)//4 = 4
    index = BlockIndex(block_size=4)
    index.apply(_stored(block_hashes(tokens, 4)))
    assert PromptHashes(tokens, None).cached_tokens(index) == 16
    assert PromptHashes(tokens[:16], None).cached_tokens(index) == 12  # last token computed
    assert PromptHashes(tokens, "tenant-a").cached_tokens(index) == 0
    assert PromptHashes(tokens, None).for_block_size(8) == block_hashes(tokens, 8)
    for salt in (None, "tenant-a"):  # memoized or not, the engine's hashes
        assert PromptHashes(tokens * 3, salt).for_block_size(4) \
            == block_hashes(tokens * 3, 4, salt)


def _run_engine_workload(seed: int, block_size: int = 4, num_blocks: int = 24) -> int:
    """Drive a scheduler over a seeded workload; check the index after every step and each
    prediction against the engine's lookup. Returns (predicted hits, blocks evicted)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                        record_events=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4), kv,
                      max_model_len=num_blocks * block_size)
    index, hits, removed = BlockIndex(block_size), 0, 0
    systems = [[rng.randrange(3, 50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    for i in range(60):
        prompt = rng.choice(systems) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 6))]
        salt = rng.choice([None, None, "t1"])
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=2), max_tokens=2,
                      cache_salt=salt)
        predicted = PromptHashes(prompt, salt).cached_tokens(index)
        assert predicted == len(kv.lookup(req)) * block_size, f"request {i}"
        hits += predicted > 0
        sched.add(req)
        for _ in range(rng.randrange(0, 4)):
            complete(sched, schedule(sched))
            for event in kv.prefix_cache.take_events():
                removed += isinstance(event, BlockRemoved)
                index.apply(event_to_dict(event))
            held = {node.block_hash for node in kv.prefix_cache.nodes.values()}
            assert index.confirmed == held, f"after request {i}"
    return hits, removed


def test_index_mirrors_the_engines_prefix_cache_and_predicts_its_hits():
    for seed in range(3):
        hits, removed = _run_engine_workload(seed)
        assert hits > 5 and removed > 0  # the workload hits, and the small cache evicts


# ---- the subscriber --------------------------------------------------------------------------
def _batch(seq: int, *events) -> list[bytes]:
    import msgspec

    payload = msgspec.msgpack.encode({"ts": 0.0, "events": [event_to_dict(e) for e in events]})
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def test_subscriber_clears_on_a_gap_and_on_a_restart():
    index = BlockIndex(4)
    sub = KVEventSubscriber("tcp://127.0.0.1:1", index)
    sub.handle(_batch(1, BlockStored([1, 2], None, [], 4)))
    sub.handle(_batch(2, BlockStored([3], 2, [], 4)))
    assert index.confirmed == {1, 2, 3} and sub.gaps == 0
    sub.handle(_batch(4, BlockStored([9], None, [], 4)))  # batch 3 lost: 1-3 may be stale
    assert index.confirmed == {9} and sub.gaps == 1
    sub.handle(_batch(1, BlockStored([5], None, [], 4)))  # the worker restarted
    assert index.confirmed == {5} and sub.gaps == 2 and sub.batches == 4


def test_connect_address_replaces_wildcards_with_the_workers_host():
    assert connect_address("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert connect_address("tcp://0.0.0.0:5557", "http://host-a:8000") == "tcp://host-a:5557"
    assert connect_address("tcp://[::]:5557", "http://[::1]:8000") == "tcp://[::1]:5557"
    assert connect_address("tcp://127.0.0.1:5557", "http://h:1") == "tcp://127.0.0.1:5557"
    assert connect_address("ipc:///tmp/kv", "http://h:1") == "ipc:///tmp/kv"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


def test_subscriber_receives_a_live_publisher_over_zmq():
    async def run():
        port = _free_port()
        pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")
        index = BlockIndex(4)
        sub = KVEventSubscriber(connect_address(f"tcp://*:{port}", "http://127.0.0.1:1"),
                                index, "w0")
        sub.start()
        try:
            # the PUB drops what it sends before the SUB has joined: publish until it lands
            deadline = time.monotonic() + 10
            while not index.confirmed and time.monotonic() < deadline:
                pub.publish([BlockStored([7], None, [], 4)])
                await asyncio.sleep(0.05)
            assert 7 in index.confirmed
            pub.publish([BlockRemoved([7]), BlockStored([8], None, [], 4)])
            assert await _until(lambda: index.confirmed == {8})
        finally:
            await sub.stop()
            pub.close()
        assert not sub.running

    asyncio.run(run())


def test_subscriber_reconnects_to_a_restarted_worker_and_starts_over():
    async def run():
        port = _free_port()
        address = f"tcp://127.0.0.1:{port}"
        index = BlockIndex(4)
        sub = KVEventSubscriber(address, index, "w0")
        sub.start()
        try:
            for hashes in ([1, 2], [3]):  # the first worker, then a new one on the same port
                pub = KVEventPublisher(address)
                if hashes == [1, 2]:
                    pub._seq = 1000  # a worker that has published for a while
                deadline = time.monotonic() + 10
                while hashes[0] not in index.confirmed and time.monotonic() < deadline:
                    pub.publish([BlockStored(hashes, None, [], 4)])
                    await asyncio.sleep(0.05)
                pub.close()
                await asyncio.sleep(0.1)
            # the new worker's sequence started over: what the old one held is forgotten
            assert index.confirmed == {3} and sub.gaps >= 1
        finally:
            await sub.stop()

    asyncio.run(run())
