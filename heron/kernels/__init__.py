"""Triton kernels for the CUDA fast path, and their float64 torch references.

Nothing here imports triton at package import: ``heron.kernels.runtime`` says whether triton
can run, and only then are the kernel modules (``attention_prefill``, ``attention_decode``,
``kv_store``, ``rmsnorm``, ``rotary``, ``activation``) imported. ``reference`` is plain torch
(the test oracle) and ``check`` is the precision-regression suite behind
``heron check-kernels``.
"""
