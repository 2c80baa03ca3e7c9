"""Results returned by the engine and the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> (logprob, rank in the full vocabulary, 1-based).
PositionLogprobs = dict[int, tuple[float, int]]


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    # "stop" | "length" | "abort" | "error" (see RequestOutput.error) | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything known about a request so far (final when ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # why the engine failed this request (finish_reason "error")


# ---- folding delta outputs ------------------------------------------------------------------
# A delta ``RequestOutput`` carries, per completion that progressed, only what is new since the
# previous one (``RequestOutputKind.DELTA``): its ``outputs`` name the completions that changed
# (by ``index``), ``prompt_logprobs`` comes once. The helpers below fold deltas without copying
# anything twice: tokens and logprobs are extended, text pieces are joined once.


class _Pieces:
    """One completion being built from deltas."""

    __slots__ = ("index", "token_ids", "texts", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, index: int, logprobs: bool) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[PositionLogprobs] | None = [] if logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, comp: CompletionOutput) -> None:
        self.token_ids.extend(comp.token_ids)
        if comp.text:
            self.texts.append(comp.text)
        if comp.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(comp.logprobs)
        if comp.finish_reason is not None:
            self.finish_reason, self.stop_reason = comp.finish_reason, comp.stop_reason

    def text(self) -> str:
        if len(self.texts) > 1:
            self.texts = ["".join(self.texts)]
        return self.texts[0] if self.texts else ""

    def build(self, copy: bool) -> CompletionOutput:
        """The completion so far; ``copy``: lists the caller may keep while we go on adding."""
        ids, lps = self.token_ids, self.logprobs
        if copy:
            ids, lps = list(ids), (list(lps) if lps is not None else None)
        return CompletionOutput(self.index, self.text(), ids, lps, self.finish_reason,
                                self.stop_reason)


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One delta output equal to several consecutive delta outputs of one request (what a
    slow consumer missed); a single output is returned as it is. Cost: O(what is new)."""
    if len(outputs) == 1:
        return outputs[0]
    pieces: dict[int, _Pieces] = {}
    prompt_logprobs, error = None, None
    for out in outputs:
        for comp in out.outputs:
            if (p := pieces.get(comp.index)) is None:
                p = pieces[comp.index] = _Pieces(comp.index, comp.logprobs is not None)
            p.add(comp)
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        error = out.error or error
    last = outputs[-1]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [pieces[i].build(copy=False) for i in sorted(pieces)],
                         finished=last.finished, prompt_logprobs=prompt_logprobs,
                         metrics=last.metrics, num_cached_tokens=last.num_cached_tokens,
                         error=error)


class OutputAccumulator:
    """Folds the delta outputs of one request into its cumulative output.

    ``n`` (with ``logprobs``) makes every completion present from the start, as a cumulative
    consumer expects; without it completions appear as their first delta does.
    """

    def __init__(self, n: int = 0, logprobs: bool = False) -> None:
        self._pieces: dict[int, _Pieces] = {i: _Pieces(i, logprobs) for i in range(n)}
        self._last: RequestOutput | None = None
        self._prompt_logprobs = None
        self._error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        for comp in delta.outputs:
            if (p := self._pieces.get(comp.index)) is None:
                p = self._pieces[comp.index] = _Pieces(comp.index, comp.logprobs is not None)
            p.add(comp)
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        self._error = delta.error or self._error
        self._last = delta

    def output(self, copy: bool = True) -> RequestOutput:
        """Everything so far. ``copy`` (O(length)): later deltas never change what was
        returned; without it the result shares lists with the accumulator (use it last)."""
        last = self._last
        assert last is not None, "no output added yet"
        outputs = [self._pieces[i].build(copy) for i in sorted(self._pieces)]
        prompt_logprobs = self._prompt_logprobs
        if copy and prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs,
                             finished=last.finished, prompt_logprobs=prompt_logprobs,
                             metrics=dict(last.metrics), num_cached_tokens=last.num_cached_tokens,
                             error=self._error)
