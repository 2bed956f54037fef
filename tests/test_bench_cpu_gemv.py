"""asv_bench/benchmarks/cpu_gemv.py runs: its table script (without the ggml worker), the
threads-scaling and the spin A/B modes print one row per case, on a small shape."""

from __future__ import annotations

from kernels_support import load_tree_script


def _bench():
    return load_tree_script("asv_bench/benchmarks/cpu_gemv.py", "pagedkv_asv_cpu_gemv")


def test_table_has_a_row_per_case(capsys, tmp_path):
    bench = _bench()
    out_json = tmp_path / "r.json"
    bench.main(["--shape", "32x512", "--rounds", "2", "--budget-ms", "1", "--isa", "scalar",
                "--json", str(out_json)])
    out = capsys.readouterr().out.splitlines()
    rows = [ln for ln in out if ln.startswith("| 32x512 |")]
    n = len(bench.GEMV_FORMATS)
    # per format: 4 batches, threads=2, gemv(), dequantize on 1 and 2 threads
    assert len(rows) == n * 8
    assert any("mq4g256v2 b8" in r for r in rows)
    scaling = [ln for ln in out if ln.startswith("# rows/s against b1, 32x512")]
    assert len(scaling) == n and all(ln.count("x") >= 4 for ln in scaling)    # B2, B4, B8
    import json
    data = json.loads(out_json.read_text())
    assert data["info"]["isa"] == "scalar" and len(data["rows"]) == n * 8
    assert all(len(r["rounds"]) == 2 for r in data["rows"])


def test_threads_scaling_rows(capsys):
    bench = _bench()
    bench.main(["--shape", "32x512", "--threads-scaling", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("| 32x512 |") for ln in lines) == 2 * len(bench.GEMV_FORMATS)
    assert lines[-1].startswith("# load average")


def test_spin_ab_rows_and_the_spin_is_restored(capsys):
    from pagedkv.quant import cpu_pool
    bench = _bench()
    before = cpu_pool.spin_us()
    cpu_pool.set_spin_us(37)
    try:
        bench.main(["--shape", "32x512", "--spin-ab", "4"])
        assert cpu_pool.spin_us() == 37
    finally:
        cpu_pool.set_spin_us(before)
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if ln.startswith("| 32x512 |")]
    assert len(rows) == len(bench.GEMV_FORMATS)
    assert all(r.count("x |") == 2 for r in rows)           # a speed-up per spin setting
    assert lines[-1].startswith("# load average")


def test_asv_suites_set_up_and_run():
    bench = _bench()
    suite = bench.PreparedGemv()
    suite.setup("q8f16", 2)
    suite.time_call("q8f16", 2)
    deq = bench.DequantizeThreads()
    deq.setup("mq4g256v2", 2)
    deq.time_dequantize("mq4g256v2", 2)


def test_baseline_cases_run_beside_and_must_give_the_same_bits(capsys):
    from pagedkv.quant import prepared_gemv
    bench = _bench()
    bench.main(["--shape", "32x512", "--rounds", "1", "--budget-ms", "1", "--isa", "scalar",
                "--only", "b1,b2,b4,b8", "--baseline", prepared_gemv.__file__])
    out = capsys.readouterr().out.splitlines()
    n = len(bench.GEMV_FORMATS)
    assert sum(ln.startswith("| 32x512 | baseline ") for ln in out) == n * 4
    assert sum(ln.startswith("# rows/s against b1, 32x512") and "(baseline)" in ln for ln in out) == n
