"""The frozen target for draft training: built with heron's loader, run outside the engine.

``load_target`` resolves and loads the model, frozen, with heron's inference layout on CPU
(``optimize_layout``): the trainer never differentiates through heron's layers, only through
``heron.training.lm_head_loss``, whose backward uses the LM head weight directly.
``target_hidden_states`` runs it over whole token sequences, prefilling each sequence from
position 0 under a torch-backend forward context, and returns the final normed hidden state
of every position: ``hidden[i]`` (L_i, H) for sequence ``i`` of L_i tokens, where row ``p``
has seen tokens ``0..p``.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.attention.metadata import forward_context
from heron.loader.model_source import ModelSource, resolve_model
from heron.tokenizer import load_tokenizer
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig
from heron.training.prefill_context import prefill_context


def load_target(model: str | None | ModelSource, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu"
                ) -> tuple[nn.Module, ModelArchConfig, ModelSource, object]:
    """(target model in eval mode with gradients off, its arch config, its source, its
    tokenizer or None) for ``model``: a path, None (the embedded SmolLM2-135M-Instruct) or
    an already resolved ``ModelSource``."""
    source = model if isinstance(model, ModelSource) else resolve_model(model, "auto")
    arch = ModelArchConfig.from_hf(source.hf_config)
    target = build_model(arch, dtype, torch.device(device))
    materialize_weights(target, source, "auto", dtype)
    optimize_layout(target, torch.device(device))
    target.requires_grad_(False)
    return target, arch, source, load_tokenizer(source.tokenizer_dir)


@torch.no_grad()
def target_hidden_states(target: nn.Module, sequences: list[list[int]],
                         max_batch_tokens: int = 2048, block_size: int = 16
                         ) -> list[torch.Tensor]:
    """Final normed hidden states (L_i, H) of each sequence, on the target's device and in
    its dtype. Sequences are packed into steps of at most ``max_batch_tokens`` tokens (a
    longer one runs alone); each is its own prefill, attending only to itself."""
    layers, kv_heads, head_dim = target.kv_cache_layout()
    param = next(target.parameters())
    out: list[torch.Tensor] = []
    i = 0
    while i < len(sequences):
        group = [sequences[i]]
        while i + len(group) < len(sequences) and \
                sum(map(len, group)) + len(sequences[i + len(group)]) <= max_batch_tokens:
            group.append(sequences[i + len(group)])
        lens = [len(s) for s in group]
        ctx = prefill_context(lens, len(layers), kv_heads, head_dim, param.dtype,
                              param.device, block_size)
        ids = torch.tensor([t for s in group for t in s], dtype=torch.long,
                           device=param.device)
        positions = torch.cat([torch.arange(n, device=param.device) for n in lens])
        with forward_context(ctx):
            hidden = target(ids, positions)
        out.extend(hidden.split(lens))
        i += len(group)
    return out
