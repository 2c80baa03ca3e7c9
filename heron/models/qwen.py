"""Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k), built on the Llama decoder."""

from __future__ import annotations

from heron.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
