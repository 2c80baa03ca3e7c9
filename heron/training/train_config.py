"""The settings of ``heron.training.train_draft`` (no torch import: the CLI reads the defaults).

The loss is ``ce_weight * cross_entropy + feature_weight * smooth_l1`` (1.0 and 0.1 by
default); one step trains on ``batch_size`` windows of up to ``seq_len`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    model: str | None = None  # HF directory or .gguf; None: the embedded SmolLM2
    out: str | None = None  # checkpoint directory (None: do not save)
    data: str = "generations"  # "generations" | "shakespeare" | path to a text file
    steps: int = 200
    num_prompts: int = 64  # generations: built-in prompts
    max_tokens: int = 128  # generations: tokens generated per prompt
    temperature: float = 0.0  # generations: 0 = greedy (what greedy decoding accepts)
    max_text_tokens: int = 32768  # text sources: tokens used
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seq_len: int = 256  # rows per training window
    batch_size: int = 2  # windows per step
    ce_weight: float = 1.0
    feature_weight: float = 0.1
    held_out: float = 0.1  # fraction of the sequences kept for evaluation
    eval_every: int = 50
    init: str = "target"  # "target": eagle_head.init_from_target | "random"
    seed: int = 0
    threads: int | None = None
