"""heron.layers.attention and heron.worker.compiled_forward: the attention dispatch is the backend call in eager mode, the opaque
``heron::attention`` op equals it, and the inductor-compiled forward (two graphs: one token,
any other count) matches eager float32 within 1e-5 and HF transformers' greedy tokens, without
recompiling across batch sizes, prefill lengths or a rotary-table rebuild."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy
from heron.attention import AttentionMetadata, ForwardContext, forward_context
from heron.attention import get_attention_backend
from heron.layers.attention import attention
from heron.worker.compiled_forward import compile_forward
from heron.layers.rotary import RotaryEmbedding
from heron.loader.model_source import resolve_model
from heron.loader.weights import build_model, materialize_weights, optimize_layout
from heron.models import ModelArchConfig

BLOCK = 4
CPU = torch.device("cpu")


def _backend():
    from heron.kernels import cpu

    return get_attention_backend("cpu" if cpu.load() else "torch", CPU)


class Steps:
    """A minimal runner: request i owns blocks [i * per_req, (i + 1) * per_req)."""

    def __init__(self, model, num_reqs: int, per_req: int):
        cfg = model.config
        self.model, self.per_req, self.backend = model, per_req, _backend()
        shape = (2, num_reqs * per_req, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [torch.zeros(shape) for _ in range(cfg.num_layers)]

    def run(self, fwd, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (request, token ids, start position) -> hidden states of the flat batch."""
        ids, pos, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for req, toks, start in chunks:
            p = list(range(start, start + len(toks)))
            ids += toks
            pos += p
            slots += [(req * self.per_req + q // BLOCK) * BLOCK + q % BLOCK for q in p]
            seq_lens.append(start + len(toks))
            starts.append(starts[-1] + len(toks))
            tables.append(list(range(req * self.per_req, (req + 1) * self.per_req)))
        md = AttentionMetadata(torch.tensor(slots), torch.tensor(tables), torch.tensor(seq_lens),
                               torch.tensor(starts), starts, [len(c[1]) for c in chunks],
                               seq_lens, BLOCK)
        with forward_context(ForwardContext(md, self.kv, self.backend)):
            return fwd(torch.tensor(ids), torch.tensor(pos))


@pytest.fixture(scope="module")
def built(tiny):
    """(HF model, heron's eager CPU model) of the tiny random Llama, same weights."""
    source = resolve_model(str(tiny.path))
    arch = ModelArchConfig.from_hf(source.hf_config)
    model = build_model(arch, torch.float32, CPU)
    materialize_weights(model, source, "auto", torch.float32)
    optimize_layout(model, CPU)
    return tiny.hf, model


def _reserve(model, length: int) -> None:
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reserve(length, CPU)


def test_attention_dispatch_and_opaque_op_equal_the_backend_call():
    torch.manual_seed(0)
    backend = _backend()
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    qkv = torch.cat([q, k, v], dim=1)  # the model passes strided views of one tensor
    qv, kv_, vv = qkv.split([4, 2, 2], dim=1)
    starts = [0, 3, 4, 5]
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    md = AttentionMetadata(torch.tensor([0, 1, 2, 10, 21]), tables, torch.tensor([3, 3, 6]),
                           torch.tensor(starts), starts, [3, 1, 1], [3, 3, 6], BLOCK)
    outs = []
    for call in ("backend", "dispatch", "op"):
        cache = [torch.zeros(2, 6, BLOCK, 2, 16)]
        with forward_context(ForwardContext(md, cache, backend)):
            if call == "backend":
                out = backend.forward(qv, kv_, vv, cache[0], md, 0.25, None)
            elif call == "dispatch":
                out = attention(qv, kv_, vv, 0, 0.25, None)
            else:
                out = torch.ops.heron.attention(qv, kv_, vv, 0, 0.25, 0)
        outs.append((out, cache[0]))
    for out, cache in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(cache, outs[0][1])


@torch.inference_mode()
def test_compiled_forward_matches_eager_and_hf_without_recompiles(built):
    from torch._dynamo.utils import counters

    hf, model = built
    _reserve(model, 64)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in (7, 12, 5)]
    eager_steps, compiled_steps = Steps(model, 3, 32), Steps(model, 3, 32)
    compiled = compile_forward(model)
    graphs_before = counters["stats"]["unique_graphs"]

    def both(chunks):
        want = eager_steps.run(model, chunks)
        got = compiled_steps.run(compiled, chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        return want

    # request 0 alone: a prefill, then one-token decodes (greedy, compared with HF)
    tokens = list(prompts[0])
    hidden = both([(0, tokens, 0)])
    for _ in range(6):
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
        hidden = both([(0, tokens[-1:], len(tokens) - 1)])
    assert tokens[len(prompts[0]):] == hf_greedy(hf, prompts[0], 6)[0]
    # other token counts: two more prefills, then batched decodes mixed with a prefill chunk
    both([(1, prompts[1], 0)])
    both([(2, prompts[2][:3], 0), (0, [5], len(tokens)), (1, [9], len(prompts[1]))])
    both([(0, [6], len(tokens) + 1), (1, [7], len(prompts[1]) + 1),
          (2, prompts[2][3:], 3)])
    assert counters["stats"]["unique_graphs"] - graphs_before == 2  # one token; any other

    # a rotary rebuild (new, longer tables) after compiling, then positions past the old ones
    _reserve(model, 128)
    both([(0, [11, 12, 13], 100), (1, [14], 90)])
    both([(2, [15], 110)])
