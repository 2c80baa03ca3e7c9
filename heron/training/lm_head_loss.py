"""Cross-entropy through the target's frozen LM head, with a hand-written backward.

``lm_head_cross_entropy(hidden, targets, target)`` equals
``F.cross_entropy(target.compute_logits(hidden), targets)`` (mean over rows), value and
gradient with respect to ``hidden``, but:

* the logits come from ``target.compute_logits`` under ``no_grad``, so the LM head may run
  in its fastest inference form (``loader.weights.optimize_layout``'s packed CPU weight);
* the backward is the closed form ``d loss / d hidden = (softmax(logits) - onehot) @ W / N``
  with the softmax computed in place over the logits buffer: one (N, V) float32 buffer is
  kept instead of autograd's logits, log-softmax and their gradients (V = 49152 for SmolLM2).

It also returns which rows the head predicts right (top-1 == target), for the accuracy.
The LM head weight W (V, H) is frozen; single-rank only (no vocabulary sharding).
"""

from __future__ import annotations

import torch


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, compute_logits, weight):
        with torch.no_grad():
            logits = compute_logits(hidden).float()  # (N, V)
        if logits.shape[1] != weight.shape[0]:
            raise ValueError(f"logits of width {logits.shape[1]} for an LM head of "
                             f"{weight.shape[0]} rows: a vocabulary-sharded head is not "
                             f"supported")
        rows = torch.arange(logits.shape[0], device=logits.device)
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        loss = (lse - logits[rows, targets]).mean()
        correct = logits.argmax(-1) == targets
        probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
        probs[rows, targets] -= 1.0  # d(per-row loss) / d logits
        ctx.save_for_backward(probs, weight)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        probs, weight = ctx.saved_tensors
        grad = (probs @ weight.float()) * (grad_loss / probs.shape[0])  # (N, H)
        return grad.to(ctx.hidden_dtype), None, None, None


def lm_head_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, target
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, H), targets (N,) int64 -> (mean cross-entropy, scalar with grad;
    correct (N,) bool, top-1 prediction == target). ``target``: a heron causal LM (its
    ``compute_logits`` and ``lm_head.weight``, both frozen)."""
    if hidden.shape[0] == 0:
        raise ValueError("no rows to take the loss over")
    return _FrozenHeadCrossEntropy.apply(hidden, targets, target.compute_logits,
                                         target.lm_head.weight)
