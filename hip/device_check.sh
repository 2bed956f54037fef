#!/usr/bin/env bash
# One device call: build the wheel (meson-python from .whl), run every GPU test and
# the CPU kernel tests, then the decode-step benchmark (with its PyTorch baseline) and the
# kernel benchmark; logs and the JSON rows go to $OUT. About 6-9 minutes on an H200.
# Usage on the GPU machine, from the unpacked source tree: bash hip/device_check.sh
# SANITIZE=1 also runs the GPU tests under compute-sanitizer memcheck and racecheck, after
# proving the tool sees ctypes launches (hip/sanitizer_probe.py). BENCH=0 skips both
# benchmarks, DECODE_BENCH=0 / KERNEL_BENCH=0 one of them, TESTS=0 the tests (a second call
# that only measures); DECODE_ARGS= runs the full decode grid instead of --quick, BENCH_ARGS
# go to the kernel bench; PAGEDKV_VLLM_TRITON_DIR adds vLLM's Triton attention as a peer.
# MLX=1 also runs pagedkv.kernels.mlx on MLX's CUDA backend: its tests (tests/
# test_kernels_mlx*.py, test_pool_paged_attention.py) and `python -m pagedkv.bench mlx`
# (bench_mlx.json), with the mlx and mlx-cuda-13 wheels installed in /tmp/mlxsite
# (docs/kernels.md, "MLX dispatch": how to bring the wheels over). MLX_ONLY=1 skips the
# ctypes GPU tests and benches.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
rm -rf /tmp/site /tmp/w /tmp/pkv  # a warm machine keeps the last call's files
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/device.txt"
t0=$(date +%s)
python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/w . >"$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
python3 -m pip install -q --no-deps --target /tmp/pkv /tmp/w/*.whl || exit 1
export PAGEDKV_REQUIRE_GPU=1  # a lost device fails the GPU tests instead of skipping them
if [ "${MLX:-0}" = 1 ]; then
  [ -d /tmp/mlxsite/mlx ] || { echo "MLX=1: no mlx in /tmp/mlxsite; install the mlx and mlx-cuda-13 wheels there first"; exit 1; }
  MLXPATH=/tmp/pkv:/tmp/site:/tmp/mlxsite
  PYTHONPATH=$MLXPATH python3 -c "import mlx.core as mx, pagedkv.kernels.mlx as k; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('architecture'), 'kernels:', k.backend())" 2>&1 | tee "$OUT/mlx_device.txt"
  cd tests
  PYTHONPATH=$MLXPATH python3 -m pytest -q -p no:cacheprovider test_kernels_mlx_gpu.py \
    test_kernels_mlx.py test_pool_paged_attention.py 2>&1 | tee "$OUT/pytest_mlx.log" | tail -25
  cd ..
  PYTHONPATH=$MLXPATH timeout ${MLX_BENCH_TIMEOUT:-420} python3 -m pagedkv.bench mlx \
    --json "$OUT/bench_mlx.json" 2>&1 | tee "$OUT/bench_mlx.log"
  [ "${MLX_ONLY:-0}" = 1 ] && exit 0
fi
if [ "${TESTS:-1}" = 1 ]; then
  cd tests
  PYTHONPATH=/tmp/pkv:/tmp/site python3 -m pytest -q -m gpu -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  PYTHONPATH=/tmp/pkv:/tmp/site python3 -m pytest -q -p no:cacheprovider -k kernels 2>&1 | tail -3
  cd ..
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  cs="compute-sanitizer --error-exitcode 86 --print-limit 20"
  PYTHONPATH=/tmp/pkv:/tmp/site $cs --tool memcheck python3 hip/sanitizer_probe.py --plant \
    >"$OUT/sanitizer_probe.log" 2>&1
  echo "sanitizer probe, planted out-of-bounds write: rc $? (86 = seen)"
  PYTHONPATH=/tmp/pkv:/tmp/site $cs --tool memcheck python3 hip/sanitizer_probe.py --clean \
    >>"$OUT/sanitizer_probe.log" 2>&1
  echo "sanitizer probe, clean launch: rc $? (0 = clean)"
  cd tests
  for tool in memcheck racecheck; do
    PYTHONPATH=/tmp/pkv:/tmp/site $cs --tool $tool python3 -m pytest -q -m gpu \
      -p no:cacheprovider >"$OUT/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool over the GPU tests: rc $? (0 = no error, no hazard);" \
      "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitize_$tool.log" | tail -2 | tr '\n' ' ')"
  done
  cd ..
fi
[ "${BENCH:-1}" = 1 ] || exit 0
# The decode step: correctness check against float64, then the targeted configurations
# (batch 1 at 1k and 32k, batch 8 at 32k, batch 32 at 1k; f16 and q8 KV; HFQ4 and MQ4).
if [ "${DECODE_BENCH:-1}" = 1 ]; then
  PYTHONPATH=/tmp/pkv:/tmp/site timeout ${DECODE_TIMEOUT:-200} python3 -m pagedkv.bench decode \
    --json "$OUT/decode.json" ${DECODE_ARGS---quick} 2>&1 | tee "$OUT/decode.log"
fi
if [ "${KERNEL_BENCH:-1}" = 1 ]; then
  PYTHONPATH=/tmp/pkv:/tmp/site timeout ${BENCH_TIMEOUT:-200} python3 -m pagedkv.bench gpu \
    --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
