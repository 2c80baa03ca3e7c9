"""Per-request sampling parameters, validated once: when they are built.

The params cross every boundary as this one dataclass (msgspec encodes and decodes it: the
API process -> the engine core's ``AddRequest`` -> the ``Request`` -> the step's
``NewRequest`` -> the worker). Building them in Python (a caller, the HTTP edge,
``dataclasses.replace``) normalizes and validates; decoding them in another heron process
only checks the field types, as they were validated where they were built.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

# Hard limits that keep a single request from exhausting host memory.
MAX_LOGPROBS = 20
MAX_N = 128
# Seeds are 64-bit (torch.Generator's range); signed values map to their two's complement.
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1
# Integer knobs (top_k, token counts, token ids) fit in int32 on the wire and on the device.
MAX_INT32 = 2**31 - 1
# Temperatures below this sample greedily: dividing logits by them overflows to inf / NaN.
SAMPLING_EPS = 1e-5


def streaming_kv_spec(value) -> tuple[int, int] | None:
    """StreamingLLM's cache of one sequence, ``{"sink_tokens": S, "window": W}`` (or ``(S, W)``)
    -> ``(S, W)``: the first S tokens (attention sinks) and the last W stay in the KV cache,
    the ones between are evicted. ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, str):  # --streaming-kv's JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"streaming_kv is not valid JSON ({exc}): {value!r}") from None
    if isinstance(value, dict):
        unknown = set(value) - {"sink_tokens", "window"}
        if unknown or "window" not in value:
            raise ValueError(f"streaming_kv takes {{\"sink_tokens\": S, \"window\": W}}, got "
                             f"{value!r}")
        value = (value.get("sink_tokens", 4), value["window"])
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"streaming_kv must give integer sink_tokens and window, got {value!r}")
    sinks, window = value
    if sinks < 0 or window < 1 or sinks + window > MAX_INT32:
        raise ValueError(f"streaming_kv needs sink_tokens >= 0 and window >= 1, got "
                         f"sink_tokens={sinks}, window={window}")
    return int(sinks), int(window)


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of an n > 1 request: ``seed + index`` in 64 bits."""
    return (seed + index) % 2**64


def _checked_when_built(cls):
    """Run ``cls._normalize`` and ``cls._validate`` after the dataclass's generated
    ``__init__``: whenever Python code builds params, never when msgspec decodes them (it
    does not call ``__init__``; it would call a ``__post_init__``)."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs) -> None:
        generated(self, *args, **kwargs)
        self._normalize()
        self._validate()

    cls.__init__ = __init__
    return cls


@_checked_when_built
@dataclass
class SamplingParams:
    """What to generate and how to pick each token.

    temperature == 0 (or below SAMPLING_EPS) means greedy. ``max_tokens=None`` means "until max_model_len".
    ``logprobs=k`` returns the top-k logprobs of each sampled token (plus the sampled one);
    ``prompt_logprobs=k`` the same for every prompt token after the first.
    Logprobs are those of the model's raw distribution (before temperature and penalties).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # StreamingLLM: (sink_tokens, window) kept in the KV cache, the middle evicted (None: the
    # engine's --streaming-kv, else the whole context); see streaming_kv_spec
    streaming_kv: tuple[int, int] | None = None

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.streaming_kv = streaming_kv_spec(self.streaming_kv)

    def _validate(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value), f"{name} must be a finite number, got {value!r}")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "seed"):
            value = getattr(self, name)
            check(value is None or is_int(value), f"{name} must be an integer, got {value!r}")
        check(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.top_k <= MAX_INT32,
              f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(0.0 < self.repetition_penalty <= 2.0,
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
              f"seed must fit in 64 bits ([{MIN_SEED}, {MAX_SEED}]), got {self.seed}")
        check(self.max_tokens is None or 1 <= self.max_tokens <= MAX_INT32,
              f"max_tokens must be at least 1, got {self.max_tokens}")
        check(0 <= self.min_tokens <= MAX_INT32,
              f"min_tokens must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS,
                  f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        check(all(is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids[:8]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

