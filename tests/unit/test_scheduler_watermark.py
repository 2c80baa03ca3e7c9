"""Near a full KV cache the scheduler stops admitting prefills while decodes continue."""

from __future__ import annotations

from heron.config import SchedulerConfig
from heron.engine.kv_cache import KVCacheManager
from heron.engine.request import Request
from heron.engine.scheduler import Scheduler
from heron.sampling_params import SamplingParams
from scheduler_steps import complete, schedule


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=50), max_tokens=50)


def _step(scheduler: Scheduler) -> list[str]:
    """One step (token 1 for each sequence that samples); the ids it scheduled."""
    out = schedule(scheduler)
    complete(scheduler, out, lambda request: 1)
    return [s.request.request_id for s in out.scheduled]


def test_watermark_holds_back_new_prefills_but_not_decodes():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, kv_watermark=0.25), kv,
                          max_model_len=80)  # the pool's 20 x 4 tokens
    scheduler.add(_request("big", 56))  # 14 blocks: admitted, the engine was idle
    assert _step(scheduler) == ["big"]
    scheduler.add(_request("small", 8))  # 2 more blocks would leave 4 < 5 free
    for _ in range(3):
        assert _step(scheduler) == ["big"]  # the decode continues, the prefill waits
    assert [r.request_id for r in scheduler.waiting] == ["small"]
    scheduler.finish(scheduler.running[0], scheduler.running[0].status.FINISHED_ABORTED)
    assert _step(scheduler) == ["small"]


def test_zero_watermark_admits_until_blocks_run_out():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256, kv_watermark=0.0), kv,
                          max_model_len=80)
    scheduler.add(_request("big", 56))
    _step(scheduler)
    scheduler.add(_request("small", 8))
    assert _step(scheduler) == ["big", "small"]
