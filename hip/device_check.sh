#!/usr/bin/env bash
# One device call: build the wheel (meson-python from .whl), run the GPU tests and the CPU
# kernel tests, the MLX-CUDA tests and bench (MLX=1), the decode-step and kernel benchmarks,
# and the compute-sanitizer runs (SANITIZE=1), all inside one time budget; logs, the JSON
# rows and phases.txt (each phase's seconds and exit status) go to $OUT.
# Usage on the GPU machine, from the unpacked source tree: bash hip/device_check.sh
#
# Budget: BUDGET_S (default 560, under a device call's 600 s) is the whole call's wall
# time. Phases run in this order, each under `timeout` of the smaller of its own limit and
# what is left of the budget; a phase that would get less than MIN_PHASE_S (20) is skipped
# and says so. Order (most needed first): build; ctypes GPU tests (TESTS=0 skips them and
# the CPU kernel tests; GPU_TESTS_K="q8 or attention" runs the ones pytest -k selects);
# MLX tests (MLX=1); decode bench (DECODE_TIMEOUT, 150; DECODE_BENCH=0 skips; DECODE_ARGS=
# runs the full grid instead of --quick; DECODE_TORCH_COMPILE=1 adds --torch-compile, the
# torch.compile'd bf16 peer, whose compiles need a longer DECODE_TIMEOUT); kernel bench
# (BENCH_TIMEOUT, 150; KERNEL_BENCH=0 skips; BENCH_ARGS go to it; PAGEDKV_VLLM_TRITON_DIR adds vLLM's
# Triton attention as a peer); MLX bench (MLX_BENCH_TIMEOUT, 240: its GEMV rows run
# twice, as built and inside mx.compile); the CPU kernel tests
# (CPU_TESTS_TIMEOUT, 150); sanitizer (SANITIZE=1:
# the probe proving compute-sanitizer sees ctypes launches, then memcheck and racecheck
# over the GPU tests (racecheck without the tests RACECHECK_DESELECT names: sanitize_tool
# says why): SANITIZE_TIMEOUT for memcheck, 150, and RACECHECK_TIMEOUT for
# racecheck, 240, or SANITIZE_TIMEOUT when only that is set; over the 412 GPU tests on the
# H200, 2026-12-04, memcheck took 111 s and racecheck about 195, so SANITIZE=1 TESTS=0
# BENCH=0 fits one call after the build); MLX_SANITIZE=1 runs memcheck over MLX's own
# launches (mlx_sanitize below). BENCH=0 skips all three benches;
# MLX_ONLY=1 runs build + MLX phases only; MLX_LM=1 adds the mlx-lm integration tests
# (MLX_LM_TIMEOUT, 300; the mlx-lm and sentencepiece wheels travel in .mlx2; MLX_TESTS=0 skips
# the kernel tests); MLX_LM_BENCH=1 adds the decode bench of mlx-lm's attention="paged"
# (bfloat16, MLX_LM_BENCH_TIMEOUT, 240; docs/performance.md, "Paged attention"). Measured on
# the H200 (2026-12-02): build 30 s,
# ctypes tests ~25 s, MLX tests ~75 s (NVRTC compiles each kernel once a process),
# decode bench --quick ~150 s, kernel bench ~120 s.
#
# FUZZ=1 runs the fuzz campaign (tests/fuzz/campaign.py) on the spare CPU cores meanwhile,
# FUZZ_WORKERS processes (default: cores - 2) for FUZZ_SECONDS each (default 420, cut to
# what the budget leaves) over FUZZ_TARGETS (default: all), with atheris installed from the
# wheel in ${ATHERIS_WHL:-.atheris}; the call waits for it at the end ($OUT/fuzz:
# campaign.json, table.md, the logs and any findings).
#
# CPU_BENCH=1 times the CPU weight kernels on two spare cores meanwhile (below).
#
# TUNE="<args>;<args>" runs hip/tune.py once per argument list after the GPU tests, each a
# phase (TUNE_TIMEOUT, 240 s), e.g. OBJECTS=0 TUNE="gemvx --warps auto,4" bash
# hip/device_check.sh.
#
# OBJECTS=0 builds the package without kernel objects (Cython and Python only) for calls
# that run only hip/tune.py sweeps with -D variants (every one but `gemv`, which times the
# installed kernels): tune.py compiles and loads its own variants of the source it sweeps,
# and its copy bandwidth (pagedkv.bench.gpu.copy_bandwidth) is then the runtime's memcpy
# alone. That build took 94 s on a 2-core VM; the full sm_90 one takes ~150 s on the H200's
# 16 cores, where the variants' nvcc runs (one core each) come after it either way.
#
# NVIDIA_ARCHES: the arches nvcc builds (meson's nvidia_arches, comma-separated), by default
# the device's own (nvidia-smi's compute capability: sm_90 on the H200). The project's list
# (sm_80 and sm_90) took 256 s to build there against 165 s for sm_90 alone (2026-12-04),
# and the sm_80 SASS is of no use on the machine that builds it. NVIDIA_ARCHES=all builds
# the project's list; so does a device whose capability nvidia-smi does not report.
#
# MLX=1 needs the mlx and mlx-cuda-13 wheels in $WORK/mlxsite, or their pieces: the script
# stashes whatever of .mlx1/ and .mlx2/ the call carried in $MLX_STASH (/root/mlx, kept while
# the machine stays warm), joins part.aa + part.ab there into the mlx-cuda-13 wheel and
# installs both (docs/kernels.md, "On the H200"). A call that carries .mlx1 can run
# everything but MLX; the next call, carrying .mlx2, then has the whole wheel.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WHL=${WHL:-.whl}
WORK=${WORK:-/tmp}              # the installs: $WORK/site, $WORK/pkv, $WORK/mlxsite
MLX_STASH=${MLX_STASH:-/root/mlx}  # MLX wheel pieces kept between calls
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
MIN_PHASE_S=${MIN_PHASE_S:-20}
: >"$OUT/phases.txt"

