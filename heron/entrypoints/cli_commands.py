"""What `heron generate` and `heron chat` do once the engine is up: stream text to a terminal."""

from __future__ import annotations

import sys

from heron.engine.detokenizer import stream_safe_end
from heron.sampling_params import SamplingParams


def _stream(llm, prompt: str | list[int], params: SamplingParams, out=sys.stdout) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    engine = llm.engine
    request_id = engine.new_request_id()
    engine.add_request(request_id, prompt, params)
    max_stop_len = max((len(s) for s in params.stop), default=0)
    printed, text = 0, ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                end = stream_safe_end(text, printed, output.finished, max_stop_len)
                out.write(text[printed:end])
                out.flush()
                printed = end
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    out.write("\n")
    return text


def generate(llm, prompts: list[str], params: SamplingParams, chat: bool) -> int:
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p
              for p in prompts]
    if len(inputs) == 1:
        _stream(llm, inputs[0], params)
        return 0
    for i, output in enumerate(llm.generate(inputs, params)):
        print(f"--- [{i}] {prompts[i]!r}")
        print(output.outputs[0].text)
    return 0


def chat(llm, params: SamplingParams, system: str | None) -> int:
    """A read-eval loop keeping the conversation; /reset clears it, /exit (or EOF) quits."""
    history = [{"role": "system", "content": system}] if system else []
    print("heron chat: type a message; /reset clears history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        reply = _stream(llm, llm.apply_chat_template(history), params)
        history.append({"role": "assistant", "content": reply})
