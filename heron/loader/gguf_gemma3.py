"""What a llama.cpp ``gemma3`` GGUF needs beyond the Llama-family reading in ``gguf_loader``.

- Config: llama.cpp stores the window (``attention.sliding_window``) and optionally the local
  RoPE base (``rope.freq_base_swa``), the layer pattern (``attention.sliding_window_pattern``)
  and ``final_logit_softcapping``; what it leaves out takes HF Gemma 3's defaults (local base
  10000, every 6th layer global), as HF's own GGUF loading does.
- Tensors: ``ffn_norm`` is Gemma's pre-feedforward norm (Llama's post-attention one), plus
  ``post_attention_norm`` and ``post_ffw_norm``. llama.cpp's converter stores every Gemma norm
  weight as ``1 + w`` (its RMSNorm multiplies by the weight alone); HF keeps ``w``, so ``1`` is
  subtracted on load (float32, as HF transformers does). q/k rows are not permuted.
- Tokenizer: Gemma's turn markers. A GGUF converted from a base checkpoint may carry no chat
  template; then heron writes Gemma's turn format (below), and ``<end_of_turn>`` ends
  generation as ``<eos>`` does (Gemma 3's generation config stops on both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# llama.cpp's per-block names where Gemma 3 differs from the Llama family's
# (gguf_loader._BLOCK_NAMES): its ffn_norm is the pre-feedforward norm, and it has two more
BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

END_OF_TURN = "<end_of_turn>"

# Gemma's turn format: <bos>, then per message "<start_of_turn>{user|model}\n{text}<end_of_turn>\n";
# a system message is folded into the first user turn; text-only contents (a string or a list
# of {"type": "text"} parts).
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = text(messages[0]['content']) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{ raise_exception('Gemma turns must alternate user / assistant, starting with user') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + (ns.prefix if loop.first else '') + text(message['content']) | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def layer_types(num_layers: int, pattern) -> list[str]:
    """Per layer "sliding_attention" / "full_attention": ``pattern`` an int n (every n-th layer
    global), llama.cpp's per-layer list (true: sliding), or None (HF's default, 6)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"gemma3 GGUF: sliding_window_pattern has {len(pattern)} entries "
                             f"for {num_layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern or 6)
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]


def update_config(cfg: dict, key: Callable[..., Any]) -> None:
    """Complete the Llama-style ``cfg`` built from a gemma3 GGUF; ``key(name, default)`` reads
    ``gemma3.{name}`` metadata."""
    window = key("attention.sliding_window")
    if window is None:
        raise ValueError("gemma3 GGUF: no gemma3.attention.sliding_window in the metadata")
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    cfg.update(
        model_type="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(window),
        layer_types=layer_types(layers, key("attention.sliding_window_pattern")),
        rope_local_base_freq=float(key("rope.freq_base_swa", 10000.0)),
        # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers), whose
        # query_pre_attn_scalar is hidden / heads
        query_pre_attn_scalar=(cfg["hidden_size"] // heads if layers == 62
                               else cfg["head_dim"]),
        final_logit_softcapping=key("final_logit_softcapping"),
        attn_logit_softcapping=None,
    )


def shift_norm(gguf_name: str, w: torch.Tensor) -> torch.Tensor:
    """The HF value of a gemma3 GGUF tensor: norm weights stored as ``1 + w`` back to ``w``."""
    return w - 1.0 if gguf_name.endswith("norm.weight") else w


def extra_eos(tokenizer) -> list[int]:
    """Gemma's ``<end_of_turn>`` id, when the vocabulary has it."""
    tid = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    return [] if tid is None or tid == tokenizer.unk_token_id else [int(tid)]