left() { echo $(( BUDGET_S - ($(date +%s) - T_START) )); }

# phase NAME LIMIT_S CMD...: run CMD under timeout min(LIMIT_S, budget left - 5).
phase() {
  local name=$1 limit=$2; shift 2
  local t; t=$(( $(left) - 5 )); (( limit < t )) && t=$limit
  if (( t < MIN_PHASE_S )); then
    echo "phase $name: skipped, ${t} s of the budget left" | tee -a "$OUT/phases.txt"
    return 0
  fi
  local t0; t0=$(date +%s)
  timeout "$t" "$@"
  local rc=$?
  echo "phase $name: rc $rc, $(( $(date +%s) - t0 )) s (limit $t s)$( ((rc == 124)) && echo ', CUT by its time limit')" \
    | tee -a "$OUT/phases.txt"
  return 0
}

# a warm machine keeps the last call's files; REUSE_BUILD=1 keeps its build of pagedkv too
# (a second call on the same tree, e.g. the MLX half of a two-call run), unless that build
# has no kernel objects (OBJECTS=0, marked below) and this call needs them
NO_OBJECTS_MARK=$WORK/pkv/.no_kernel_objects
if [ "${REUSE_BUILD:-0}" = 1 ] && [ -f "$NO_OBJECTS_MARK" ] && [ "${OBJECTS:-1}" != 0 ]; then
  echo "REUSE_BUILD=1: the warm build was OBJECTS=0 (no kernel objects): building again" \
    | tee -a "$OUT/phases.txt"
fi
if [ "${REUSE_BUILD:-0}" = 1 ] && [ -d "$WORK/pkv/pagedkv" ] \
   && { [ "${OBJECTS:-1}" = 0 ] || [ ! -f "$NO_OBJECTS_MARK" ]; }; then
  echo "phase build: reused the warm machine's build" | tee -a "$OUT/phases.txt"
  export PYTHONPATH=$WORK/site
else
rm -rf "$WORK/site" "$WORK/w" "$WORK/pkv" "$WORK/fuzz" "$WORK/fuzzsite"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHL"/*.whl || exit 1
export PYTHONPATH=$WORK/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/device.txt"
arches=${NVIDIA_ARCHES:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
  | head -n 1 | tr -d ' .')}
