"""Benchmark workloads: what to send (prompts) and how many tokens to ask back.

* ``random``: prompts of random token ids (offline) or random common words (HTTP; about one
  token per word for BPE vocabularies; servers report the exact count), lengths fixed (``128``)
  or uniform in a closed range (``100:1024``).
* ``shared-prefix``: ``num_prefixes`` random prefixes of ``prefix_len`` shared round-robin by
  the prompts, each followed by its own random suffix of ``input_len``.
* ``sharegpt``: the first human turn of ShareGPT-format conversations (a JSON list of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``, or
  ``{"messages": [{"role": "user", "content": ...}, ...]}``); the output length is the first
  reply's token count unless fixed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

WORKLOADS = ("random", "shared-prefix", "sharegpt")

# Common English words; each is a single token (with its leading space) for GPT-2-style BPE
# vocabularies such as SmolLM2's, so a prompt of n words is about n tokens.
WORDS = tuple("""time year people way day man thing woman life child world school state family
group country problem hand part place case week company system program question work number
night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member
law car city community name president team minute idea body information back parent face
others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education""".split())

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class Sample:
    """One request: a prompt (text or token ids) and the number of tokens to generate."""

    prompt: str | list[int]
    output_len: int


def parse_len(text: str | int) -> tuple[int, int]:
    """'128' -> (128, 128); '100:1024' -> (100, 1024) (uniform, inclusive); lengths >= 1."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise ValueError(f"bad length {text!r}: use N or MIN:MAX") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ValueError(f"bad length {text!r}: use N or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def _random_prompt(rng: random.Random, n: int, vocab_size: int | None) -> str | list[int]:
    """Token ids in [low, vocab) when ``vocab_size`` is given (low skips special tokens of
    typical vocabularies), otherwise ``n`` random words."""
    if vocab_size is not None:
        low = min(100, vocab_size // 4)
        return [rng.randrange(low, vocab_size) for _ in range(n)]
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _join(prefix: str | list[int], suffix: str | list[int]) -> str | list[int]:
    return prefix + suffix if isinstance(prefix, list) else f"{prefix} {suffix}"


def random_workload(num: int, input_len: str, output_len: str, seed: int = 0,
                    vocab_size: int | None = None) -> list[Sample]:
    """``num`` random prompts; token ids if ``vocab_size`` is given, else words."""
    rng, ins, outs = random.Random(seed), parse_len(input_len), parse_len(output_len)
    return [Sample(_random_prompt(rng, _draw(rng, ins), vocab_size), _draw(rng, outs))
            for _ in range(num)]


def shared_prefix_workload(num: int, prefix_len: int, num_prefixes: int, input_len: str,
                           output_len: str, seed: int = 0, vocab_size: int | None = None
                           ) -> list[Sample]:
    """Prompt i = prefix[i % num_prefixes] + its own random suffix of ``input_len``."""
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError("shared-prefix needs --prefix-len >= 1 and --num-prefixes >= 1")
    rng, ins, outs = random.Random(seed), parse_len(input_len), parse_len(output_len)
    prefixes = [_random_prompt(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    return [Sample(_join(prefixes[i % num_prefixes], _random_prompt(rng, _draw(rng, ins),
                                                                     vocab_size)),
                   _draw(rng, outs)) for i in range(num)]


def estimate_tokens(text: str) -> int:
    """Without a tokenizer: about 4 tokens per 3 words of English."""
    return max(1, -(-len(text.split()) * 4 // 3))


def _first_exchange(entry: dict) -> tuple[str, str] | None:
    """(first user turn, the reply after it) of one conversation, or None."""
    turns = entry.get("conversations") or entry.get("messages") or []
    texts = [(t.get("from") or t.get("role"), t.get("value") or t.get("content") or "")
             for t in turns if isinstance(t, dict)]
    for (role, text), (_, reply) in zip(texts, texts[1:]):
        if role in ("human", "user") and text.strip() and reply.strip():
            return text, reply
    return None


def sharegpt_workload(path: str | Path, num: int, output_len: str | None = None, seed: int = 0,
                      count_tokens: TokenCounter | None = None, max_len: int | None = None
                      ) -> list[Sample]:
    """``num`` conversations drawn (seeded shuffle) from a ShareGPT JSON file. Exchanges with
    fewer than 4 prompt or reply tokens, or longer than ``max_len`` in all, are skipped; a
    file with too few usable ones is a ValueError."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"ShareGPT file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ShareGPT file {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT file {path} must hold a JSON list of conversations")
    count = count_tokens or estimate_tokens
    rng, fixed = random.Random(seed), parse_len(output_len) if output_len else None
    order = list(range(len(data)))
    rng.shuffle(order)
    samples = []
    for i in order:
        pair = _first_exchange(data[i]) if isinstance(data[i], dict) else None
        if pair is None:
            continue
        n_in = count(pair[0])
        n_out = _draw(rng, fixed) if fixed else count(pair[1])
        if n_in < 4 or n_out < 4 or (max_len is not None and n_in + n_out > max_len):
            continue
        samples.append(Sample(pair[0], n_out))
        if len(samples) == num:
            return samples
    raise ValueError(f"{path}: only {len(samples)} usable conversations, {num} requested")


def add_workload_args(p, default_input: str = "128", default_output: str = "128") -> None:
    """The workload flags shared by `bench throughput` and `bench serve`."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--num-prompts", type=int, default=None, help="requests (per rate for serve)")
    g.add_argument("--input-len", default=default_input,
                   help="prompt tokens: N or MIN:MAX (uniform); suffix length for shared-prefix")
    g.add_argument("--output-len", default=None,
                   help=f"tokens to generate: N or MIN:MAX (default {default_output}; "
                        f"sharegpt: the reply's length)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--dataset", default=None, help="sharegpt: path of the JSON file")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    p.set_defaults(_default_output=default_output)


def build_workload(args, num: int, vocab_size: int | None = None,
                   count_tokens: TokenCounter | None = None, max_len: int | None = None,
                   seed_offset: int = 0) -> list[Sample]:
    """The samples the parsed workload flags describe (token-id prompts if ``vocab_size``)."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    seed = args.seed + seed_offset
    output_len = args.output_len or args._default_output
    if args.workload == "random":
        return random_workload(num, args.input_len, output_len, seed, vocab_size)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(num, args.prefix_len, args.num_prefixes, args.input_len,
                                      output_len, seed, vocab_size)
    if not args.dataset:
        raise ValueError("--workload sharegpt needs --dataset PATH")
    return sharegpt_workload(args.dataset, num, args.output_len, seed, count_tokens, max_len)
