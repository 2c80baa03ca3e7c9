"""Sequence deltas -> ``RequestOutput``s: detokenization, stop strings, n > 1 grouping.

Runs outside the core's step loop: in the offline engine after each step, or in the API
process on every delta batch the core sends. Each sequence keeps its tokens in a list that
only grows and its text in its detokenizer, so a DELTA output costs O(new tokens); only the
CUMULATIVE kind copies what was generated so far (each time it is asked for).

A stop string is found here, after the core sampled the token that completes it: the caller
must finish that sequence in the core (``ProcessedOutputs.stops``); tokens the core produced
for it meanwhile are dropped.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from heron.engine.core_outputs import RequestOutputKind, SequenceDelta, decode_logprobs
from heron.engine.detokenizer import IncrementalDetokenizer, safe_end
from heron.engine.isolation import describe
from heron.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_METRIC_KEYS = ("arrival_time", "scheduled_time", "first_token_time", "finish_time")


@dataclass
class _Sequence:
    """One completion: what it generated, and how much of it a DELTA consumer has seen."""

    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)
    num_preemptions: int = 0
    sent_tokens: int = 0  # DELTA: tokens (and logprobs) already output
    sent_text: int = 0  # DELTA: characters already output
    finish_sent: bool = False

    @property
    def text(self) -> str:
        """All the text so far (O(length): for cumulative outputs)."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def num_chars(self) -> int:
        return self.detokenizer.num_chars if self.detokenizer is not None else 0

    def text_between(self, start: int, end: int) -> str:
        """text[start:end], in O(end - start) for a recent start."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text_between(start, end)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    sequences: list[_Sequence]
    max_stop_len: int
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    stops: list[tuple[str, int, str]]  # (request id, completion index, stop string hit)
    # requests whose output processing raised: their output ends with "error" here; the
    # caller must abort them in the core
    failed: list[str] = field(default_factory=list)


class OutputProcessor:
    """Holds the output state of every request it was told about (``add_request``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams,
                    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        sequences = [_Sequence(self._detokenizer(prompt_token_ids, params),
                               logprobs=[] if params.logprobs is not None else None)
                     for _ in range(params.n)]
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, kind, sequences,
            max((len(s) for s in params.stop), default=0))

    def _detokenizer(self, prompt_token_ids, params) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                      params.include_stop_str_in_output,
                                      params.skip_special_tokens)

    def has(self, request_id: str) -> bool:
        return request_id in self.requests

    def abort(self, request_id: str) -> None:
        """Forget a request (its consumer is gone)."""
        self.requests.pop(request_id, None)

    def process(self, deltas: list[SequenceDelta]) -> ProcessedOutputs:
        by_request: dict[str, list[SequenceDelta]] = defaultdict(list)
        for delta in deltas:
            by_request[delta.request_id].append(delta)
        result = ProcessedOutputs([], [])
        for request_id, group in by_request.items():
            state = self.requests.get(request_id)
            if state is None:
                continue  # aborted here already
            try:
                out = self._process_request(state, group, result.stops)
            except Exception as exc:  # noqa: BLE001 - a detokenizer bug costs one request
                logger.exception("output processing of request %s failed", request_id)
                out = self._fail(state, exc)
                result.failed.append(request_id)
            if out is not None:
                result.outputs.append(out)
            if state.finished:
                del self.requests[request_id]
        return result

    def _process_request(self, state: _RequestState, deltas: list[SequenceDelta],
                         stops: list) -> RequestOutput | None:
        for delta in deltas:
            hit = self._apply(state, delta)
            if hit is not None:
                stops.append((state.request_id, delta.index, hit))
        return self._output(state)

    def _fail(self, state: _RequestState, exc: Exception) -> RequestOutput | None:
        state.error = describe(exc)
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
        return self._output(state)

    def _apply(self, state: _RequestState, delta: SequenceDelta) -> str | None:
        """Fold one delta into its sequence; returns a stop string that ended it here."""
        seq = state.sequences[delta.index]
        if seq.finish_reason is not None:
            return None  # ended by a stop string: the core's later tokens are not part of it
        _note_first_delta(state, delta)
        seq.token_ids.extend(delta.new_token_ids)
        if seq.logprobs is not None and delta.new_logprobs:
            seq.logprobs.extend(decode_logprobs(p) for p in delta.new_logprobs)
        for key in _METRIC_KEYS:
            if getattr(delta, key) is not None:
                seq.metrics[key] = getattr(delta, key)
        seq.num_preemptions = delta.num_preemptions
        if delta.error is not None:
            state.error = delta.error
        hit = None
        detok = seq.detokenizer
        if detok is not None and delta.new_token_ids:
            hit = detok.update(delta.new_token_ids)
        if delta.finished:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            if detok is not None and hit is None:
                detok.flush()
            return None  # a token stop came first: the stop string does not rename it
        if hit is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
            seq.metrics["finish_time"] = time.monotonic()
        return hit

    # ---- outputs by kind -------------------------------------------------------------------
    def _output(self, state: _RequestState) -> RequestOutput | None:
        if state.kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if state.kind is RequestOutputKind.DELTA:
            completions = [c for i, seq in enumerate(state.sequences)
                           if (c := _delta_completion(i, seq, state.max_stop_len)) is not None]
            if not completions:
                return None  # nothing new (say, tokens after a stop string)
        else:
            completions = [_cumulative_completion(i, seq)
                           for i, seq in enumerate(state.sequences)]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions,
            finished=state.finished, prompt_logprobs=state.prompt_logprobs,
            metrics=_metrics(state.sequences), num_cached_tokens=state.num_cached_tokens,
            error=state.error)


def _note_first_delta(state: _RequestState, delta: SequenceDelta) -> None:
    if delta.num_cached_tokens:
        state.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        state.prompt_logprobs = [decode_logprobs(p) for p in delta.prompt_logprobs]


def _cumulative_completion(index: int, seq: _Sequence) -> CompletionOutput:
    return CompletionOutput(index, seq.text, list(seq.token_ids),
                            list(seq.logprobs) if seq.logprobs is not None else None,
                            seq.finish_reason, seq.stop_reason)


def _delta_completion(index: int, seq: _Sequence, max_stop_len: int) -> CompletionOutput | None:
    """What ``seq`` gained since its previous delta (None if nothing): new tokens, and the new
    text that can no longer turn into a stop string."""
    finished = seq.finish_reason is not None
    if seq.finish_sent:
        return None
    end = safe_end(seq.num_chars, seq.sent_text, finished, max_stop_len)
    new_tokens = seq.token_ids[seq.sent_tokens:]
    if not new_tokens and end == seq.sent_text and not finished:
        return None
    logprobs = seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None
    out = CompletionOutput(index, seq.text_between(seq.sent_text, end), new_tokens, logprobs,
                           seq.finish_reason, seq.stop_reason)
    seq.sent_tokens, seq.sent_text, seq.finish_sent = len(seq.token_ids), end, finished
    return out


def _metrics(sequences: list[_Sequence]) -> dict:
    def pick(key, fn):
        values = [s.metrics[key] for s in sequences if s.metrics.get(key) is not None]
        return fn(values) if values else None

    return {
        "arrival_time": pick("arrival_time", min),
        "scheduled_time": pick("scheduled_time", min),
        "first_token_time": pick("first_token_time", min),
        "finish_time": pick("finish_time", max),
        "num_preemptions": sum(s.num_preemptions for s in sequences),
    }
