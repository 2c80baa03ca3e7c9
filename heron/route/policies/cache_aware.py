"""``cache_aware``: send a request where its prompt's prefix is cached, under load balance.

Each worker is scored by the fraction of the request's prompt it holds:
- **precise** for a worker whose ``/server_info`` names a ``kv_events_endpoint``: the router
  subscribes to its KV events (``kv_subscriber``), keeps the set of block hashes it holds
  (``block_index``), tokenizes the request as the worker will (``heron.route.tokenize``) and
  counts the prompt's leading blocks the worker holds, hashed with the worker's block size
  and the request's ``cache_salt`` (``heron.engine.prefix_cache.block_hashes``);
- **approximate** otherwise (no events, no tokenizer on this machine, or no event batch
  received yet): a character radix tree of the prompts the router sent that worker
  (``text_tree``), as SGLang's router guesses. Both give a fraction in [0, 1], so workers of
  either kind compete in one pick.

The pick, in order (SGLang's rules, with its flag defaults):
1. load imbalance (outstanding requests: ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``): the least loaded worker, ``balance_override``;
2. best match ratio below ``cache_threshold``: the worker with the smallest tree (the most
   room for a new prefix: new tenants spread by what each worker caches, as SGLang does;
   ties: the least loaded), ``no_hit``;
3. else the best-matching worker, ``cache_hit``; among workers that match about as well
   (within ``NEAR_TIE`` of the best: a few characters of a user's text are noise) the least
   loaded, so a hot prefix, once the balance rule has copied it to a second worker, spreads
   over both instead of piling on one.
"Least loaded" orders by outstanding requests, outstanding tokens, then the smallest tree,
then in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from heron.route.policies.base import Decision, Policy, RouteRequest
from heron.route.policies.block_index import BlockIndex, PromptHashes
from heron.route.policies.kv_subscriber import KVEventSubscriber, connect_address
from heron.route.policies.text_tree import TextTree

if TYPE_CHECKING:
    from heron.route.config import RouterConfig
    from heron.route.tokenize import RouteTokenizer
    from heron.route.workers import WorkerState

logger = logging.getLogger("heron.route")

TICK_S = 1.0  # the background task: pick up new server info, expire guesses, evict trees
NEAR_TIE = 0.05  # matches within this fraction of the best one count as ties


@dataclass(eq=False)
class _WorkerCache:
    """What the policy knows of one worker's cache. ``index``/``tokenizer`` are set once its
    server info says it publishes events (precise scoring needs both)."""

    worker: "WorkerState"
    tree: TextTree = field(default_factory=TextTree)
    index: BlockIndex | None = None
    subscriber: KVEventSubscriber | None = None
    tokenizer: "RouteTokenizer | None" = None
    info_seen: object = None  # the server_info object last set up from (identity)

    @property
    def precise(self) -> bool:
        """Scored from KV events: set up, and events do arrive (until the first batch the
        text tree knows as much; a worker whose events never reach us stays approximate)."""
        return self.index is not None and self.tokenizer is not None \
            and self.subscriber is not None and self.subscriber.batches > 0


class CacheAwarePolicy(Policy):
    """Prefix-cache-aware routing under SGLang's balance thresholds (see the module doc).

    Contract: ``pick`` returns one of ``candidates``; it tokenizes at most once per distinct
    tokenizer per request and never blocks on the network. ``on_routed`` records the prompt
    in the chosen worker's tree (and, when precise, its blocks as speculative until the
    worker's events confirm them). KV-event subscriptions start as workers' server info
    arrives (in ``pick`` or on the background tick) and stop when a worker leaves.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2 ** 20,
                 eviction_interval_s: float = 60.0, tokenizer: str | None = None) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self.tokenizer_path = tokenizer  # overrides every worker's tokenizer_dir
        self._workers: dict[str, _WorkerCache] = {}
        self._tokenizers: dict[tuple, RouteTokenizer | None] = {}
        self._turn = itertools.count()
        self._memo: tuple[RouteRequest | None, dict] = (None, {})
        self._task: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: "RouterConfig") -> CacheAwarePolicy:
        return cls(config.cache_threshold, config.balance_abs_threshold,
                   config.balance_rel_threshold, config.max_tree_size,
                   config.eviction_interval_s, config.tokenizer)

    # ---- the pick ------------------------------------------------------------------------
    def pick(self, request: RouteRequest, candidates: list["WorkerState"]) -> Decision:
        caches = [self._cache_of(w) for w in candidates]
        hits = [self._cached_tokens(request, c) for c in caches]
        chosen, reason = self._choose(caches, hits)
        return Decision(caches[chosen].worker, reason, hits[chosen][0])

    def _choose(self, caches: list[_WorkerCache], hits: list[tuple[int, float]]):
        """(index of the chosen cache, reason)."""
        loads = [c.worker.outstanding_requests for c in caches]
        everyone = range(len(caches))
        if self._imbalanced(loads):
            return self._ordered(caches, everyone), "balance_override"
        best = max(ratio for _, ratio in hits)
        if best < self.cache_threshold or best <= 0.0:
            return self._ordered(caches, everyone, room_first=True), "no_hit"
        matching = [i for i in everyone if hits[i][1] >= best * (1 - NEAR_TIE)]
        return self._ordered(caches, matching), "cache_hit"

    def _imbalanced(self, loads: list[int]) -> bool:
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs and high > self.balance_rel * low

    def _ordered(self, caches: list[_WorkerCache], among, room_first: bool = False) -> int:
        """The least loaded of ``among`` (or, ``room_first``, the one with the smallest
        tree, then the least loaded); full ties take turns."""
        turn, n = next(self._turn), len(caches)

        def key(i: int):
            w, size = caches[i].worker, caches[i].tree.size
            load = (w.outstanding_requests, w.outstanding_tokens)
            return (size, *load, (i - turn) % n) if room_first else (*load, size, (i - turn) % n)

        return min(among, key=key)

    # ---- scoring -------------------------------------------------------------------------
    def _cached_tokens(self, request: RouteRequest, cache: _WorkerCache) -> tuple[int, float]:
        """(predicted cached prompt tokens, their fraction of the prompt) on this worker."""
        if cache.precise:
            prompt = self._prompt_hashes(request, cache.tokenizer)
            if prompt is not None and len(prompt):
                tokens = prompt.cached_tokens(cache.index)
                return tokens, tokens / len(prompt)
        key = _tree_key(request)
        if not key:
            return 0, 0.0
        chars = cache.tree.match(key)
        ratio = chars / len(key)
        return int(ratio * request.prompt_tokens), ratio

    def _prompt_hashes(self, request: RouteRequest, tokenizer) -> PromptHashes | None:
        """The request's token ids under ``tokenizer`` (memoized for this request); also
        refines ``request.prompt_tokens`` to the exact count."""
        memo_request, memo = self._memo
        if memo_request is not request:
            memo = {}
            self._memo = (request, memo)
        key = id(tokenizer)
        if key not in memo:
            from heron.route.tokenize import request_token_ids

            ids = request_token_ids(tokenizer, request.endpoint, request.body)
            memo[key] = None if ids is None else PromptHashes(ids, request.cache_salt)
            if ids:
                request.prompt_tokens = len(ids)
        return memo[key]

    # ---- learning ------------------------------------------------------------------------
    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        cache = self._cache_of(decision.worker)
        key = _tree_key(request)
        if key:
            cache.tree.insert(key)
        if cache.index is not None and cache.tokenizer is not None:
            prompt = self._prompt_hashes(request, cache.tokenizer)
            if prompt is not None:
                cache.index.add_speculative(prompt.for_block_size(cache.index.block_size))

    def on_worker_added(self, worker: "WorkerState") -> None:
        self._cache_of(worker)

    def on_worker_removed(self, worker: "WorkerState") -> None:
        cache = self._workers.pop(worker.url, None)
        if cache is not None and cache.subscriber is not None:
            _stop_soon(cache.subscriber)

    def _cache_of(self, worker: "WorkerState") -> _WorkerCache:
        cache = self._workers.get(worker.url)
        if cache is None or cache.worker is not worker:
            if cache is not None and cache.subscriber is not None:
                _stop_soon(cache.subscriber)
            cache = self._workers[worker.url] = _WorkerCache(worker)
        if worker.server_info is not cache.info_seen:
            self._set_up(cache)
        return cache

    def _set_up(self, cache: _WorkerCache) -> None:
        """(Re)build the precise side from the worker's server info."""
        info = cache.info_seen = cache.worker.server_info
        if cache.subscriber is not None:
            _stop_soon(cache.subscriber)
        cache.index = cache.subscriber = cache.tokenizer = None
        endpoint = (info or {}).get("kv_events_endpoint")
        block_size = (info or {}).get("block_size")
        if not endpoint or not block_size:
            return
        tokenizer = self._tokenizer_for(info)
        if tokenizer is None:
            return
        index = BlockIndex(int(block_size))
        subscriber = KVEventSubscriber(connect_address(endpoint, cache.worker.url), index,
                                       cache.worker.url)
        try:
            subscriber.start()
        except RuntimeError:  # no running event loop: the next call on the loop retries
            cache.info_seen = None
            return
        cache.index, cache.subscriber, cache.tokenizer = index, subscriber, tokenizer

    def _tokenizer_for(self, info: dict):
        """The worker's tokenizer (--tokenizer overrides its dir), loaded once per dir and
        template; None (logged once) when it cannot be loaded here."""
        path = self.tokenizer_path or info.get("tokenizer_dir")
        key = (path, info.get("chat_template"))
        if key not in self._tokenizers:
            from heron.route.tokenize import RouteTokenizer

            tokenizer = None
            if path:
                try:
                    tokenizer = RouteTokenizer.from_dir(path, info.get("chat_template"))
                except Exception as e:  # not on this machine, no tokenizer.json, bad template
                    logger.warning("cache_aware: cannot load tokenizer %s (%s); scoring "
                                   "its workers approximately", path, e)
            self._tokenizers[key] = tokenizer
        return self._tokenizers[key]

    # ---- background ----------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick_loop(),
                                                            name="cache_aware")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for cache in self._workers.values():
            if cache.subscriber is not None:
                await cache.subscriber.stop()
                cache.subscriber = None

    async def _tick_loop(self) -> None:
        next_eviction = time.monotonic() + self.eviction_interval_s
        while True:
            await asyncio.sleep(min(TICK_S, self.eviction_interval_s))
            evict = time.monotonic() >= next_eviction
            if evict:
                next_eviction = time.monotonic() + self.eviction_interval_s
            self.maintain(evict)

    def maintain(self, evict: bool = True) -> None:
        """Set up workers whose server info arrived, expire speculative blocks, and (when
        ``evict``) shrink every tree to ``max_tree_size`` characters."""
        for cache in list(self._workers.values()):
            if cache.worker.server_info is not cache.info_seen:
                self._set_up(cache)
            if cache.index is not None:
                cache.index.expire()
            if evict:
                cache.tree.evict(self.max_tree_size)


def _tree_key(request: RouteRequest) -> str:
    """The text the approximate tree keys on; a salt gets its own subtree (tenants apart)."""
    if request.cache_salt:
        return f"\x00{request.cache_salt}\x00{request.text}"
    return request.text


def _stop_soon(subscriber: KVEventSubscriber) -> None:
    try:
        asyncio.get_running_loop().create_task(subscriber.stop())
    except RuntimeError:  # no loop: nothing is receiving anyway
        pass
