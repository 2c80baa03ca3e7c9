"""`heron route --policy cache_aware`: routing decisions, precise scoring from KV events, and
the multi-tenant workload against real workers.

1. Decisions on fake workers (approximate scoring): hits follow the prefix, a miss goes to the
   least loaded worker, load imbalance overrides a hit, a hot prefix spreads once two workers
   hold it, salts keep tenants apart, trees are evicted.
2. Precise scoring in-process: a fake worker's ``/server_info`` names a ZMQ endpoint this
   test publishes on; the policy tokenizes with SmolLM2's tokenizer and predicts exactly the
   blocks the events said the worker stored.
3. The issue's workload (8 system prompts x users, shuffled) through `heron route` in front of
   three `heron serve` workers publishing KV events, each cache holding 3 tenants' prompts:
   the workers' reported prefix-hit rate under cache_aware is at least 2x round_robin's, and
   no worker is starved or flooded; a burst of one hot tenant is spread by the balance rule.
   Why three: with a uniform tenant mix an LRU cache holding c of 8 prompts hits about c/8
   of the time under round robin, and cache_aware needs c >= 8 / workers; with two workers
   the best possible ratio is about 2x, with three it is about 8/3.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from dataclasses import dataclass

import httpx
import pytest

from heron.engine.kv_events import BlockStored, KVEventPublisher
from heron.engine.prefix_cache import block_hashes
from heron.route.policies.base import RouteRequest
from heron.route.policies.cache_aware import CacheAwarePolicy


@dataclass(eq=False)
class FakeWorker:
    """What a policy reads of a ``WorkerState``."""

    url: str
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    healthy: bool = True
    server_info: dict | None = None


def _request(text: str, salt: str | None = None) -> RouteRequest:
    return RouteRequest("completions", {"prompt": text}, text, salt, len(text) // 4 + 1)


def _route(policy, text, workers, salt=None):
    request = _request(text, salt)
    decision = policy.pick(request, workers)
    policy.on_routed(request, decision)
    return decision


SYSTEM = [f"You are assistant number {i}. " + "Follow the house rules carefully. " * 8
          for i in range(8)]


def test_prefix_hits_follow_the_worker_that_served_the_prefix():
    policy, workers = CacheAwarePolicy(), [FakeWorker("http://a"), FakeWorker("http://b")]
    first = _route(policy, SYSTEM[0] + "user 1: hello", workers)
    assert first.reason == "no_hit"
    second = _route(policy, SYSTEM[1] + "user 2: hello", workers)
    assert second.reason == "no_hit" and second.worker is not first.worker  # spread misses
    for user in range(3, 10):
        d = _route(policy, SYSTEM[0] + f"user {user}: what is the weather", workers)
        assert d.reason == "cache_hit" and d.worker is first.worker
        assert d.predicted_hit_tokens > 0
    assert _route(policy, "something unrelated entirely", workers).reason == "no_hit"


def test_a_miss_goes_where_there_is_room():
    """No worker holds the prefix: the one with the smallest tree takes the new tenant (a
    request more in flight does not matter; the balance rule guards the load)."""
    policy = CacheAwarePolicy()
    a, b = FakeWorker("http://a"), FakeWorker("http://b")
    _route(policy, SYSTEM[0] + "u1", [a, b])
    _route(policy, SYSTEM[1] + "u1", [a, b])
    _route(policy, SYSTEM[1] + "u2", [a, b])
    small = min((a, b), key=lambda w: policy._workers[w.url].tree.size)
    small.outstanding_requests = 1
    assert _route(policy, SYSTEM[2] + "u1", [a, b]).worker is small


def test_imbalance_overrides_a_hit():
    policy = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    a, b = FakeWorker("http://a"), FakeWorker("http://b", outstanding_requests=1)
    assert _route(policy, SYSTEM[0] + "u1", [a, b]).worker is a
    a.outstanding_requests = 5  # 5 - 1 = 4: not more than the absolute threshold
    assert _route(policy, SYSTEM[0] + "u2", [a, b]).reason == "cache_hit"
    a.outstanding_requests = 6  # 6 - 1 > 4 and 6 > 1.5 x 1
    d = _route(policy, SYSTEM[0] + "u3", [a, b])
    assert (d.reason, d.worker) == ("balance_override", b)
    b.outstanding_requests = 5  # 6 - 5 = 1: balanced again, and both hold the prefix now
    d = _route(policy, SYSTEM[0] + "u4", [a, b])
    assert (d.reason, d.worker) == ("cache_hit", b)  # equal matches: the less loaded
    assert _route(policy, "x" * 10 + SYSTEM[0], [a, b]).reason == "no_hit"


def test_a_hot_prefix_never_piles_past_the_balance_thresholds():
    """One prefix for everyone, requests that never finish: the loads stay within what the
    thresholds allow (after each pick: max - min <= abs + 1 or max <= rel x min + 1), the
    balance rule copies the prefix to the other workers, and near-equal matches then share
    the load."""
    policy = CacheAwarePolicy(balance_abs_threshold=3, balance_rel_threshold=1.5)
    workers = [FakeWorker("http://a"), FakeWorker("http://b"), FakeWorker("http://c")]
    reasons = []
    for user in range(60):
        d = _route(policy, SYSTEM[0] + f"user {user}", workers)
        d.worker.outstanding_requests += 1
        loads = [w.outstanding_requests for w in workers]
        assert max(loads) - min(loads) <= 3 + 1 or max(loads) <= 1.5 * min(loads) + 1, loads
        reasons.append(d.reason)
    assert reasons.count("balance_override") >= 2 and reasons.count("cache_hit") > 40
    assert max(w.outstanding_requests for w in workers) <= 24  # of 60: spread, not piled


def test_the_threshold_and_the_salt():
    policy, workers = CacheAwarePolicy(cache_threshold=0.5), [FakeWorker("http://a"),
                                                             FakeWorker("http://b")]
    home = _route(policy, "shared prefix " * 4 + "tail", workers).worker
    # a third of the text matches: under the 0.5 threshold, the least loaded (the other)
    d = _route(policy, "shared prefix " * 4 + "a much longer different tail " * 4, workers)
    assert d.reason == "no_hit" and d.worker is not home
    # the same text under a salt is another tenant's: no hit
    assert _route(policy, "shared prefix " * 4 + "tail", workers, salt="t1").reason == "no_hit"
    assert _route(policy, "shared prefix " * 4 + "tail", workers).reason == "cache_hit"


def test_trees_are_evicted_to_max_tree_size_and_workers_forgotten():
    policy = CacheAwarePolicy(max_tree_size=100)
    a = FakeWorker("http://a")
    for i in range(20):
        _route(policy, f"prompt {i} " + "y" * 40, [a])
    policy.maintain(evict=True)
    assert policy._workers[a.url].tree.size <= 100
    policy.on_worker_removed(a)
    assert a.url not in policy._workers


# ---- precise scoring from KV events (in-process) -----------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smollm2_tokenizer_dir() -> str:
    from heron.loader.gguf_loader import find_default_gguf, prepare_gguf_tokenizer_dir

    return str(prepare_gguf_tokenizer_dir(find_default_gguf()))


def test_precise_scoring_predicts_the_blocks_the_events_named():
    from heron.route.tokenize import RouteTokenizer

    tokenizer_dir = _smollm2_tokenizer_dir()
    messages = [{"role": "system", "content": SYSTEM[3]}, {"role": "user", "content": "hi"}]
    ids = RouteTokenizer.from_dir(tokenizer_dir).encode_chat(messages)
    bs = 16

    async def run():
        port = _free_port()
        pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")
        info = {"block_size": bs, "kv_events_endpoint": f"tcp://*:{port}",
                "tokenizer_dir": tokenizer_dir, "chat_template": None}
        a, b = FakeWorker("http://127.0.0.1:1", server_info=info), FakeWorker("http://b")
        policy = CacheAwarePolicy()
        await policy.start()
        policy.on_worker_added(a)
        policy.on_worker_added(b)
        stored = block_hashes(ids, bs)[:3]  # the worker holds the first 3 blocks
        try:
            index = policy._workers[a.url].index
            deadline = time.monotonic() + 10
            while not index.confirmed and time.monotonic() < deadline:
                pub.publish([BlockStored(stored, None, [], bs)])  # until the SUB joined
                await asyncio.sleep(0.05)
            request = RouteRequest("chat", {"messages": messages}, "", None, 1)
            decision = policy.pick(request, [b, a])
            salted = RouteRequest("chat", {"messages": messages}, "", "tenant", 1)
            salted_decision = policy.pick(salted, [b, a])
        finally:
            await policy.stop()
            pub.close()
        return decision, request, salted_decision

    decision, request, salted = asyncio.run(run())
    assert decision.reason == "cache_hit" and decision.worker.url == "http://127.0.0.1:1"
    assert len(ids) > 4 * bs and decision.predicted_hit_tokens == 3 * bs
    assert request.prompt_tokens == len(ids)  # refined from the estimate
    assert salted.reason == "no_hit" and salted.predicted_hit_tokens == 0



def test_a_worker_whose_events_never_arrive_is_scored_approximately():
    info = {"block_size": 16, "kv_events_endpoint": f"tcp://127.0.0.1:{_free_port()}",
            "tokenizer_dir": _smollm2_tokenizer_dir(), "chat_template": None}

    async def run():
        policy = CacheAwarePolicy()
        workers = [FakeWorker("http://127.0.0.1:1", server_info=info),
                   FakeWorker("http://127.0.0.1:2", server_info=info)]
        try:
            first = _route(policy, SYSTEM[5] + "user 1", workers)
            second = _route(policy, SYSTEM[5] + "user 2", workers)
            subscribed = all(policy._workers[w.url].subscriber.running for w in workers)
        finally:
            await policy.stop()
        return first, second, subscribed

    first, second, subscribed = asyncio.run(run())
    assert subscribed and second.reason == "cache_hit" and second.worker is first.worker

# ---- the workload through `heron route` ---------------------------------------------
BLOCK = 16
NUM_WORKERS = 3
# each worker's cache holds 3 system prompts (12 blocks each) and the running request's own
# block: cache_aware gives each worker its 2-3 tenants, round robin makes each see all 8
KV_BLOCKS = 40
TENANTS, USERS = 8, 10


@pytest.fixture(scope="module")
def three_workers(served_model):
    from heron.route.launch import WorkerGroup

    group = WorkerGroup(NUM_WORKERS, [served_model, "--max-model-len", "512", "--threads", "1",
                                      "--served-model-name", "tiny", "--num-kv-blocks",
                                      str(KV_BLOCKS), "--block-size", str(BLOCK),
                                      "--disable-log-requests"], pin=False)
    try:
        group.start(startup_timeout_s=240.0)
    except BaseException:
        group.stop(10)
        raise
    yield group
    group.stop(30)


def _system_prompts(tokenizer_dir: str, run: str) -> list[str]:
    """8 tenants' system prompts whose rendered system turn is exactly 12 blocks, so the user
    turn (under one block) adds no cached block of its own: the cache holds system prompts.
    Each ``run`` gets its own prompts (no run profits from the previous one's cache)."""
    from heron.route.tokenize import RouteTokenizer

    tok, rng = RouteTokenizer.from_dir(tokenizer_dir), random.Random(run)
    words = ["policy", "refund", "order", "shipping", "account", "billing", "support",
             "warranty", "return", "invoice", "delivery", "customer", "product", "price"]
    prompts = []
    for t in range(TENANTS):
        text = f"You are the {run} assistant of tenant {t}."
        for _ in range(1000):
            n = len(tok.encode_chat([{"role": "system", "content": text}],
                                    add_generation_prompt=False))
            if n == 12 * BLOCK:
                break
            text = text + " " + rng.choice(words) if n < 12 * BLOCK \
                else text[:text.rstrip().rfind(" ")]
        prompts.append(text)
    return prompts


def _hit_counters(urls, metric_value) -> list[tuple[float, float]]:
    """Each worker's (prefix-cache hits, queries) in prompt tokens, from its /metrics."""
    out = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out.append((metric_value(text, "heron:prefix_cache_hits_total"),
                    metric_value(text, "heron:prefix_cache_queries_total")))
    return out


def _run_workload(router, workers: list[str], systems: list[str], metric_value) -> dict:
    """The shuffled multi-tenant workload, one request at a time; the workers' reported
    prefix-hit rate over it (their /metrics counters; the responses' cached_tokens agree)
    and the prompt tokens each worker looked up."""
    before = _hit_counters(workers, metric_value)
    jobs = [(t, u) for t in range(TENANTS) for u in range(USERS)]
    random.Random(1).shuffle(jobs)
    cached = prompt = 0
    for t, u in jobs:
        body = {"model": "tiny", "max_tokens": 1, "temperature": 0.0,
                "messages": [{"role": "system", "content": systems[t]},
                             {"role": "user", "content": f"u{u} q{t}"}]}
        try:
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        except httpx.HTTPError as e:  # say what the router saw
            raise AssertionError(f"{e!r}; router log: {router.log_tail()}") from e
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    after = _hit_counters(workers, metric_value)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    served = [a[1] - b[1] for a, b in zip(after, before)]
    assert (hits, sum(served)) == (cached, prompt)
    return {"hit_rate": hits / sum(served), "served": served}


def test_cache_aware_doubles_the_workers_prefix_hit_rate(three_workers, start_router,
                                                          metric_value):
    urls = three_workers.urls
    info = httpx.get(f"{urls[0]}/server_info", timeout=10).json()
    assert info["kv_events_endpoint"].startswith("tcp://") and info["block_size"] == BLOCK
    results = {}
    for policy in ("round_robin", "cache_aware"):
        router = start_router("--worker-urls", *urls, "--policy", policy,
                              "--host", "127.0.0.1")
        systems = _system_prompts(info["tokenizer_dir"], policy)
        results[policy] = _run_workload(router, urls, systems, metric_value)
        results[policy]["metrics"] = router.metrics()
    rr, ca = results["round_robin"], results["cache_aware"]
    print(f"prefix hit rate: round_robin {rr['hit_rate']:.3f}, cache_aware "
          f"{ca['hit_rate']:.3f}; prompt tokens per worker {ca['served']} {rr['served']}")
    assert ca["hit_rate"] >= 2 * rr["hit_rate"], (rr, ca)
    assert ca["hit_rate"] > 0.6
    assert metric_value(ca["metrics"], "heron_router:routing_decisions_total",
                        reason="cache_hit") >= TENANTS * USERS - 2 * TENANTS
    # no worker starved or flooded: each serves its 2-3 tenants
    share = sum(ca["served"]) / NUM_WORKERS
    assert all(abs(s - share) <= share / 2 + 1 for s in ca["served"]), ca["served"]


def test_a_hot_tenant_burst_spreads_under_the_balance_thresholds(three_workers, start_router,
                                                                 metric_value):
    """24 concurrent requests of one tenant: cache_hit sends them to the worker holding the
    prefix until it is more than 4 requests (and 1.5x) ahead, then the balance rule spreads
    them; every worker serves some, all answer 200."""
    urls = three_workers.urls
    info = httpx.get(f"{urls[0]}/server_info", timeout=10).json()
    system = _system_prompts(info["tokenizer_dir"], "hot")[0]
    router = start_router("--worker-urls", *urls, "--policy", "cache_aware",
                          "--balance-abs-threshold", "4", "--balance-rel-threshold", "1.5")

    async def burst():
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
            body = {"model": "tiny", "max_tokens": 1,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": "u0"}]}
            await client.post("/v1/chat/completions", json=body)  # the prefix lands somewhere
            bodies = [{**body, "messages": [body["messages"][0],
                                            {"role": "user", "content": f"u{i}"}]}
                      for i in range(1, 25)]
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b)
                                          for b in bodies))

    answers = asyncio.run(burst())
    assert all(r.status_code == 200 for r in answers)
    text = router.metrics()
    assert metric_value(text, "heron_router:routing_decisions_total",
                        reason="balance_override") >= 1
    per_worker = [metric_value(text, "heron_router:requests_total", worker=url) for url in urls]
    assert sum(per_worker) == 25 and min(per_worker) >= 1, per_worker
