"""Running an HF decoder one layer at a time over calibration samples (the sequential scheme
of GPTQ and llm-compressor): capture what layer 0 receives, then per layer collect the
inputs of chosen linears through forward pre-hooks (stopping the layer early once the last
one needed has been seen), and recompute the layer's outputs, with its quantized weights,
as the next layer's inputs. Only one layer's activations for all samples are held.

``LINEAR_GROUPS``: the Llama-family layer's linears by shared input, with the op that
produces that input (an RMSNorm, or the linear whose output channels feed it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

# (linears sharing one input, the module producing that input)
LINEAR_GROUPS = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    (("self_attn.o_proj",), "self_attn.v_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    (("mlp.down_proj",), "mlp.up_proj"),
)
_DROP_KWARGS = ("hidden_states", "past_key_values", "past_key_value", "cache", "use_cache",
                "output_attentions")


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


@dataclass
class Group:
    names: tuple[str, ...]  # relative to the layer
    linears: list[nn.Linear]
    prev_name: str
    prev: nn.Module

    @property
    def in_features(self) -> int:
        return self.linears[0].in_features


def decoder_layers(model) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers (not a Llama-family model)")
    return layers


def layer_groups(layer: nn.Module) -> list[Group]:
    """The ``LINEAR_GROUPS`` of one decoder layer (every module must exist)."""
    groups = []
    for names, prev_name in LINEAR_GROUPS:
        try:
            linears = [layer.get_submodule(n) for n in names]
            prev = layer.get_submodule(prev_name)
        except AttributeError as e:
            raise ValueError(f"unsupported decoder layer {type(layer).__name__}: {e}") from e
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            raise ValueError(f"unsupported decoder layer {type(layer).__name__}: "
                             f"{names} are not all nn.Linear")
        groups.append(Group(names, linears, prev_name, prev))
    return groups


@torch.no_grad()
def capture_layer0_inputs(model, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, dict]]:
    """(hidden_states, kwargs) that the first decoder layer receives for each sample."""
    layer0 = decoder_layers(model)[0]
    captured = []

    def hook(module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        kw = {k: v for k, v in kwargs.items() if k not in _DROP_KWARGS}
        captured.append((hs.detach(), kw))
        raise _Stop

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in samples:
            try:
                model(input_ids=ids.reshape(1, -1), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(captured) != len(samples):
        raise RuntimeError("the first decoder layer was not reached for every sample")
    return captured


def _call(layer: nn.Module, hs: torch.Tensor, kw: dict) -> torch.Tensor:
    out = layer(hs, use_cache=False, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def collect(layer: nn.Module, states: list[tuple[torch.Tensor, dict]],
            observers: dict[nn.Module, Callable[[torch.Tensor], None]],
            stop_at: nn.Module | None = None) -> None:
    """Run ``layer`` on every sample, calling each observer with its module's 2-D input
    rows; the pass ends at ``stop_at`` once its input is observed."""
    handles = []
    for module, fn in observers.items():
        def hook(mod, args, fn=fn):
            x = args[0]
            fn(x.reshape(-1, x.shape[-1]))
            if mod is stop_at:
                raise _Stop
        handles.append(module.register_forward_pre_hook(hook))
    try:
        for hs, kw in states:
            try:
                _call(layer, hs, kw)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def advance(layer: nn.Module, states: list[tuple[torch.Tensor, dict]]) -> None:
    """Replace each sample's hidden states with ``layer``'s outputs (in place)."""
    for i, (hs, kw) in enumerate(states):
        states[i] = (_call(layer, hs, kw).detach(), kw)
