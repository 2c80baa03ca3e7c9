"""Build what ``--speculative-config`` asks for: the draft model, then the proposer.

The worker loads the draft (``load_draft``) before it sizes the KV pool, since a draft's
own cache shares the pool's blocks (``draft.kv_layout()``); the runner then asks for its
proposer once (``make_proposer``), lending it a ``DraftContext``.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.config import SpeculativeConfig
from heron.layers.rotary import RotaryEmbedding
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig
from heron.speculative.draft_models import EagleDraft, LayerSkipDraft, SeparateDraft
from heron.speculative.drafter import ModelDrafter
from heron.speculative.eagle_checkpoint import load_eagle_head
from heron.speculative.interface import DraftContext, Proposer
from heron.speculative.ngram import NgramProposer
from heron.speculative.tree import DraftTree


def load_draft(spec: SpeculativeConfig, target: nn.Module, arch: ModelArchConfig,
               dtype: torch.dtype, device: torch.device):
    """The draft model of ``spec`` (None for n-gram lookup), loaded on ``device``."""
    if spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return LayerSkipDraft(target, spec.num_layers or max(1, arch.num_layers // 4))
    if spec.method == "eagle":
        head = load_eagle_head(spec.model, arch, dtype, device)
        optimize_layout(head, device)
        return EagleDraft(head, target)
    source = resolve_model(spec.model, "auto")
    model = build_model(ModelArchConfig.from_hf(source.hf_config), dtype, device)
    materialize_weights(model, source, "auto", dtype)
    optimize_layout(model, device)
    return SeparateDraft(model, arch.vocab_size)


def make_proposer(spec: SpeculativeConfig, draft, ctx: DraftContext) -> Proposer:
    """The proposer the runner calls after each step: prompt lookup without a ``draft``,
    else the draft decoding on the runner's block tables (a tree's nodes when ``spec``
    names a token tree)."""
    if draft is None:
        return NgramProposer(ctx.batch, spec.prompt_lookup_min, spec.prompt_lookup_max,
                             ctx.max_model_len)
    for module in _modules(draft):
        if isinstance(module, RotaryEmbedding):
            module.reserve(ctx.max_model_len, ctx.device)
    paths = spec.tree_paths
    return ModelDrafter(draft, ctx, DraftTree(paths) if paths else None)


def _modules(draft):
    own = getattr(draft, "model", None) or getattr(draft, "head", None)
    return own.modules() if own is not None else ()
