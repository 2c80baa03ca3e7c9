"""heron's PositionLogprobs ({token_id: (logprob, rank)}) in OpenAI's two logprob shapes.

With ``as_token_ids`` (``--return-tokens-as-token-ids``, as vLLM) every token is written
``token_id:N`` instead of its text, so that tokens which are not valid UTF-8 on their own
stay identifiable."""

from __future__ import annotations

from heron.outputs import PositionLogprobs
from heron.server.responses import ChatLogprobEntry, ChatTopLogprob, CompletionLogprobs


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((rank, tid, lp) for tid, (lp, rank) in position.items()))
    return [(tid, lp) for rank, tid, lp in ranked if rank <= k]


def token_text(tokenizer, token_id: int, as_token_ids: bool = False) -> str:
    """How a logprob entry names a token: its text, or ``token_id:N``."""
    return f"token_id:{token_id}" if as_token_ids else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int],
                        positions: list[PositionLogprobs | None], k: int,
                        start_offset: int = 0, as_token_ids: bool = False) -> CompletionLogprobs:
    """Legacy completions shape; a None position (the first prompt token) has null logprobs.
    ``text_offset`` counts characters of the decoded text in either naming."""
    out = CompletionLogprobs()
    offset = start_offset
    for token_id, position in zip(token_ids, positions):
        text = token_text(tokenizer, token_id, as_token_ids)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(tokenizer.decode([token_id]) if as_token_ids else text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(position[token_id][0])
        out.top_logprobs.append({token_text(tokenizer, t, as_token_ids): lp
                                 for t, lp in _top(position, k)})
    return out


def chat_logprobs(tokenizer, token_ids: list[int], positions: list[PositionLogprobs],
                  k: int, as_token_ids: bool = False) -> list[ChatLogprobEntry]:
    """Chat shape: one entry per sampled token with its bytes and top-k alternatives."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        text = token_text(tokenizer, token_id, as_token_ids)
        entries.append(ChatLogprobEntry(
            token=text, logprob=position[token_id][0], bytes=list(text.encode()),
            top_logprobs=[ChatTopLogprob(token=(t := token_text(tokenizer, tid, as_token_ids)),
                                         logprob=lp,
                                         bytes=list(t.encode()))
                          for tid, lp in _top(position, k)]))
    return entries
