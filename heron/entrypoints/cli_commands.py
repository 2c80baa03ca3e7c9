"""What `heron generate` and `heron chat` do once the engine is up: stream text to a terminal.

Text goes to stdout and nothing else does: prompts, notices and figures go to stderr (or the
log), so `heron generate ... > out.txt` and pipes get the completion alone."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass

from heron.engine.detokenizer import stream_safe_end
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Reply:
    """One streamed request: the text shown, its tokens, its time, whether it was stopped."""

    text: str
    num_tokens: int
    seconds: float
    stopped: bool = False


class StopFlag:
    """While active (a ``with`` block), Ctrl-C (SIGINT) sets ``.set`` instead of raising, so
    a reply stops between two engine steps and the engine's state stays whole."""

    def __init__(self) -> None:
        self.set = False
        self._previous = None

    def __enter__(self) -> StopFlag:
        self.set = False
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.set = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def stream(llm, prompt: str | list[int], params: SamplingParams, out=sys.stdout,
           stop: StopFlag | None = None) -> Reply:
    """Run one request, writing text as it is produced. With ``stop``, a Ctrl-C aborts the
    request after the current step: the reply then holds the text written so far."""
    engine = llm.engine
    request_id = engine.new_request_id()
    engine.add_request(request_id, prompt, params)
    max_stop_len = max((len(s) for s in params.stop), default=0)
    printed, num_tokens, started = 0, 0, time.monotonic()
    text = ""
    try:
        while engine.has_unfinished_requests():
            if stop is not None and stop.set:
                engine.abort_request(request_id)
                out.write("\n")
                return Reply(text[:printed], num_tokens, time.monotonic() - started, True)
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                num_tokens = len(output.outputs[0].token_ids)
                end = stream_safe_end(text, printed, output.finished, max_stop_len)
                out.write(text[printed:end])
                out.flush()
                printed = end
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    out.write("\n")
    return Reply(text, num_tokens, time.monotonic() - started)


def spec_decode_line(llm) -> str | None:
    """Speculative decoding's acceptance since the engine started; None when it is off or
    no draft was verified yet."""
    counts = llm.engine.stats().spec_decode
    if counts is None or not counts.num_draft_tokens:
        return None
    s = counts.summary()
    return (f"speculative decoding: acceptance rate {100 * s['acceptance_rate']:.1f}%, mean "
            f"acceptance length {s['mean_acceptance_length']:.2f} (drafts {s['num_drafts']}, "
            f"draft tokens {s['num_draft_tokens']}, accepted {s['num_accepted_tokens']}, "
            f"accepted per position {s['accepted_per_pos_rate']})")


def generate(llm, prompts: list[str], params: SamplingParams, chat: bool) -> int:
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p
              for p in prompts]
    if len(inputs) == 1:
        stream(llm, inputs[0], params)
    else:
        for i, output in enumerate(llm.generate(inputs, params)):
            print(f"--- [{i}] {prompts[i]!r}")
            print(output.outputs[0].text)
    if (line := spec_decode_line(llm)) is not None:
        logger.info("%s", line)  # stderr (the log), never stdout
    return 0
