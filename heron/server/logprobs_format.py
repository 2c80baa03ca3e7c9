"""heron's PositionLogprobs ({token_id: (logprob, rank)}) in OpenAI's two logprob shapes."""

from __future__ import annotations

from heron.outputs import PositionLogprobs
from heron.server.responses import ChatLogprobEntry, ChatTopLogprob, CompletionLogprobs


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((rank, tid, lp) for tid, (lp, rank) in position.items()))
    return [(tid, lp) for rank, tid, lp in ranked if rank <= k]


def completion_logprobs(tokenizer, token_ids: list[int],
                        positions: list[PositionLogprobs | None], k: int,
                        start_offset: int = 0) -> CompletionLogprobs:
    """Legacy completions shape; a None position (the first prompt token) has null logprobs."""
    out = CompletionLogprobs()
    offset = start_offset
    for token_id, position in zip(token_ids, positions):
        text = tokenizer.decode([token_id])
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(position[token_id][0])
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in _top(position, k)})
    return out


def chat_logprobs(tokenizer, token_ids: list[int], positions: list[PositionLogprobs],
                  k: int) -> list[ChatLogprobEntry]:
    """Chat shape: one entry per sampled token with its bytes and top-k alternatives."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        text = tokenizer.decode([token_id])
        entries.append(ChatLogprobEntry(
            token=text, logprob=position[token_id][0], bytes=list(text.encode()),
            top_logprobs=[ChatTopLogprob(token=(t := tokenizer.decode([tid])), logprob=lp,
                                         bytes=list(t.encode()))
                          for tid, lp in _top(position, k)]))
    return entries