arches=${arches:+sm_${arches#sm_}}
build_args=()
[[ "$arches" =~ ^sm_[0-9]+(,sm_[0-9]+)*$ ]] && build_args=("-Csetup-args=-Dnvidia_arches=$arches")
# OBJECTS=0: Python and Cython only, no kernel objects (for a hip/tune.py call, which
# launches only the variants it compiles: the build takes a fraction of the full one's time)
[ "${OBJECTS:-1}" = 0 ] && build_args=("-Csetup-args=-Dcuda=disabled" "-Csetup-args=-Dhip=disabled")
echo "nvidia arches: ${build_args[*]:-meson default}" | tee -a "$OUT/device.txt"
t0=$(date +%s)
python3 -m pip wheel -q --no-build-isolation --no-deps "${build_args[@]}" -w "$WORK/w" . \
  >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "phase build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
python3 -m pip install -q --no-deps --target "$WORK/pkv" "$WORK"/w/*.whl || exit 1
[ "${OBJECTS:-1}" = 0 ] && mkdir -p "$WORK/pkv" && touch "$NO_OBJECTS_MARK"
fi
export PAGEDKV_REQUIRE_GPU=1  # a lost device fails the GPU tests instead of skipping them
PKV=$WORK/pkv:$WORK/site
MLXPATH=$PKV:$WORK/mlxsite

if [ "${FUZZ:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target "$WORK/fuzzsite" \
    "${ATHERIS_WHL:-.atheris}"/*.whl || exit 1
  mkdir -p "$OUT/fuzz"
  fuzz_s=${FUZZ_SECONDS:-420}
  (( fuzz_s > $(left) - 40 )) && fuzz_s=$(( $(left) - 40 ))  # ends inside the budget
  fuzz_t0=$(date +%s)
  PYTHONPATH=$PKV:$WORK/fuzzsite python3 tests/fuzz/campaign.py \
    --workers "${FUZZ_WORKERS:-$(( $(nproc) - 2 ))}" --seconds "$fuzz_s" \
    --out "$WORK/fuzz" ${FUZZ_TARGETS:-} >"$OUT/fuzz/table.md" 2>"$OUT/fuzz/campaign.err" &
  fuzz_pid=$!
  fuzz_finish() {
    wait "$fuzz_pid"
    local rc=$?
    echo "phase fuzz: rc $rc, $(( $(date +%s) - fuzz_t0 )) s (${fuzz_s} s per worker; 0 = no finding)" \
      | tee -a "$OUT/phases.txt"
    cat "$OUT/fuzz/table.md"
    cp "$WORK/fuzz/campaign.json" "$OUT/fuzz/" 2>/dev/null
    tar -C "$WORK/fuzz" -czf "$OUT/fuzz/logs_and_findings.tgz" logs crashes 2>/dev/null
  }
  trap fuzz_finish EXIT
fi

# CPU_BENCH=1: the CPU weight kernels (issue 18) on two otherwise idle cores of the GPU host
# (CPU_BENCH_CORES, default the last two), in the background while the other phases run:
# 1 against 2 threads (alternated pairs, then runs with the pool's workers spinning or asleep),
# then the AVX2 kernels at batch 1-8. $OUT/cpu_threads.log, cpu_spin.log, cpu_avx2.log.
if [ "${CPU_BENCH:-0}" = 1 ]; then
  cores=${CPU_BENCH_CORES:-$(( $(nproc) - 2 )),$(( $(nproc) - 1 ))}
  ( cd asv_bench/benchmarks && export PYTHONPATH=$PKV &&
    timeout $(( $(left) - 20 )) taskset -c "$cores" python3 cpu_gemv.py --threads-scaling 40 \
      >"$OUT/cpu_threads.log" 2>&1;
    timeout $(( $(left) - 20 )) taskset -c "$cores" python3 cpu_gemv.py --spin-ab 20 \
      >"$OUT/cpu_spin.log" 2>&1;
    timeout $(( $(left) - 15 )) taskset -c "$cores" python3 cpu_gemv.py --isa avx2 --rounds 3 \
      --only "b1,b2,b4,b8" --json "$OUT/cpu_avx2.json" >"$OUT/cpu_avx2.log" 2>&1 ) &
  cpu_bench_pid=$!
fi

stash_mlx() {
  mkdir -p "$MLX_STASH"
  local d
  for d in .mlx1 .mlx2; do [ -d "$d" ] && cp -n "$d"/* "$MLX_STASH"/; done
  return 0
}
mlx_install() {
  [ -d "$WORK/mlxsite/mlx" ] && return 0
  stash_mlx
  local cuda_whl=$MLX_STASH/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  if [ ! -f "$cuda_whl" ] && [ -f "$MLX_STASH/part.aa" ] && [ -f "$MLX_STASH/part.ab" ]; then
    cat "$MLX_STASH/part.aa" "$MLX_STASH/part.ab" >"$cuda_whl"
  fi
  if [ ! -f "$cuda_whl" ] || ! ls "$MLX_STASH"/mlx-0.32.4-*.whl >/dev/null 2>&1; then
    echo "MLX=1: $MLX_STASH holds $(ls "$MLX_STASH" | tr '\n' ' '); the mlx wheel and both" \
      "parts of mlx-cuda-13 are needed (carry .mlx1 in one call, .mlx2 in the next)"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --target "$WORK/mlxsite" \
    "$MLX_STASH"/mlx-0.32.4-*.whl "$cuda_whl"
  # mlx-lm is pure Python; its own deps (transformers, jinja2, protobuf, pyyaml) are on the
  # machine already, sentencepiece is not: both wheels travel in .mlx2 when MLX_LM=1.
  if ls "$MLX_STASH"/mlx_lm-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target "$WORK/mlxsite" \
      "$MLX_STASH"/mlx_lm-*.whl "$MLX_STASH"/sentencepiece-*.whl
  fi
}

MLX_OK=0
if [ "${MLX:-0}" = 1 ]; then
  if mlx_install; then
    MLX_OK=1
    PYTHONPATH=$MLXPATH python3 -c "import mlx.core as mx, pagedkv.kernels.mlx as k; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('architecture'), 'kernels:', k.backend())" 2>&1 | tee "$OUT/mlx_device.txt"
  fi
else
  stash_mlx  # the pieces this call carried, for a later MLX=1 call on this warm machine
fi

ctypes_tests() {
  set -o pipefail
  cd tests || return 1
  local select=()
  [ -n "${GPU_TESTS_K:-}" ] && select=(-k "$GPU_TESTS_K")
  PYTHONPATH=$PKV python3 -m pytest -q -m gpu -p no:cacheprovider "${select[@]}" 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
}
# The CPU kernel tests on this machine's Python (the wheel built here): their own phase,
# after the benches, so a cut (CPU_BENCH=1 takes two of the cores) leaves the GPU tests'
# status alone (2026-12-05: 414 GPU tests passed, then the phase was cut in these).
cpu_kernel_tests() {
  set -o pipefail
  cd tests || return 1
  PYTHONPATH=$PKV python3 -m pytest -q -p no:cacheprovider -k kernels -m "not gpu" 2>&1 \
    | tee "$OUT/pytest_cpu_kernels.log" | tail -3
}
mlx_tests() {
  set -o pipefail
  cd tests || return 1
  PYTHONPATH=$MLXPATH python3 -m pytest -q -p no:cacheprovider test_kernels_mlx_gpu.py \
    test_kernels_mlx.py test_pool_paged_attention.py 2>&1 | tee "$OUT/pytest_mlx.log" | tail -25
}
# memcheck over MLX's own launches (MLX_SANITIZE=1): the kernels mx.fast.cuda_kernel compiles
# from our header text, q8 and the staged attention among them, which the ctypes GPU tests
# never launch (MLX_SANITIZE_K, a pytest -k, picks the tests; MLX_SANITIZE_TIMEOUT, 200)
mlx_sanitize() {
  cd tests || return 1
  PYTHONPATH=$MLXPATH compute-sanitizer --error-exitcode 86 --print-limit 20 --tool memcheck \
    python3 -m pytest -q -p no:cacheprovider -k "${MLX_SANITIZE_K:-q8}" test_kernels_mlx_gpu.py \
    >"$OUT/sanitize_mlx_memcheck.log" 2>&1
  local rc=$?
  echo "compute-sanitizer memcheck over the MLX kernel tests (-k ${MLX_SANITIZE_K:-q8}): rc $rc;" \
    "$(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize_mlx_memcheck.log" | tail -2 | tr '\n' ' ')"
  return $rc
}
# The mlx-lm integration's tests (issue 12) on MLX's CUDA backend: the same files as on CPU.
mlx_lm_tests() {
  set -o pipefail
  cd tests || return 1
  PAGEDKV_PARITY_LOG=$OUT/parity.jsonl PYTHONPATH=$MLXPATH \
    python3 -m pytest -q -p no:cacheprovider ${MLX_LM_PYTEST_ARGS:-} \
    test_integration_mlx_lm.py test_integration_mlx_lm_hybrid.py \
    test_integration_mlx_lm_kv_modes.py test_serve_mlx_lm.py test_docs_examples_mlx_lm.py \
    test_mlx_lm_parity.py test_integration_mlx_lm_paged_attention.py \
    2>&1 | tee "$OUT/pytest_mlx_lm.log" | tail -40
}
sanitize() {
  local cs="compute-sanitizer --error-exitcode 86 --print-limit 20"
  PYTHONPATH=$PKV $cs --tool memcheck python3 hip/sanitizer_probe.py --plant \
    >"$OUT/sanitizer_probe.log" 2>&1
  echo "sanitizer probe, planted out-of-bounds write: rc $? (86 = seen)"
  PYTHONPATH=$PKV $cs --tool memcheck python3 hip/sanitizer_probe.py --clean \
    >>"$OUT/sanitizer_probe.log" 2>&1
  echo "sanitizer probe, clean launch: rc $? (0 = clean)"
}
sanitize_tool() {
  cd tests || return 1
  local select=(-m gpu)
  # racecheck tracks every shared-memory access: on the H200 (2026-12-05) two racecheck runs
  # stalled for over 170 s in the full-size pipelined-GEMV comparisons (32 GEMV pairs at
  # 4096-14336 rows) and were cut before the last 30 tests. It leaves them to
  # test_gpu_pipelined_gemv_edges_and_a_nan_row (the same kernel at M = 300);
  # RACECHECK_DESELECT= (empty) keeps them, another value deselects other tests (pytest -k).
  local deselect=${RACECHECK_DESELECT-test_gpu_pipelined_gemv_is_the_staged_kernel_bit_for_bit}
  [[ $1 == racecheck && -n $deselect ]] && select+=(-k "not ($deselect)")
  PYTHONPATH=$PKV compute-sanitizer --error-exitcode 86 --print-limit 20 --tool "$1" \
    python3 -m pytest -q "${select[@]}" -p no:cacheprovider >"$OUT/sanitize_$1.log" 2>&1
  local rc=$?
  echo "compute-sanitizer $1 over the GPU tests: rc $rc (0 = no error, no hazard);" \
    "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitize_$1.log" | tail -2 | tr '\n' ' ')"
  return $rc
}
export -f ctypes_tests cpu_kernel_tests mlx_tests mlx_lm_tests mlx_sanitize sanitize sanitize_tool
export OUT PKV MLXPATH

ONLY_MLX=${MLX_ONLY:-0}
if [ "${OBJECTS:-1}" = 0 ]; then  # nothing but tune.py can run without the kernel objects
  echo "OBJECTS=0: no kernel objects, so only the TUNE phases run" | tee -a "$OUT/phases.txt"
  TESTS=0 BENCH=0 SANITIZE=0 MLX_OK=0
fi
[ "${TESTS:-1}" = 1 ] && [ "$ONLY_MLX" != 1 ] && phase ctypes-tests 200 bash -c ctypes_tests
# TUNE: hip/tune.py runs, ';'-separated argument lists (TUNE="gemvx --set
# PKV_GEMV_X_ROW_TILES=1,2;attn --kv q8s"), each a phase of its own (TUNE_TIMEOUT, 240),
# its output in $OUT/tune_<n>.txt
if [ -n "${TUNE:-}" ]; then
  IFS=';' read -r -a tune_runs <<<"$TUNE"
  for n in "${!tune_runs[@]}"; do
    phase "tune-$n" "${TUNE_TIMEOUT:-240}" bash -c \
      "set -o pipefail; PYTHONPATH=$PKV python3 hip/tune.py ${tune_runs[$n]} 2>&1 | tee $OUT/tune_$n.txt"
  done
fi
[ "$MLX_OK" = 1 ] && [ "${MLX_TESTS:-1}" = 1 ] && phase mlx-tests 200 bash -c mlx_tests
[ "$MLX_OK" = 1 ] && [ "${MLX_SANITIZE:-0}" = 1 ] && phase mlx-memcheck \
  "${MLX_SANITIZE_TIMEOUT:-200}" bash -c mlx_sanitize
[ "$MLX_OK" = 1 ] && [ "${MLX_LM:-0}" = 1 ] && phase mlx-lm-tests "${MLX_LM_TIMEOUT:-300}" bash -c mlx_lm_tests
if [ "${BENCH:-1}" = 1 ] && [ "$ONLY_MLX" != 1 ]; then
  # The decode step: correctness check against float64, then the targeted configurations
  # (batch 1 at 1k and 32k, batch 8 at 32k, batch 32 at 1k; f16 and q8 KV; HFQ4 and MQ4).
  # The bench rewrites its JSON after every row, so a cut run keeps its figures.
  DECODE_COMPILE_FLAG=""
  [ "${DECODE_TORCH_COMPILE:-0}" = 1 ] && DECODE_COMPILE_FLAG=" --torch-compile"
  [ "${DECODE_BENCH:-1}" = 1 ] && phase decode-bench "${DECODE_TIMEOUT:-150}" bash -c \
    "set -o pipefail; PYTHONPATH=$PKV python3 -m pagedkv.bench decode --json $OUT/decode.json ${DECODE_ARGS---quick}$DECODE_COMPILE_FLAG 2>&1 | tee $OUT/decode.log"
  [ "${KERNEL_BENCH:-1}" = 1 ] && phase kernel-bench "${BENCH_TIMEOUT:-150}" bash -c \
    "set -o pipefail; PYTHONPATH=$PKV python3 -m pagedkv.bench gpu --json $OUT/bench.json ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log"
fi
[ "$MLX_OK" = 1 ] && [ "${BENCH:-1}" = 1 ] && phase mlx-bench "${MLX_BENCH_TIMEOUT:-240}" bash -c \
  "set -o pipefail; PYTHONPATH=$MLXPATH python3 -m pagedkv.bench mlx --json $OUT/bench_mlx.json 2>&1 | tee $OUT/bench_mlx.log"
[ "$MLX_OK" = 1 ] && [ "${MLX_LM_BENCH:-0}" = 1 ] && phase mlx-lm-bench "${MLX_LM_BENCH_TIMEOUT:-240}" bash -c \
  "set -o pipefail; PYTHONPATH=$MLXPATH python3 asv_bench/benchmarks/integration_mlx_lm.py --paged-attention --quick --dtype bfloat16 2>&1 | tee $OUT/bench_mlx_lm_paged.log"
[ "${TESTS:-1}" = 1 ] && [ "$ONLY_MLX" != 1 ] && phase cpu-kernel-tests \
  "${CPU_TESTS_TIMEOUT:-150}" bash -c cpu_kernel_tests
if [ "${SANITIZE:-0}" = 1 ] && [ "$ONLY_MLX" != 1 ]; then
  phase sanitizer-probe 60 bash -c sanitize
  phase memcheck "${SANITIZE_TIMEOUT:-150}" bash -c "sanitize_tool memcheck"
  phase racecheck "${RACECHECK_TIMEOUT:-${SANITIZE_TIMEOUT:-240}}" bash -c "sanitize_tool racecheck"
fi
[ -n "${cpu_bench_pid:-}" ] && { wait "$cpu_bench_pid"; echo "phase cpu-bench: rc $?" | tee -a "$OUT/phases.txt"; }
echo "device_check: $(( $(date +%s) - T_START )) s of a ${BUDGET_S} s budget"
cat "$OUT/phases.txt"
