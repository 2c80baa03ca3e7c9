"""Values of `heron serve` flags that take vLLM's forms and need more than an argparse type:
JSON objects and lists, load formats, ``--dtype auto``, ``--chat-template`` (a file or the
template itself)."""

from __future__ import annotations

import argparse
import codecs
import json
import logging
from pathlib import Path

logger = logging.getLogger("heron.entrypoints")

def json_object(text: str) -> dict:
    """``--override-generation-config '{"temperature": 0.5}'``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def string_list(text: str) -> list[str]:
    """vLLM's ``--allowed-origins '["https://a.example"]'`` (a JSON list); heron also takes a
    comma-separated list or one value."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list ({e})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def seconds(text: str) -> float:
    """A duration in seconds: a finite number, zero or more (``--shutdown-timeout 0`` aborts
    at once, as vLLM's default)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be zero or more seconds")
    return value


LOAD_FORMATS = {"auto": "auto", "safetensors": "auto", "gguf": "auto", "dummy": "dummy"}


def load_format(value: str) -> str:
    """vLLM's ``--load-format``: auto / safetensors / gguf read the model files, dummy makes
    random weights; the others (pt, bitsandbytes, runai_streamer, ...) are refused."""
    try:
        return LOAD_FORMATS[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: heron reads safetensors and GGUF files ('auto'), or makes random "
            f"weights ('dummy')") from None


def checkpoint_dtype(model: str | None) -> str | None:
    """The dtype a Hugging Face directory's config.json declares (None for GGUF or none)."""
    if model is None or not Path(model, "config.json").is_file():
        return None
    try:
        config = json.loads(Path(model, "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return config.get("torch_dtype") or config.get("dtype") or None


def resolve_dtype(dtype: str, model: str | None, on_cuda: bool) -> tuple[str, str | None]:
    """``--dtype auto`` as vLLM means it: on CUDA the checkpoint's bfloat16 / float16, else
    bfloat16; on CPU float32 (heron's CPU kernels are float32 first). Returns (dtype, what to
    log, or None when the dtype was given)."""
    if dtype.lower() != "auto":
        return dtype, None
    declared = checkpoint_dtype(model)
    if not on_cuda:
        return "float32", f"--dtype auto: float32 on CPU (the checkpoint declares {declared})" \
            if declared else "--dtype auto: float32 on CPU"
    if declared in ("bfloat16", "float16"):
        return declared, f"--dtype auto: {declared}, the checkpoint's"
    return "bfloat16", f"--dtype auto: bfloat16 on CUDA (the checkpoint declares {declared})"



def engine_dtype(dtype: str, model: str | None) -> str:
    """``--dtype`` for the engine, ``auto`` resolved (and the choice logged)."""
    import torch

    resolved, note = resolve_dtype(dtype, model, torch.cuda.is_available())
    if note:
        logger.info("%s", note)
    return resolved


JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule for ``--chat-template``: a file's text if ``value`` opens as a file, else
    ``value`` itself as a one-line template (backslash escapes such as ``\\n`` decoded) if it
    holds a Jinja character; a value that looks like a path but does not open is an error."""
    if value is None:
        return None
    try:
        template = Path(value).read_text()
    except OSError as e:
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(f"--chat-template {value}: looks like a file path but does not "
                             f"open ({e.strerror})") from None
        template = codecs.decode(value, "unicode_escape")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template ({e.message}, "
                         f"line {e.lineno})") from None
    return template
