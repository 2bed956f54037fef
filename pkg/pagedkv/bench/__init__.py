"""Benchmarks runnable as ``python -m pagedkv.bench <suite>`` (``gpu``: the HIP/CUDA kernels;
``decode``: one decode step; ``mlx``: pagedkv.kernels.mlx; ``kvquant-quality``: KV-mode
quality on mlx-lm model code)."""
