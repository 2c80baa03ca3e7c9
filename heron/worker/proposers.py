"""Build the proposer ``--speculative-config`` asks for, on a loaded worker.

The draft model (if any) is loaded before the KV pool is sized, since its own cache shares
the pool's blocks (``draft_kv_layout``); the proposer is attached once the runner exists.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.config import SpeculativeConfig
from heron.layers.rotary import RotaryEmbedding
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig
from heron.spec.draft_models import EagleDraft, LayerSkipDraft, SeparateDraft
from heron.worker.drafter import ModelDrafter, NgramProposer
from heron.worker.memory import KVLayout


def load_draft(spec: SpeculativeConfig, target: nn.Module, arch: ModelArchConfig,
               dtype: torch.dtype, device: torch.device):
    """The draft model of ``spec`` (None for n-gram lookup), loaded on ``device``."""
    if spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return LayerSkipDraft(target, spec.num_layers or max(1, arch.num_layers // 4))
    if spec.method == "eagle":
        from heron.spec.eagle_checkpoint import load_eagle_head

        head = load_eagle_head(spec.model, arch, dtype, device)
        optimize_layout(head, device)
        return EagleDraft(head, target)
    source = resolve_model(spec.model, "auto")
    model = build_model(ModelArchConfig.from_hf(source.hf_config), dtype, device)
    materialize_weights(model, source, "auto", dtype)
    optimize_layout(model, device)
    return SeparateDraft(model, arch.vocab_size)


def draft_kv_layout(draft) -> KVLayout | None:
    """What the draft's own cache holds per token (None: none, or it shares the target's)."""
    layout = draft.kv_layout() if draft is not None else None
    return KVLayout(*layout) if layout is not None else None


def make_proposer(spec: SpeculativeConfig, draft, runner):
    """The proposer the runner calls after each step."""
    if draft is None:
        return NgramProposer(runner.input_batch, spec.prompt_lookup_min,
                             spec.prompt_lookup_max, runner.max_context)
    for module in _modules(draft):
        if isinstance(module, RotaryEmbedding):
            module.reserve(runner.max_context, runner.device)
    runner.tree = spec.tree
    return ModelDrafter(draft, runner.input_batch, runner.kv_caches, runner.make_cache,
                        runner.backend, runner.use_triton_ops, runner.device,
                        runner.max_context, runner.tree)


def _modules(draft):
    own = getattr(draft, "model", None) or getattr(draft, "head", None)
    return own.modules() if own is not None else ()
