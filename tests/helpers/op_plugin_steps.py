"""Helpers for the op-plugin tests: a heron model of the tiny checkpoint and one prefill of it
(torch attention backend), and fake ``heron.ops`` entry points."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from heron.attention import AttentionMetadata, ForwardContext, forward_context
from heron.attention import get_attention_backend
from heron.layers.rotary import RotaryEmbedding
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig

CPU = torch.device("cpu")


def heron_model(path) -> torch.nn.Module:
    """heron's eager CPU float32 model of the checkpoint at ``path``."""
    source = resolve_model(str(path))
    model = build_model(ModelArchConfig.from_hf(source.hf_config), torch.float32, CPU)
    materialize_weights(model, source, "auto", torch.float32)
    optimize_layout(model, CPU)
    return model


def prefill(model, ids: list[int]) -> torch.Tensor:
    """Hidden states (T, hidden) of one request's prefill of ``ids``, in inference mode."""
    cfg, n, bs = model.config, len(ids), 4
    blocks = -(-n // bs)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reserve(n, CPU)
    kv = [torch.zeros(2, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
          for _ in range(cfg.num_layers)]
    md = AttentionMetadata(torch.arange(n), torch.arange(blocks)[None], torch.tensor([n]),
                           torch.tensor([0, n]), [0, n], [n], [n], bs)
    with torch.inference_mode(), forward_context(
            ForwardContext(md, kv, get_attention_backend("torch", CPU))):
        return model(torch.tensor(ids), torch.arange(n)).clone()


def fake_entry_point(name: str, target, dist: str = "fake-plugin"):
    """An object shaped like importlib.metadata.EntryPoint: ``load()`` returns ``target``, or
    raises it when it is an exception."""
    def load():
        if isinstance(target, BaseException):
            raise target
        return target

    return SimpleNamespace(name=name, value=f"{dist.replace('-', '_')}:ops",
                           dist=SimpleNamespace(name=dist), load=load)
