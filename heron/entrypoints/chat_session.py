"""`heron chat`: a read-eval loop over one conversation, with line editing (readline).

Keys: Ctrl-C while a reply is written stops it (the request is aborted; the conversation
keeps the part that was shown, so the model later sees what the user saw); Ctrl-C at the
prompt clears the line; Ctrl-D at the prompt quits. Commands start with "/" (``/help``).
Replies go to stdout; the prompt, notices and figures to stderr.
"""

from __future__ import annotations

import sys

from heron.entrypoints.cli_commands import Reply, StopFlag, spec_decode_line, stream
from heron.sampling_params import SamplingParams

COMMANDS = {
    "/help": "list the commands and keys",
    "/reset": "forget the conversation (the system message stays)",
    "/stats": "the last reply's speed; speculative decoding's acceptance",
    "/exit": "quit (also /quit, or Ctrl-D)",
}
KEYS = ("Ctrl-C stops a reply being written (the shown part is kept), or clears the line; "
        "Ctrl-D quits; arrow keys edit the line and recall earlier ones.")


def _enable_line_editing() -> bool:
    """Importing readline gives ``input()`` line editing and in-memory history."""
    try:
        import readline  # noqa: F401
    except ImportError:  # a Python built without it: plain input() still works
        return False
    return True


class ChatSession:
    """One conversation: ``run()`` reads lines until Ctrl-D or /exit and returns the exit
    status (0). The history holds every user message and every reply as it was shown."""

    def __init__(self, llm, params: SamplingParams, system: str | None,
                 out=sys.stdout, err=sys.stderr) -> None:
        self.llm, self.params, self.system = llm, params, system
        self.out, self.err = out, err
        self.history: list[dict] = []
        self.last: Reply | None = None
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def run(self) -> int:
        _enable_line_editing()
        self.say("heron chat: type a message; /help lists the commands, Ctrl-D quits.")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:  # Ctrl-D
                self.say("")
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
                self.say("")
                continue
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line):
                    return 0
                continue
            self.ask(line)

    def command(self, line: str) -> bool:
        """Run a /command; True when the chat should end."""
        name = line.split()[0].lower()
        if name in ("/exit", "/quit"):
            return True
        if name == "/help":
            self.say("\n".join(f"  {cmd:<8} {what}" for cmd, what in COMMANDS.items()))
            self.say("  " + KEYS)
        elif name == "/reset":
            turns = sum(1 for m in self.history if m["role"] == "user")
            self.reset()
            self.say(f"conversation reset ({turns} exchange{'s' if turns != 1 else ''} "
                     f"forgotten).")
        elif name == "/stats":
            self.say(self.stats())
        else:
            self.say(f"unknown command {name}; /help lists the commands.")
        return False

    def stats(self) -> str:
        lines = []
        if self.last is None:
            lines.append("no reply yet.")
        else:
            rate = self.last.num_tokens / self.last.seconds if self.last.seconds else 0.0
            lines.append(f"last reply: {self.last.num_tokens} tokens in {self.last.seconds:.2f} s"
                         f" ({rate:.1f} tokens/s){', stopped' if self.last.stopped else ''}")
        spec = spec_decode_line(self.llm)
        on = self.llm.engine.config.speculative is not None
        lines.append(spec if spec else "speculative decoding: " + (
            "no drafts verified yet" if on else "off (--speculative-config turns it on)"))
        return "\n".join(lines)

    def ask(self, line: str) -> None:
        self.history.append({"role": "user", "content": line})
        self.out.write("assistant> ")
        self.out.flush()
        try:
            with StopFlag() as stop:
                self.last = stream(self.llm, self.llm.apply_chat_template(self.history),
                                   self.params, self.out, stop)
        except ValueError as exc:  # refused (too long for the context...): the chat goes on
            self.history.pop()
            self.out.write("\n")
            self.say(f"error: {exc} (the message was not added to the conversation)")
            return
        if self.last.stopped:
            self.say("[reply stopped; the part shown stays in the conversation]")
        self.history.append({"role": "assistant", "content": self.last.text})
