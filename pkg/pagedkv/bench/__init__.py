"""Benchmarks runnable as ``python -m pagedkv.bench <suite>`` (``gpu``: the HIP/CUDA kernels; ``mlx``: pagedkv.kernels.mlx)."""
