"""Typed messages between the API process and the engine-core process (msgpack via msgspec).

Two one-way ZMQ channels, both bound by the API side:

* input  (API -> core, PUSH/PULL): ``AddRequest``, ``Abort``, ``FinishSequences`` (stop
  strings found by the API side's output processor), ``ResetPrefixCache``, ``Shutdown``.
* output (core -> API, PUSH/PULL): ``ReadyMsg`` once, then ``OutputsMsg`` per step (and at
  least every ~0.5 s while idle, for fresh stats), ``ErrorMsg`` for rejected requests
  (``request_id`` set) or a fatal core error (``request_id`` None; the core then exits), and
  a ``Heartbeat`` every second from a thread of its own, also while a long step runs: when
  they stop, the core is frozen or gone.

Nothing is pickled: every field is a plain msgpack type. The core's ``SequenceDelta``s
(``heron.engine.core_outputs``) cross as they are: per sequence only its new tokens and
logprobs, no text; the client's ``OutputProcessor`` makes text, stop strings and n > 1 groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec

from heron.engine.core_outputs import SequenceDelta
from heron.sampling_params import SamplingParams


# ---- API -> core ------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams init fields (see params_to_dict)
    arrival_time: float  # time.monotonic() in the API process (same clock in the core)
    cache_salt: str | None = None  # prefix-cache namespace (tenant isolation)


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class FinishSequences(msgspec.Struct, tag=True):
    """Stop strings found in the API process: finish each (request id, completion index)
    with "stop" (stop string as its stop reason) and free its blocks; the core sends nothing
    more for it."""

    sequences: list[tuple[str, int, str]]


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Free every cached KV block no request is using (before any later input is handled)."""


class Shutdown(msgspec.Struct, tag=True):
    pass


InputMsg = Union[AddRequest, Abort, FinishSequences, ResetPrefixCache, Shutdown]


# ---- core -> API ------------------------------------------------------------------------------
class ReadyMsg(msgspec.Struct, tag=True):
    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    tokenizer_dir: str | None  # load the same tokenizer here (None: token ids only)
    quantization: str = "none"  # how the weights are stored
    weight_bytes: int = 0  # all ranks' weights as the forward reads them


class StatsMsg(msgspec.Struct, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0  # user-facing requests (n > 1 counts once)
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_total: int = 0  # prompt tokens of accepted requests
    num_generation_tokens_total: int = 0  # tokens generated (all completions)
    num_requests_finished_total: int = 0
    num_requests_rejected_total: int = 0
    timestamp: float = 0.0  # time.monotonic() when taken
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens whose KV was reused
    num_cached_blocks: int = 0  # blocks the prefix cache holds (referenced or not)
    num_prefill_tokens_total: int = 0  # prompt (and recomputed) tokens actually computed
    # speculative decoding (all 0 without it): sequence-steps that verified drafts, drafts
    # verified, drafts accepted, and accepted drafts by position (0-based)
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_pos_total: list[int] = []


class OutputsMsg(msgspec.Struct, tag=True):
    outputs: list[SequenceDelta]  # as the core's step (or an abort) produced them
    stats: StatsMsg


class ErrorMsg(msgspec.Struct, tag=True):
    request_id: str | None  # None: fatal error of the core (startup or step)
    message: str


class Heartbeat(msgspec.Struct, tag=True):
    timestamp: float  # time.monotonic() in the core when sent


OutputMsg = Union[ReadyMsg, OutputsMsg, ErrorMsg, Heartbeat]


# ---- conversions ------------------------------------------------------------------------------
def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """The init fields of ``params`` as plain msgpack-able values."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    """Rebuild (and re-validate: ValueError on bad values) ``SamplingParams``."""
    return SamplingParams(**data)
