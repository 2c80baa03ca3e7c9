"""``heron quantize``: the offline post-training quantizer (GPTQ, AWQ, SmoothQuant, FP8).

It loads a model with transformers, quantizes its decoder linears one layer at a time on
calibration text and writes a published checkpoint format (GPTQ, AWQ GEMM,
compressed-tensors) that heron's runtime formats (``heron.quant``), vLLM and transformers
load. It reads models (transformers, ``heron.loader``) and calibration text
(``heron.training.draft_data``), so it sits above both; nothing in the engine imports it.

* ``cli``: the ``heron quantize`` flags; ``quantize``: load, calibrate, quantize, write.
* ``calibration``: text -> token sequences; ``sequential``: one decoder layer at a time.
* The algorithms, each on one linear or one layer's group of linears: ``gptq_solver``
  (Hessian-weighted column-by-column rounding), ``awq_search`` (activation-aware scales),
  ``smoothquant`` (outlier migration, int8), ``fp8_weights`` (fp8 casts, no data), over the
  shared integer grids of ``intgrid``.
* ``writers``: a quantized linear -> the checkpoint tensors and ``quantization_config``.
"""
