"""Train an EAGLE head (``heron.speculative.eagle_head``) for a heron target, on this machine.

Pipeline (``train_draft(TrainConfig(...))``, or ``heron train-draft``):

1. token sequences from ``heron.training.draft_data`` (default ``generations``: the target's own
   continuations of built-in chat prompts; or ``shakespeare``, or a text file);
2. the target's final normed hidden states ``h`` over each whole sequence
   (``heron.training.target_features``, one prefill per sequence);
3. training from ``eagle_head.init_from_target`` (the head starts out copying the target's
   feature at p as its guess for p + 1; ``init="random"``: plain N(0, 0.02)), float32,
   AdamW (warm-up then cosine decay, gradient clipping at 1.0). For a
   sequence ``x_0..x_{L-1}`` row ``p`` (``0 <= p <= L - 3``) feeds the head token
   ``x_{p+1}`` and hidden state ``h_p`` at position ``p``; its output ``f_p`` is trained with

       loss = 1.0 * cross_entropy(target.compute_logits(f_p), x_{p+2})      # ce_weight
            + 0.1 * smooth_l1(f_p, h_{p+1})                                 # feature_weight

   (EAGLE's token and feature losses; the target, its embedding and LM head stay frozen),
   over rows whose target token ``x_{p+2}`` is in the loss span (the generated tokens for
   ``generations``, everything for text). Sequences longer than ``seq_len + 2`` are cut into
   windows of ``seq_len`` rows; a step takes ``batch_size`` windows (padded at the end).
4. every ``eval_every`` steps, the loss and the top-1 accuracy of the head's next-token
   prediction (argmax of its logits == ``x_{p+2}``) on held-out sequences; for greedy
   ``generations`` data that is the head's expected acceptance rate at the first draft
   position under greedy speculative decoding.
5. the head saved with ``heron.speculative.eagle_checkpoint.save_eagle_head`` (config.json +
   model.safetensors; format in that module's docstring and docs/eagle_head.md).

SmolLM2-135M on 2 CPU cores: a step's cost is dominated by the frozen 49152 x 576 LM head
(its forward and the backward to the head's output; see ``heron.training.lm_head_loss``), about
1-2 s per step of ~220 rows. Generating the data and the target's hidden states cost about
as much again: ``--num-prompts 64 --max-tokens 128 --steps 100`` takes ~10 minutes.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from heron.loader.model_source import resolve_model
from heron.tokenizer import load_tokenizer
from heron.training.draft_data import DraftSequence, load_sequences
from heron.speculative.eagle_head import EagleHead, build_eagle_head, init_from_target
from heron.speculative.eagle_checkpoint import save_eagle_head
from heron.training.lm_head_loss import lm_head_cross_entropy
from heron.training.target_features import load_target, target_hidden_states
from heron.training.train_config import TrainConfig


@dataclass
class Batch:
    """``B`` windows of ``S`` rows, padded at the end (``mask`` False on padding and on rows
    whose target token is outside the loss span)."""

    input_ids: torch.Tensor  # (B, S) token x_{p+1}
    hidden: torch.Tensor  # (B, S, H) target hidden h_p
    targets: torch.Tensor  # (B, S) token x_{p+2}
    features: torch.Tensor  # (B, S, H) target hidden h_{p+1}
    positions: torch.Tensor  # (B, S) p
    mask: torch.Tensor  # (B, S) bool


@dataclass
class Example:
    tokens: torch.Tensor  # (L,) int64
    hidden: torch.Tensor  # (L, H)
    loss_start: int


def windows(examples: list[Example], seq_len: int) -> list[tuple[int, int, int]]:
    """(example index, first row, rows) of every training window: rows ``p`` in
    ``[first, first + rows)``, ``rows <= seq_len``, covering rows ``0..L-3`` of each example
    that has a row in its loss span."""
    out = []
    for i, ex in enumerate(examples):
        num_rows = len(ex.tokens) - 2
        for first in range(0, max(num_rows, 0), seq_len):
            rows = min(seq_len, num_rows - first)
            if first + rows + 1 >= ex.loss_start:  # some target x_{p+2} in the loss span
                out.append((i, first, rows))
    return out


def make_batch(examples: list[Example], picked: list[tuple[int, int, int]]) -> Batch:
    s = max(rows for _, _, rows in picked)
    b, h = len(picked), examples[0].hidden.shape[1]
    ids = torch.zeros(b, s, dtype=torch.long)
    targets = torch.zeros(b, s, dtype=torch.long)
    hidden, features = torch.zeros(b, s, h), torch.zeros(b, s, h)
    positions = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for j, (i, first, rows) in enumerate(picked):
        ex, p = examples[i], torch.arange(first, first + rows)
        ids[j, :rows], targets[j, :rows] = ex.tokens[p + 1], ex.tokens[p + 2]
        hidden[j, :rows], features[j, :rows] = ex.hidden[p], ex.hidden[p + 1]
        positions[j, :rows] = p
        mask[j, :rows] = p + 2 >= ex.loss_start
    return Batch(ids, hidden, targets, features, positions, mask)


def batch_loss(head: EagleHead, target, batch: Batch, ce_weight: float,
               feature_weight: float) -> tuple[torch.Tensor, dict]:
    """(weighted loss, {"loss", "ce", "feature", "acc", "rows"}) of one batch. Logits are
    computed only for the masked-in rows (the LM head dominates the cost), by
    ``target.compute_logits`` inside ``lm_head_cross_entropy``."""
    out = head.forward_train(batch.input_ids, batch.hidden, target.model.embed_tokens,
                             batch.positions)  # (B, S, H)
    rows = out[batch.mask]  # (N, H)
    ce, correct = lm_head_cross_entropy(rows, batch.targets[batch.mask], target)
    feature = F.smooth_l1_loss(rows.float(), batch.features[batch.mask].float())
    loss = ce_weight * ce + feature_weight * feature
    return loss, {"loss": loss.item(), "ce": ce.item(), "feature": feature.item(),
                  "acc": correct.float().mean().item(), "rows": int(rows.shape[0])}


@torch.no_grad()
def evaluate(head: EagleHead, target, examples: list[Example], seq_len: int,
             batch_size: int, cfg: TrainConfig) -> dict:
    """Row-weighted loss, ce, feature loss and top-1 accuracy over every held-out window."""
    head.eval()
    wins = windows(examples, seq_len)
    totals = {"loss": 0.0, "ce": 0.0, "feature": 0.0, "acc": 0.0}
    n = 0
    for k in range(0, len(wins), batch_size):
        _, stats = batch_loss(head, target, make_batch(examples, wins[k:k + batch_size]),
                              cfg.ce_weight, cfg.feature_weight)
        for key in totals:
            totals[key] += stats[key] * stats["rows"]
        n += stats["rows"]
    head.train()
    return {key: value / max(n, 1) for key, value in totals.items()} | {"rows": n}


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up (at most a fifth of the run), then cosine decay to a tenth of lr."""
    warmup = max(1, min(cfg.warmup_steps, cfg.steps // 5))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def split_examples(examples: list[Example], held_out: float, seed: int
                   ) -> tuple[list[Example], list[Example]]:
    """(train, held-out) by whole sequence, at least one of each when there are two."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(held_out * len(examples))), len(examples) - 1)
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


def train_head(head: EagleHead, target, train: list[Example], held: list[Example],
               cfg: TrainConfig, log=print) -> dict:
    """Train ``head`` in place; returns the final held-out evaluation and training stats."""
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    wins = windows(train, cfg.seq_len)
    if not wins:
        raise ValueError("no training rows: the sequences are too short")
    rng = random.Random(cfg.seed)
    started, recent = time.perf_counter(), []
    train_loss = train_acc = float("nan")
    first_eval = evaluate(head, target, held, cfg.seq_len, cfg.batch_size, cfg)
    ev = first_eval
    log(f"step 0: held-out loss {first_eval['loss']:.3f} acc {first_eval['acc']:.3f}")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss, stats = batch_loss(head, target, make_batch(train, rng.sample(
            wins, min(cfg.batch_size, len(wins)))), cfg.ce_weight, cfg.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        recent.append(stats)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            ev = evaluate(head, target, held, cfg.seq_len, cfg.batch_size, cfg)
            train_loss = sum(r["loss"] for r in recent) / len(recent)
            train_acc = sum(r["acc"] for r in recent) / len(recent)
            log(f"step {step + 1}: train loss {train_loss:.3f} acc {train_acc:.3f} | "
                f"held-out loss {ev['loss']:.3f} (ce {ev['ce']:.3f}, feature "
                f"{ev['feature']:.4f}) acc {ev['acc']:.3f} | "
                f"{time.perf_counter() - started:.0f}s")
            recent = []
    head.eval().requires_grad_(False)
    return {"initial_held_out": first_eval, "held_out": ev, "final_train_loss": train_loss,
            "final_train_acc": train_acc, "train_s": time.perf_counter() - started}


def train_draft(cfg: TrainConfig, log=print) -> tuple[EagleHead, dict]:
    """The whole pipeline; saves to ``cfg.out`` when set. Returns (head, summary)."""
    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    source = resolve_model(cfg.model, "auto")
    tokenizer = None if cfg.data == "generations" else load_tokenizer(source.tokenizer_dir)
    # generations first: the engine is shut down before the training copy of the target loads
    sequences: list[DraftSequence] = load_sequences(
        cfg.data, cfg.model, tokenizer, num_prompts=cfg.num_prompts, max_tokens=cfg.max_tokens,
        temperature=cfg.temperature, max_text_tokens=cfg.max_text_tokens,
        chunk_len=cfg.seq_len + 2, seed=cfg.seed, threads=cfg.threads, log=log)
    sequences = [s for s in sequences if len(s.token_ids) >= 3]
    if len(sequences) < 2:
        raise ValueError(f"need at least 2 sequences of 3+ tokens, got {len(sequences)}")
    data_s = time.perf_counter() - started
    target, arch, source, _ = load_target(source)
    hidden = target_hidden_states(target, [s.token_ids for s in sequences])
    examples = [Example(torch.tensor(s.token_ids), h, s.loss_start)
                for s, h in zip(sequences, hidden)]
    train, held = split_examples(examples, cfg.held_out, cfg.seed)
    log(f"{len(sequences)} sequences, {sum(len(s.token_ids) for s in sequences)} tokens "
        f"({len(train)} train / {len(held)} held out); data {data_s:.0f}s, target hidden "
        f"states {time.perf_counter() - started - data_s:.0f}s")
    head = build_eagle_head(arch, torch.float32, "cpu", seed=cfg.seed)
    if cfg.init == "target":
        init_from_target(head, target.model.norm.weight)
    result = train_head(head, target, train, held, cfg, log)
    summary = {
        "data": cfg.data, "model": source.name, "sequences": len(sequences),
        "tokens": sum(len(s.token_ids) for s in sequences), "steps": cfg.steps,
        "final_loss": result["held_out"]["loss"], "held_out_acc": result["held_out"]["acc"],
        "held_out_ce": result["held_out"]["ce"], "held_out_rows": result["held_out"]["rows"],
        "initial_loss": result["initial_held_out"]["loss"],
        "initial_held_out_acc": result["initial_held_out"]["acc"],
        "final_train_loss": result["final_train_loss"], "wall_s": time.perf_counter() - started,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("out", "model")},
    }
    if cfg.out:
        save_eagle_head(head, cfg.out, summary)
        log(f"saved the head to {cfg.out}")
    return head, summary
