"""StreamingLLM as the paper's code runs it, on an HF Llama: tokens fed one at a time, each
layer's cache holding raw (pre-rotary) keys of the first ``sinks`` tokens and the last
``window`` ones (the current token included), rotated at their positions *in the cache* for
every query. The oracle for heron's StreamingLLM requests."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@torch.no_grad()
def streaming_greedy(hf, prompt: list[int], max_new_tokens: int, sinks: int, window: int,
                     top_n: int = 5):
    """Greedy continuation and per-step top-n logprobs under a StreamingLLM cache."""
    model, cfg = hf.model, hf.config
    caches = [([], []) for _ in model.layers]  # per layer: raw keys, values (KVH, D) each
    tokens, logprobs = list(prompt), []
    for step in range(len(prompt) + max_new_tokens - 1):
        hidden = _token_forward(model, cfg, tokens[step], caches, sinks, window)
        if step >= len(prompt) - 1:
            lp = hf.lm_head(model.norm(hidden)).float().log_softmax(-1)[0]
            values, ids = lp.topk(top_n)
            logprobs.append(dict(zip(ids.tolist(), values.tolist())))
            tokens.append(int(lp.argmax()))
    return tokens[len(prompt):], logprobs


def _token_forward(model, cfg, token: int, caches, sinks: int, window: int) -> torch.Tensor:
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    hidden = model.embed_tokens(torch.tensor([token]))  # (1, hidden)
    for layer, (keys, values) in zip(model.layers, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, heads, 1, head_dim)
        keys.append(attn.k_proj(x).view(kv_heads, head_dim))
        values.append(attn.v_proj(x).view(kv_heads, head_dim))
        if len(keys) > sinks + window:  # evict the oldest token after the sinks
            del keys[sinks], values[sinks]
        n = len(keys)
        k = torch.stack(keys, 1).unsqueeze(0)  # (1, KVH, n, D)
        v = torch.stack(values, 1).unsqueeze(0)
        cos, sin = model.rotary_emb(k, torch.arange(n).unsqueeze(0))  # in-cache positions
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling  # (1, H, 1, n)
        out = (scores.softmax(-1) @ v).reshape(1, heads * head_dim)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden
