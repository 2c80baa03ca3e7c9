"""RoPE scaling as HF transformers defines it: inverse frequencies and attention factors of
the rope types ``default``, ``linear``, ``dynamic`` (NTK), ``yarn``, ``longrope`` and ``llama3``.

``scaling`` is an HF-format dict (``rope_type`` or the older ``type``, then the type's keys),
as ``heron.models.config.rope_of`` standardizes it: ``original_max_position_embeddings`` is
present for every scaled type but ``linear`` (for ``dynamic`` it is the model's
``max_position_embeddings``, the length HF's dynamic NTK scales from), and a ``factor`` left
None by a yarn / longrope config is resolved. The attention factor multiplies cos and sin.

Two types depend on the length ``L`` of the sequence a token belongs to (see ``RotaryEmbedding``):
``dynamic`` raises the base for ``L`` above the original length, ``longrope`` switches from its
short to its long factors there. The others ignore ``L``.
"""

from __future__ import annotations

import math

import torch

_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}
ROPE_TYPES = tuple(_REQUIRED)
# the types whose frequencies depend on the sequence length
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_type_of(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_scaling(scaling: dict | None, head_dim: int) -> str:
    """The rope type of ``scaling``; ValueError for an unknown type or a missing key."""
    kind = rope_type_of(scaling)
    if kind not in _REQUIRED:
        raise ValueError(f"unsupported rope scaling type {kind!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in _REQUIRED[kind] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} lacks the required key(s) "
                         f"{', '.join(missing)} (got {sorted(scaling)})")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != head_dim // 2:
                raise ValueError(f"rope scaling 'longrope': {key} has {len(scaling[key])} "
                                 f"entries, expected head_dim / 2 = {head_dim // 2}")
    return kind


def _exponents(head_dim: int) -> torch.Tensor:
    """(D/2,) float32: 2i / D."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, the band between
    interpolated."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_correction_dim(rotations: float, dim: int, base: float, length: int) -> float:
    """The dimension index whose wavelength makes ``rotations`` turns over ``length``."""
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: high frequencies extrapolated (kept), low ones interpolated (divided by
    ``factor``), a linear ramp between the dimensions set by beta_fast / beta_slow."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, head_dim, theta, old_len)
    high = _yarn_correction_dim(beta_slow, head_dim, theta, old_len)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _exponents(head_dim)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """The factor HF multiplies cos and sin by (1.0 but for yarn and longrope)."""
    kind = rope_type_of(scaling)
    given = (scaling or {}).get("attention_factor")
    if kind == "yarn":
        if given is not None:
            return float(given)
        factor = scaling["factor"]
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
        return _yarn_mscale(factor)
    if kind == "longrope":
        if given is not None:
            return float(given)
        factor = scaling.get("factor") or 1.0
        if factor <= 1.0:
            return 1.0
        original = scaling["original_max_position_embeddings"]
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                     seq_len: int | None = None) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, as HF's rope init function of the type computes
    them for a sequence of ``seq_len`` tokens (None: at most the original length)."""
    kind = check_scaling(scaling, head_dim)
    inv_freq = default_inv_freq(head_dim, theta)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32)
        return 1.0 / (factors * theta ** _exponents(head_dim))
    if kind == "dynamic" and seq_len is not None:
        return dynamic_inv_freq(head_dim, theta, scaling, torch.tensor([seq_len]))[0]
    return inv_freq


def dynamic_inv_freq(head_dim: int, theta: float, scaling: dict,
                     lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: (T,) int64 sequence lengths -> (T, D/2) float32 inverse frequencies, each
    row as HF computes it (in float32) for a forward whose longest sequence is that length."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    lengths = torch.clamp(lengths.to(torch.int64), min=old_len).unsqueeze(1)  # (T, 1)
    base = theta * ((factor * lengths / old_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** _exponents(head_dim).to(lengths.device))


def max_context(scaling: dict | None, max_position_embeddings: int) -> int:
    """The longest context the model's rope covers: ``max_position_embeddings``, or the
    original length times the scaling factor where that is more."""
    kind = rope_type_of(scaling)
    if kind == "default" or not scaling:
        return max_position_embeddings
    factor = scaling.get("factor") or 1.0
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    return max(max_position_embeddings, int(original * factor))
