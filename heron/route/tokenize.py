"""Torch-free tokenization for the router: the token ids ``heron serve`` would compute.

The router needs a prompt's token ids to hash its blocks the way the workers' prefix caches do
(``heron.engine.prefix_cache.block_hashes``). ``heron serve`` tokenizes with transformers'
``AutoTokenizer``, which imports torch; this module reproduces it from the same tokenizer
directory with the ``tokenizers`` library (Rust) and ``jinja2``:

- completions: ``tokenizer.json`` encoded *with* special tokens (its post-processor: a BOS
  for Gemma, nothing for SmolLM2), as ``tokenizer(prompt).input_ids``;
- chat: the chat template rendered as transformers renders it (sandboxed, ``trim_blocks`` /
  ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson`` without HTML escaping,
  the named special tokens as variables), then encoded *without* special tokens, as
  ``apply_chat_template`` does.

Nothing here imports torch or transformers (a test checks the router's imports).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a chat template sees as variables
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: no HTML escaping (jinja's own filter escapes <, >, &)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _generation_extension():
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): here it
    renders its body unchanged, which is all tokenization needs."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def compile_template(source: str):
    """A jinja2 template compiled in the environment transformers uses for chat templates."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(),
                                                    jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _pick_template(value) -> str | None:
    """tokenizer_config's ``chat_template``: a string, or a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def read_chat_template(tokenizer_dir: Path) -> str | None:
    """The directory's chat template: ``chat_template.jinja`` (transformers 5 saves it there),
    else tokenizer_config.json's ``chat_template``."""
    path = tokenizer_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    config = tokenizer_dir / "tokenizer_config.json"
    if config.is_file():
        return _pick_template(json.loads(config.read_text()).get("chat_template"))
    return None


class RouteTokenizer:
    """A worker's tokenizer and chat template, loaded without torch.

    Contract: ``encode_prompt`` and ``encode_chat`` return exactly the ids ``heron serve``
    computes for the same completions prompt / chat messages from the same tokenizer
    directory (and ``--chat-template``, passed as ``chat_template``). Used from one thread
    (the router's event loop): the chat path keeps an LRU of encoded pieces.
    """

    def __init__(self, tokenizer, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        from heron.route.segment_encoder import segment_encoder

        self._tokenizer = tokenizer  # tokenizers.Tokenizer
        # chat texts encode piece by piece, a tenant's system prompt once (None: whole texts)
        self._pieces = segment_encoder(tokenizer)
        self.chat_template = chat_template
        self._template = compile_template(chat_template) if chat_template else None
        self.special_tokens = special_tokens

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path,
                 chat_template: str | None = None) -> RouteTokenizer:
        """Load ``tokenizer.json`` (+ tokenizer_config.json) from ``tokenizer_dir``;
        ``chat_template`` overrides the directory's (the worker's ``--chat-template``)."""
        from tokenizers import Tokenizer

        tokenizer_dir = Path(tokenizer_dir)
        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        config_path = tokenizer_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: text for name in SPECIAL_TOKEN_NAMES
                   if (text := _token_text(config.get(name))) is not None}
        return cls(tokenizer, chat_template or read_chat_template(tokenizer_dir), special)

    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt: encoded with special tokens (the post-processor's)."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs) -> str:
        """The chat template's text for ``messages`` ([{"role", "content"}])."""
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        import jinja2

        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages through the template, encoded without special tokens."""
        text = self.render_chat(messages, add_generation_prompt)
        if self._pieces is not None:
            return self._pieces.encode(text)
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def message_text(content) -> str:
    """A message's content as ``heron serve`` gives it to the template: a string, or the text
    parts of a list joined by newlines (``protocol.ChatMessage.text``)."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def conversation(messages: list[dict]) -> list[dict]:
    """Request messages as the worker's template sees them: role and text content only."""
    return [{"role": m.get("role"), "content": message_text(m.get("content"))}
            for m in messages if isinstance(m, dict)]


def request_token_ids(tokenizer: RouteTokenizer, endpoint: str, body: dict) -> list[int] | None:
    """The prompt token ids of an OpenAI request body as the worker will compute them; None
    when they cannot be known (no prompt, a template failure: the worker will answer 400).
    A completions batch is routed by its first prompt."""
    try:
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            return tokenizer.encode_chat(conversation(messages),
                                         bool(body.get("add_generation_prompt", True)))
        return _completion_ids(tokenizer, body.get("prompt"))
    except (ChatTemplateError, TypeError, ValueError):
        return None


def _completion_ids(tokenizer: RouteTokenizer, prompt) -> list[int] | None:
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # one prompt of token ids
            return list(prompt)
        if isinstance(first, str):
            return tokenizer.encode_prompt(first)
        if isinstance(first, list):
            return list(first)
    return None
