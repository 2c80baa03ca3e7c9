"""heron quantize: the algorithms (GPTQ, AWQ search, SmoothQuant folding, FP8) and the
published formats they write (GPTQ v1, AWQ GEMM, compressed-tensors), on a tiny random
Llama built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from heron.quantizer import awq_search, writers
from heron.quantizer.fp8_weights import FP8_DTYPE, fp8_quantize
from heron.quantizer.gptq_solver import HessianAccumulator, gptq_quantize
from heron.quantizer.intgrid import rtn_quantize
from heron.quantizer.quantize import QuantizeOptions, format_of, quantize_model
from heron.quantizer.smoothquant import AbsMax, int8_channel_quantize, smooth_scales

HIDDEN, INTER, VOCAB = 64, 128, 256


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g) @ mix + 0.1 * torch.randn(rows, k, generator=g)
    x[:, 3] *= 20.0  # an outlier channel, as real activations have
    return x


def _tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, and an outlier channel for SmoothQuant
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.weight[5] = 30.0
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model


def _samples(n: int = 4, length: int = 32, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=g) for _ in range(n)]


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


# -- GPTQ ----------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size,act_order,sym",
                         [(32, False, True), (64, True, True), (-1, False, False)])
def test_gptq_beats_round_to_nearest_on_its_calibration_data(group_size, act_order, sym):
    k, n = 128, 48
    x = _correlated_inputs(1024, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.05
    acc = HessianAccumulator(k)
    for chunk in x.split(100):
        acc.add(chunk)
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    r = gptq_quantize(w, acc.H, 4, group_size, sym, act_order)
    rtn = rtn_quantize(w, 4, group_size, sym)

    def err(wq):
        return float(torch.linalg.norm(x @ w.t() - x @ wq.t()))

    assert err(r.dequantize()) < 0.8 * err(rtn.dequantize())
    assert int(r.q.max()) <= 15 and r.num_groups == (1 if group_size == -1 else k // group_size)


def test_gptq_act_order_g_idx_and_dead_columns():
    k, n, gs = 96, 16, 32
    x = _correlated_inputs(512, k)
    x[:, 7] = 0.0  # a dead input channel
    w = torch.randn(n, k)
    acc = HessianAccumulator(k)
    acc.add(x)
    r = gptq_quantize(w, acc.H, 4, gs, True, act_order=True)
    g_idx = r.g_idx
    assert g_idx.shape == (k,) and int(g_idx.min()) == 0 and int(g_idx.max()) == k // gs - 1
    assert torch.bincount(g_idx).tolist() == [gs] * (k // gs)  # each group gs columns
    order = torch.argsort(torch.diag(acc.H), descending=True)
    assert torch.equal(g_idx[order], torch.arange(k) // gs)  # groups follow visiting order
    assert not torch.equal(g_idx, torch.arange(k) // gs)  # and that is not sequential here
    assert torch.all(r.dequantize()[:, 7] == 0)  # dead column zeroed


# -- AWQ -----------------------------------------------------------------------------------

def test_awq_search_lowers_error_vs_alpha_zero():
    k = 128
    x = _correlated_inputs(1024, k)
    x[:, 10:14] *= 15.0
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(64, k, generator=g) * 0.02, torch.randn(32, k, generator=g) * 0.02]
    st = awq_search.InputStats(k)
    for chunk in x.split(100):
        st.add(chunk)
    torch.testing.assert_close(st.mean_abs, x.abs().mean(0))
    torch.testing.assert_close(st.xtx, x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    res = awq_search.search_scales(st.xtx, st.mean_abs, ws, 4, 32)
    assert res.alpha > 0 and res.losses[res.alpha] < 0.9 * res.losses[0.0]
    assert res.scales.shape == (k,) and torch.all(res.scales > 0)

    w = torch.cat(ws)

    def output_mse(s):  # the search's loss, computed on the rows themselves
        wq = awq_search.fake_quant(w * s, 4, 32) / s
        return float(((x @ w.t() - x @ wq.t()) ** 2).mean())

    assert output_mse(res.scales) < 0.9 * output_mse(torch.ones(k))
    assert res.losses[0.0] == pytest.approx(output_mse(torch.ones(k)), rel=1e-3)
    assert res.losses[res.alpha] == pytest.approx(output_mse(res.scales), rel=1e-3)


def test_awq_folds_keep_the_function():
    model = _tiny_model()
    layer = model.model.layers[0]
    ids = _samples(1)[0].reshape(1, -1)
    with torch.no_grad():
        before = model(ids).logits
        s = torch.rand(HIDDEN) + 0.5
        awq_search.fold_into_norm(layer.input_layernorm,
                                  [layer.self_attn.q_proj, layer.self_attn.k_proj,
                                   layer.self_attn.v_proj], s)
        s2 = torch.rand(INTER) + 0.5
        awq_search.fold_into_linear(layer.mlp.up_proj, [layer.mlp.down_proj], s2)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


# -- SmoothQuant ---------------------------------------------------------------------------

def _qkv_input_max(model, samples) -> list[torch.Tensor]:
    stats = [AbsMax(HIDDEN) for _ in model.model.layers]
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(
        lambda m, a, st=st: st.add(a[0])) for layer, st in zip(model.model.layers, stats)]
    with torch.no_grad():
        logits = [model(ids.reshape(1, -1)).logits for ids in samples]
    for h in hooks:
        h.remove()
    return [st.value for st in stats], logits


def test_smoothquant_folding_keeps_logits_and_flattens_activations():
    model = _tiny_model()
    samples = _samples()
    act_before, logits_before = _qkv_input_max(model, samples)
    for layer, amax in zip(model.model.layers, act_before):
        lins = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        s = smooth_scales(amax, [lin.weight for lin in lins], 0.5)
        awq_search.fold_into_norm(layer.input_layernorm, lins, s)
    act_after, logits_after = _qkv_input_max(model, samples)
    for a, b in zip(logits_after, logits_before):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    for before, after in zip(act_before, act_after):
        assert float(after[5]) < 0.5 * float(before[5])  # the outlier channel shrank
        assert float(after.max() / after.median()) < float(before.max() / before.median())


def test_int8_channel_weights():
    w = torch.randn(32, 64)
    r = int8_channel_quantize(w)
    assert r.q.dtype == torch.int8 and r.scale.shape == (32, 1)
    assert int(r.q.abs().max()) == 127
    assert float((r.dequantize() - w).abs().max()) <= float(r.scale.max()) / 2 + 1e-6


# -- FP8 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor"])
def test_fp8_weight_within_fp8_error(scheme):
    w = torch.randn(48, 64) * torch.logspace(-2, 0, 48)[:, None]
    r = fp8_quantize(w, scheme)
    assert r.q.dtype == FP8_DTYPE
    assert r.scale.shape == ((48, 1) if scheme == "per-channel" else (1,))
    rel = (r.dequantize() - w).abs() / (w.abs() + 1e-12)
    big = w.abs() >= r.scale * 2 ** -6  # normal range of e4m3: 3 mantissa bits
    assert float(rel[big].max()) <= 2 ** -4 + 1e-6
    step = torch.where(w.abs() >= r.scale * 256, r.scale * 32, r.scale * 16)  # top binade
    assert torch.all((r.dequantize() - w).abs() <= step / 2 + 1e-7)
    assert torch.all((r.dequantize() - w)[~big].abs() <= r.scale.expand_as(w)[~big] * 2 ** -10)


# -- writers round trip --------------------------------------------------------------------

_CASES = {
    "gptq": QuantizeOptions(method="gptq", group_size=32, act_order=True),
    "gptq8": QuantizeOptions(method="gptq", bits=8, group_size=-1, sym=False),
    "awq": QuantizeOptions(method="awq", group_size=32),
    "smoothquant": QuantizeOptions(method="smoothquant"),
    "fp8": QuantizeOptions(method="fp8", fp8_scheme="per-tensor"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_writer_round_trip(case, tmp_path):
    from safetensors.torch import load_file

    opts = _CASES[case]
    model = _tiny_model()
    records = quantize_model(model, _samples(), opts, log=lambda m: None)
    assert len(records) == 14 and "lm_head" not in str(list(records))
    tensors, cfg, side = format_of(opts, records)
    writers.write_checkpoint(tmp_path, model, None, tensors, cfg, torch.float32, side)
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" in sd and sd["model.embed_tokens.weight"].dtype == torch.float32
    for name, r in records.items():
        lin = model.get_submodule(name)
        assert f"{name}.weight" not in sd or opts.method in ("smoothquant", "fp8")
        if opts.method == "gptq":
            pf = 32 // opts.bits
            assert sd[f"{name}.qweight"].shape == (lin.in_features // pf, lin.out_features)
            assert sd[f"{name}.qzeros"].dtype == torch.int32
            assert sd[f"{name}.scales"].dtype == torch.float16
            assert sd[f"{name}.g_idx"].dtype == torch.int32
            w = writers.gptq_dequantize(sd[f"{name}.qweight"], sd[f"{name}.qzeros"],
                                        sd[f"{name}.scales"], sd[f"{name}.g_idx"], opts.bits)
        elif opts.method == "awq":
            assert sd[f"{name}.qweight"].shape == (lin.in_features, lin.out_features // 8)
            assert sd[f"{name}.scales"].shape == (lin.in_features // 32, lin.out_features)
            w = writers.awq_dequantize(sd[f"{name}.qweight"], sd[f"{name}.qzeros"],
                                       sd[f"{name}.scales"])
        else:
            q, s = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
            assert q.dtype == (torch.int8 if opts.method == "smoothquant" else FP8_DTYPE)
            assert s.dtype == torch.float32
            w = writers.compressed_tensors_dequantize(q, s)
        assert torch.equal(w, r.dequantize())
        assert torch.equal(w, lin.weight)  # the model ran with exactly these weights


def test_gptq_v1_zero_convention():
    r = rtn_quantize(torch.randn(16, 64), 4, 32, sym=True)
    t = writers.gptq_tensors(r)
    assert torch.all(t["qzeros"] == 0x77777777)  # zero 8 stored as 7 in every nibble


# -- CLI end to end ------------------------------------------------------------------------

def _tiny_dir(path: Path) -> Path:
    _tiny_model().save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)
    return path


def test_cli_end_to_end(tmp_path):
    from heron.entrypoints.cli import main

    src = _tiny_dir(tmp_path / "src")
    calib = tmp_path / "calib.txt"
    calib.write_text("To be, or not to be, that is the question. " * 60)
    expect = {
        "gptq": ["--bits", "4", "--group-size", "32", "--act-order"],
        "awq": ["--group-size", "32"],
        "smoothquant": ["--alpha", "0.5"],
        "fp8": [],
    }
    for method, extra in expect.items():
        out = tmp_path / method
        rc = main(["quantize", str(src), "--method", method, "--calib", str(calib),
                   "--num-samples", "4", "--seq-len", "48", "--out", str(out), *extra])
        assert rc == 0
        cfg = json.loads((out / "config.json").read_text())
        qc = cfg["quantization_config"]
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
        assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
        if method == "gptq":
            assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act",
                                       "sym", "checkpoint_format", "true_sequential")} == {
                "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                "sym": True, "checkpoint_format": "gptq", "true_sequential": True}
            assert qc["damp_percent"] == 0.01
            assert json.loads((out / "quantize_config.json").read_text()) == qc
        elif method == "awq":
            assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32,
                          "zero_point": True, "version": "gemm",
                          "modules_to_not_convert": None}
        else:
            assert qc["quant_method"] == "compressed-tensors"
            assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
            group = qc["config_groups"]["group_0"]
            kind = "int" if method == "smoothquant" else "float"
            assert qc["format"] == f"{kind}-quantized" and group["targets"] == ["Linear"]
            assert group["weights"]["type"] == kind and group["weights"]["num_bits"] == 8
            assert group["weights"]["strategy"] == "channel" and not group["weights"]["dynamic"]
            act = group["input_activations"]
            assert (act["strategy"], act["dynamic"], act["symmetric"], act["type"]) == (
                "token", True, True, kind)


def test_cli_rejects_awq_partial_groups(tmp_path):
    from heron.entrypoints.cli import main

    src = _tiny_dir(tmp_path / "src")
    calib = tmp_path / "calib.txt"
    calib.write_text("some text " * 200)
    rc = main(["quantize", str(src), "--method", "awq", "--group-size", "48",
               "--calib", str(calib), "--out", str(tmp_path / "o")])
    assert rc == 2 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("hidden,intermediate,expected", [(128, 256, 128), (576, 1536, 64),
                                                          (96, 160, 32)])
def test_default_group_size_divides_every_input_size(hidden, intermediate, expected):
    """--group-size left out: 128 where it divides every linear's input (the tools' default),
    else 64 (SmolLM2: 576 = 9 x 64), else 32, so vLLM / AWQ GEMM get whole groups."""
    import transformers

    from heron.quantizer.quantize import QuantizeOptions, choose_group_size, resolve_group_size

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden,
                                      intermediate_size=intermediate, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    assert choose_group_size(model) == expected
    opts = QuantizeOptions(method="awq")
    resolve_group_size(model, opts, log=lambda m: None)
    assert opts.group_size == expected
    explicit = QuantizeOptions(method="gptq", group_size=-1)
    resolve_group_size(model, explicit, log=lambda m: None)
    assert explicit.group_size == -1
