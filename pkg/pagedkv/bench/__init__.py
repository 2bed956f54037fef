"""Benchmarks runnable as ``python -m pagedkv.bench <suite>`` (``gpu``: the HIP/CUDA kernels;
``kvquant-quality``: KV-mode quality on mlx-lm model code)."""
