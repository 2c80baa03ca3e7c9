"""The models that draft tokens, behind one small interface ``drafter.ModelDrafter`` runs.

A draft model computes hidden states for a flat batch under the current forward context
(its own KV caches, or the target's) and turns hidden states into logits:

- ``forward(input_ids (T,), positions (T,), hidden (T, H) | None) -> (T, H)``
- ``compute_logits(hidden (N, H)) -> (N, V)``

``hidden`` is what an EAGLE head conditions on: the target's hidden state at each position
while it catches up, then its own output at the previous draft position. The drafter reads
three facts of each kind:

- ``token_offset``: the input at position p is the token at p + offset (EAGLE: 1, it
  predicts the token after next from the next token and the target's state at p);
- ``catches_up``: it needs its KV for every position the target computed (its own cache),
  or only from the new token on (a layer-skip draft shares the target's KV cache);
- ``kv_layout()``: (layers, KV heads, head dim) of its own cache, None when it shares the
  target's.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerSkipDraft:
    """The target's first ``num_layers`` layers, its final norm and LM head: a draft that
    needs no training and no cache of its own (those layers' KV for the sequence's tokens
    is exactly the target's; the KV it writes for drafted positions is overwritten when the
    target verifies them)."""

    token_offset = 0
    catches_up = False

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        total = len(target.model.layer_range)
        if not 1 <= num_layers < total:
            raise ValueError(f"layer_skip num_layers must be in [1, {total - 1}] for this "
                             f"{total}-layer model, got {num_layers}")
        self.target, self.num_layers = target, num_layers

    def kv_layout(self) -> None:
        return None

    def forward(self, input_ids, positions, hidden=None) -> torch.Tensor:
        return self.target.model(input_ids, positions, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class SeparateDraft:
    """A smaller model of the same vocabulary (and tokenizer), with its own KV cache laid
    out on the target's block tables."""

    token_offset = 0
    catches_up = True

    def __init__(self, model: nn.Module, target_vocab: int) -> None:
        if model.config.vocab_size != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is "
                             f"not the target's ({target_vocab}): it must share the tokenizer")
        self.model = model

    def kv_layout(self) -> tuple[int, int, int]:
        layers, kv_heads, head_dim = self.model.kv_cache_layout()
        return len(layers), kv_heads, head_dim

    def forward(self, input_ids, positions, hidden=None) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class EagleDraft:
    """An EAGLE head (``heron.speculative.eagle_head``) over the target's embedding and LM head:
    row p takes the token at p + 1 and the hidden state at p, and predicts token p + 2."""

    token_offset = 1
    catches_up = True

    def __init__(self, head: nn.Module, target: nn.Module) -> None:
        self.head, self.target = head, target

    def kv_layout(self) -> tuple[int, int, int]:
        layers, kv_heads, head_dim = self.head.kv_cache_layout()
        return len(layers), kv_heads, head_dim

    def forward(self, input_ids, positions, hidden=None) -> torch.Tensor:
        return self.head(input_ids, hidden, positions, self.target.model.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
