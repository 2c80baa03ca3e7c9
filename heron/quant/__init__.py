"""Quantized weight formats: how checkpoints pack integer weights, and heron's canonical grouped
integer layout (``int_layout``) that every format is converted into."""

# --quantization values (vLLM's names); torch-free so the CLI parser imports it cheaply
QUANTIZATION_CHOICES = ("gptq", "awq", "compressed-tensors", "gguf", "fp8", "none")
