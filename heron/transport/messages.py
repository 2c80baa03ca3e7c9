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

from typing import Union

import msgspec

from heron.engine.core_outputs import SequenceDelta
from heron.engine.stats import EngineStats
from heron.sampling_params import SamplingParams


# ---- API -> core ------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated where it was built (msgspec only checks the types)
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


class OutputsMsg(msgspec.Struct, tag=True):
    outputs: list[SequenceDelta]  # as the core's step (or an abort) produced them
    stats: EngineStats  # the core's, after the step


class ErrorMsg(msgspec.Struct, tag=True):
    request_id: str | None  # None: fatal error of the core (startup or step)
    message: str


class Heartbeat(msgspec.Struct, tag=True):
    timestamp: float  # time.monotonic() in the core when sent


OutputMsg = Union[ReadyMsg, OutputsMsg, ErrorMsg, Heartbeat]

