"""GPU kernels: registry, ctypes HIP/CUDA loader, MLX dispatch."""
