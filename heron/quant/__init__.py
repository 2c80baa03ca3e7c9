"""Quantized weight formats at run time: how checkpoints pack integer and 8-bit weights, the
``LinearMethod`` seam each linear layer (and the vocabulary table) multiplies through, and
heron's canonical grouped integer layout (``int_layout``) that every integer format is
converted into. The offline quantizer that writes these formats is ``heron.quantizer``."""

# --quantization values (vLLM's names); torch-free so the CLI parser imports it cheaply
QUANTIZATION_CHOICES = ("gptq", "awq", "compressed-tensors", "gguf", "fp8", "none")
