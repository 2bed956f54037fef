"""hip/device_check.sh's one time budget, run here with stub commands instead of a GPU:
phases run in order, a phase over its own limit is cut and says so, a phase the budget no
longer fits is skipped and says so, and the MLX wheel's pieces carried by two calls are
stashed, joined and installed (docs/development.md, "GPU tests")."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "hip" / "device_check.sh"

pytestmark = [
    pytest.mark.skipif(not SCRIPT.is_file(), reason="hip/ is not next to the tests"),
    pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None,
                       reason="needs bash and coreutils timeout"),
]

# python3 stub: logs its arguments; the wheel build leaves a wheel; the decode bench sleeps
# DECODE_SLEEP seconds (to be cut); pytest prints a summary.
PYTHON3 = """#!/bin/bash
echo "python3 $*" >>"$CALLS"
case "$*" in
  *"pip wheel"*) mkdir -p "$WORK/w" && touch "$WORK/w/pagedkv-0-py3-none-any.whl" ;;
  *"pagedkv.bench decode"*) sleep "${DECODE_SLEEP:-0}" ;;
  *"-m pytest"*) echo "1 passed in 0.01s" ;;
esac
exit 0
"""
LOGGING_STUB = """#!/bin/bash
echo "$(basename "$0") $*" >>"$CALLS"
exit 0
"""


# nvidia-smi stub of an H200: compute capability 9.0.
NVIDIA_SMI_H200 = """#!/bin/bash
echo "$(basename "$0") $*" >>"$CALLS"
case "$*" in *compute_cap*) echo "9.0" ;; esac
exit 0
"""


def _run(tmp_path: Path, nvidia_smi: str = LOGGING_STUB,
         **env: str) -> tuple[list[str], list[str], str]:
    """(phases.txt lines, logged stub calls, stdout) of one run of the script."""
    bin_dir, tree, out, work = (tmp_path / n for n in ("bin", "tree", "out", "work"))
    for d in (bin_dir, tree / "tests", tree / ".whl", out, work):
        d.mkdir(parents=True, exist_ok=True)
    (tree / ".whl" / "meson_python-0-py3-none-any.whl").touch()
    for name, text in (("python3", PYTHON3), ("nvidia-smi", nvidia_smi),
                       ("compute-sanitizer", LOGGING_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    calls.touch()
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
                "OUT": str(out), "WORK": str(work), "MLX_STASH": str(tmp_path / "stash"),
                "CALLS": str(calls), "MIN_PHASE_S": "1", **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tree, env=full_env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (out / "phases.txt").read_text().splitlines(), calls.read_text().splitlines(), \
        proc.stdout


def _names(phases: list[str]) -> list[str]:
    return [line.split(":")[0].removeprefix("phase ") for line in phases]


def test_every_phase_runs_in_order_and_a_phase_over_its_limit_is_cut(tmp_path):
    phases, calls, _ = _run(tmp_path, SANITIZE="1", DECODE_TIMEOUT="2", DECODE_SLEEP="30",
                            BUDGET_S="100")
    assert _names(phases) == ["build", "ctypes-tests", "decode-bench", "kernel-bench",
                              "cpu-kernel-tests", "sanitizer-probe", "memcheck", "racecheck"]
    decode = phases[2]
    assert "rc 124" in decode and "CUT by its time limit" in decode and "(limit 2 s)" in decode
    assert all("rc 0" in line for i, line in enumerate(phases) if i not in (0, 2)), phases
    assert any("pagedkv.bench gpu --json" in c for c in calls)
    # the GPU tests, then (after the benches) the CPU kernel tests apart from them
    # (the sanitizer's runs of the GPU tests go through compute-sanitizer)
    plain = [c for c in calls if c.startswith("python3 -m pytest")]
    gpu_tests = [i for i, c in enumerate(plain) if "-m gpu" in c]
    cpu_tests = [i for i, c in enumerate(plain) if "-k kernels" in c]
    assert gpu_tests == [0] and cpu_tests == [1] and "not gpu" in plain[1]
    assert sum("--tool memcheck" in c for c in calls) == 3  # probe --plant, --clean, the tests
    # racecheck leaves out the full-size pipelined-GEMV comparisons (too slow under it)
    memcheck, racecheck = (next(c for c in calls if f"--tool {t} python3 -m pytest" in c)
                           for t in ("memcheck", "racecheck"))
    assert " -k " not in memcheck
    assert "-m gpu -k not (test_gpu_pipelined_gemv_is_the_staged_kernel_bit_for_bit)" in racecheck


@pytest.mark.parametrize(("deselect", "want"), [
    ("", "-m gpu -p no:cacheprovider"), ("slow_one or other", "-m gpu -k not (slow_one or other)")])
def test_racecheck_deselects_what_it_is_told(tmp_path, deselect, want):
    _, calls, _ = _run(tmp_path, SANITIZE="1", TESTS="0", BENCH="0", BUDGET_S="100",
                       RACECHECK_DESELECT=deselect)
    racecheck = next(c for c in calls if "--tool racecheck python3 -m pytest" in c)
    assert want in racecheck


@pytest.mark.parametrize(("env", "memcheck_s", "racecheck_s"), [
    ({}, 150, 240),                                   # what each took on the H200, and more
    ({"SANITIZE_TIMEOUT": "30"}, 30, 30),
    ({"SANITIZE_TIMEOUT": "30", "RACECHECK_TIMEOUT": "50"}, 30, 50)])
def test_the_sanitizer_phases_limits(tmp_path, env, memcheck_s, racecheck_s):
    phases, _, _ = _run(tmp_path, SANITIZE="1", TESTS="0", BENCH="0", BUDGET_S="2000", **env)
    assert _names(phases) == ["build", "sanitizer-probe", "memcheck", "racecheck"]
    assert f"(limit {memcheck_s} s)" in phases[2] and f"(limit {racecheck_s} s)" in phases[3]


def test_phases_the_budget_no_longer_fits_are_skipped(tmp_path):
    phases, calls, out = _run(tmp_path, SANITIZE="1", TESTS="0", DECODE_TIMEOUT="100",
                              DECODE_SLEEP="60", BUDGET_S="12", MIN_PHASE_S="5")
    assert _names(phases) == ["build", "decode-bench", "kernel-bench", "sanitizer-probe",
                              "memcheck", "racecheck"]
    assert "CUT by its time limit" in phases[1]  # cut by what was left, not by its 100 s
    assert all("skipped" in line for line in phases[2:]), phases
    assert not any("pagedkv.bench gpu" in c or "compute-sanitizer" in c for c in calls)
    assert "of a 12 s budget" in out


def test_the_fuzz_campaign_runs_beside_the_phases_and_ends_inside_the_budget(tmp_path):
    (tmp_path / "tree" / ".atheris").mkdir(parents=True)
    (tmp_path / "tree" / ".atheris" / "atheris-0-cp312-cp312-linux_x86_64.whl").touch()
    phases, calls, _ = _run(tmp_path, FUZZ="1", FUZZ_WORKERS="3", FUZZ_TARGETS="cold_index",
                            BENCH="0", BUDGET_S="100")
    assert _names(phases) == ["build", "ctypes-tests", "cpu-kernel-tests", "fuzz"]
    assert "rc 0" in phases[-1]
    campaign = [c for c in calls if "tests/fuzz/campaign.py" in c]
    assert len(campaign) == 1 and "--workers 3" in campaign[0] and "cold_index" in campaign[0]
    seconds = int(campaign[0].split("--seconds ")[1].split()[0])
    assert 0 < seconds <= 100 - 40  # cut from its 420 s default to what the budget leaves
    assert any("fuzzsite" in c and "atheris" in c for c in calls)


def test_the_mlx_wheel_pieces_of_two_calls_are_joined_and_installed(tmp_path):
    tree = tmp_path / "tree"
    (tree / ".mlx1").mkdir(parents=True)
    (tree / ".mlx1" / "mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl").write_bytes(b"m")
    (tree / ".mlx1" / "part.aa").write_bytes(b"first half ")
    # call 1 carries .mlx1 and runs no MLX phase: the pieces wait in the stash
    phases, calls, _ = _run(tmp_path, MLX="1", BENCH="0")
    assert _names(phases) == ["build", "ctypes-tests", "cpu-kernel-tests"]
    assert not any("mlxsite" in c for c in calls)
    stash = tmp_path / "stash"
    assert sorted(p.name for p in stash.iterdir()) == [
        "mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl", "part.aa"]
    # call 2 carries .mlx2 only (the machine kept the stash)
    shutil.rmtree(tree / ".mlx1")
    (tree / ".mlx2").mkdir()
    (tree / ".mlx2" / "part.ab").write_bytes(b"second half")
    phases, calls, _ = _run(tmp_path, MLX="1", MLX_ONLY="1")
    assert _names(phases) == ["build", "mlx-tests", "mlx-bench"]
    joined = stash / "mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
    assert joined.read_bytes() == b"first half second half"
    install = [c for c in calls if "mlxsite" in c and "pip install" in c]
    assert len(install) == 1 and str(joined) in install[0]


@pytest.mark.parametrize("smi,env,want", [
    (NVIDIA_SMI_H200, {}, "-Csetup-args=-Dnvidia_arches=sm_90"),  # the device's own arch
    (NVIDIA_SMI_H200, {"NVIDIA_ARCHES": "sm_80,sm_90"}, "-Csetup-args=-Dnvidia_arches=sm_80,sm_90"),
    (NVIDIA_SMI_H200, {"NVIDIA_ARCHES": "all"}, None),            # the project's list
    (LOGGING_STUB, {}, None),                                     # no capability reported
])
def test_the_build_compiles_the_devices_own_nvidia_arch(tmp_path, smi, env, want):
    _, calls, out = _run(tmp_path, nvidia_smi=smi, TESTS="0", BENCH="0", **env)
    wheel = [c for c in calls if "pip wheel" in c]
    assert len(wheel) == 1
    if want is None:
        assert "nvidia_arches" not in wheel[0] and "nvidia arches: meson default" in out
    else:
        assert want in wheel[0].split() and f"nvidia arches: {want}" in out


def test_a_tune_call_without_kernel_objects_builds_cython_only_and_runs_each_sweep(tmp_path):
    phases, calls, _ = _run(tmp_path, nvidia_smi=NVIDIA_SMI_H200, OBJECTS="0", SANITIZE="1",
                            TUNE="gemvx --set PKV_GEMV_X_ROW_TILES=1,2 --warps auto,4;"
                                 "attn --kv q8s", BUDGET_S="100")
    # the tests, benches and sanitizer need the objects: only the sweeps run
    assert _names(phases) == ["build", "OBJECTS=0", "tune-0", "tune-1"]
    wheel = next(c for c in calls if "pip wheel" in c).split()
    assert "-Csetup-args=-Dcuda=disabled" in wheel and "-Csetup-args=-Dhip=disabled" in wheel
    assert not any("nvidia_arches" in w for w in wheel)
    tune = [c for c in calls if "hip/tune.py" in c]
    assert tune == ["python3 hip/tune.py gemvx --set PKV_GEMV_X_ROW_TILES=1,2 --warps auto,4",
                    "python3 hip/tune.py attn --kv q8s"]
    assert not any("-m pytest" in c or "pagedkv.bench" in c or "compute-sanitizer" in c
                   for c in calls)


def test_a_build_without_kernel_objects_is_reused_only_by_calls_that_need_none(tmp_path):
    _run(tmp_path, OBJECTS="0", TUNE="gemvx", BUDGET_S="100")
    (tmp_path / "work" / "pkv" / "pagedkv").mkdir(parents=True)  # what pip installed there
    phases, _, _ = _run(tmp_path, OBJECTS="0", REUSE_BUILD="1", TUNE="gemvx", BUDGET_S="100")
    assert _names(phases) == ["build", "OBJECTS=0", "tune-0"]
    assert phases[0] == "phase build: reused the warm machine's build"
    # the tests would find no kernel: this call builds again (with them) instead
    phases, _, _ = _run(tmp_path, REUSE_BUILD="1", BENCH="0", BUDGET_S="100")
    assert phases[0] == "REUSE_BUILD=1: the warm build was OBJECTS=0 (no kernel objects): " \
                        "building again"
    assert _names(phases)[1:] == ["build", "ctypes-tests", "cpu-kernel-tests"]
    assert "reused" not in phases[1]
    assert not (tmp_path / "work" / "pkv" / ".no_kernel_objects").exists()


def test_tune_runs_after_the_gpu_tests_of_a_full_build(tmp_path):
    phases, calls, _ = _run(tmp_path, TUNE="gemvx", BENCH="0", BUDGET_S="100")
    assert _names(phases) == ["build", "ctypes-tests", "tune-0", "cpu-kernel-tests"]
    assert "rc 0" in phases[2] and any(c == "python3 hip/tune.py gemvx" for c in calls)
    # TUNE_TIMEOUT (240 s) is more than this budget leaves: the phase gets what is left
    assert "(limit 240 s)" not in phases[2]


@pytest.mark.parametrize(("compile_env", "flags"), [
    ({}, "--quick"), ({"DECODE_TORCH_COMPILE": "1"}, "--quick --torch-compile"),
    ({"DECODE_TORCH_COMPILE": "1", "DECODE_ARGS": ""}, "--torch-compile")])
def test_decode_torch_compile_adds_the_flag(tmp_path, compile_env, flags):
    """DECODE_TORCH_COMPILE=1 adds --torch-compile after DECODE_ARGS (default --quick)."""
    _, calls, _ = _run(tmp_path, SANITIZE="0", TESTS="0", KERNEL_BENCH="0", **compile_env)
    decode = [c for c in calls if "pagedkv.bench decode" in c]
    assert len(decode) == 1
    assert decode[0].endswith(f"--json {tmp_path / 'out'}/decode.json {flags}")


@pytest.mark.parametrize(("select", "want"), [
    ("", "-m gpu -p no:cacheprovider"), ("q8 or attention", "-p no:cacheprovider -k q8 or attention")])
def test_the_gpu_tests_run_what_gpu_tests_k_selects(tmp_path, select, want):
    """GPU_TESTS_K passes one -k expression (spaces and all) to the ctypes GPU tests."""
    _, calls, _ = _run(tmp_path, TESTS="1", BENCH="0", BUDGET_S="100", GPU_TESTS_K=select)
    gpu = [c for c in calls if "-m pytest -q -m gpu" in c]
    assert len(gpu) == 1 and gpu[0].endswith(want)
