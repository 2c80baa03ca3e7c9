"""The step boundary: what the engine core sends a worker each step, and what comes back.

Plain msgspec data (no ``Request`` objects, no tensors), so one message drives an in-process
worker, a worker process, or later N tensor-parallel ranks. The core describes each request
once (``NewRequest``: prompt, sampling params, blocks); afterwards a step carries only what
changed (``CachedRequests``: new block ids, progress) and which requests run how many tokens.
The worker keeps everything else in its persistent batch state (``input_batch.InputBatch``).

A worker appends the tokens it samples to its own copy of each sequence, so the core never
sends tokens back. Preemption keeps the worker's state (tokens, seeded generator) but frees
its batch row and blocks; the request comes back in ``CachedRequests`` with a whole new
block table (``num_kept_blocks`` 0). A running sequence whose computed block was swapped for
an identical cached one is sent its table again from that block on.
"""

from __future__ import annotations

import msgspec

from heron.sampling_params import SamplingParams

# One position's logprobs: token id -> (logprob, rank in the vocabulary, 1-based).
Logprobs = dict[int, tuple[float, int]]


class NewRequest(msgspec.Struct, array_like=True):
    """A sequence the worker has not seen: everything it needs to run and sample it."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own (validated where it was built)
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int  # > 0 after a prefix-cache hit
    eos_token_ids: list[int]
    generator_seed: int | None = None  # this sequence's own seed (n > 1: derived per child)


class CachedRequests(msgspec.Struct, array_like=True):
    """Requests the worker already holds that run this step, with what changed: parallel
    lists, one entry per request."""

    req_ids: list[str] = []
    num_kept_blocks: list[int] = []  # the worker keeps this prefix of its block tables...
    new_block_ids: list[list[list[int]]] = []  # ...and appends these (per KV cache group)
    num_computed_tokens: list[int] = []  # the core's count before this step
    # With pipeline parallelism only: the tokens appended since the worker last saw each
    # request (its ranks do not all sample, so the core sends them). Empty otherwise: a
    # worker appends what it sampled itself.
    new_token_ids: list[list[int]] = []


class SchedulerOutput(msgspec.Struct, tag=True):
    """One step. ``req_ids[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at its
    ``num_computed_tokens``; the batch is laid out in this order."""

    req_ids: list[str]
    num_scheduled_tokens: list[int]
    step_id: int = 0  # increasing; steps run in this order on every rank
    new_requests: list[NewRequest] = []
    cached: CachedRequests = msgspec.field(default_factory=CachedRequests)
    preempted_req_ids: list[str] = []  # row and blocks gone; tokens kept for resumption
    finished_req_ids: list[str] = []  # gone for good (finished, aborted, failed)
    # speculative decoding: draft tokens to verify this step, per request (scheduled after
    # its last token: num_scheduled_tokens = 1 + len(drafts)); and how many tokens the worker
    # drafts for each sequence that samples in this step (0: speculation is off this step)
    spec_token_ids: dict[str, list[int]] = {}
    num_spec_tokens: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids

    def only(self, indices: list[int]) -> SchedulerOutput:
        """The same step restricted to some of its requests and carrying no state changes
        (already applied): how fault isolation re-runs parts of a failed step."""
        req_ids = [self.req_ids[i] for i in indices]
        return SchedulerOutput(req_ids, [self.num_scheduled_tokens[i] for i in indices],
                               self.step_id, num_spec_tokens=self.num_spec_tokens,
                               spec_token_ids={r: self.spec_token_ids[r] for r in req_ids
                                               if r in self.spec_token_ids})


class ModelRunnerOutput(msgspec.Struct, tag=True):
    """Per scheduled request, in ``SchedulerOutput.req_ids`` order: the tokens sampled this
    step (empty mid-prefill; one; or the accepted draft tokens plus the bonus token) and, if
    asked for, one logprobs entry per sampled token; then the tokens drafted for the next
    step, per sequence that sampled (speculative decoding)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None]
    # prompt logprobs computed this step: req id -> entries for positions
    # [first, first + len) where first = num_computed_tokens + 1 before the step
    prompt_logprobs: dict[str, list[Logprobs]] = {}
    spec_token_ids: dict[str, list[int]] = {}

    @classmethod
    def merge(cls, parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        merged = cls([], [], [], {}, {})
        for part in parts:
            merged.req_ids += part.req_ids
            merged.sampled_token_ids += part.sampled_token_ids
            merged.logprobs += part.logprobs
            merged.prompt_logprobs.update(part.prompt_logprobs)
            merged.spec_token_ids.update(part.spec_token_ids)
        return merged


class WorkerInfo(msgspec.Struct, tag=True):
    """What a loaded worker tells the core: the KV capacity it sized and the context it fits."""

    num_kv_blocks: int
    max_model_len: int
    attention_backend: str
    device: str
    rank: int = 0
    bytes_read: int = 0  # checkpoint bytes this rank read (its shards, when sharded)
    quantization: str = "none"  # how the weights are stored (quant.config describe())
    weight_bytes: int = 0  # this rank's weights as the forward reads them


def num_rejected(drafts: list[int], sampled: list[int]) -> int:
    """Draft tokens a step rejected (their KV was computed, but they are not part of the
    sequence): the worker returns the accepted drafts plus one token of its own."""
    if not drafts:
        return 0
    return len(drafts) + 1 - len(sampled) if sampled else len(drafts)
