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
    rows = [ln for ln in lines if ln.startswith("| 32x512 |")]
    # a GEMV and a dequantize row per GEMV format, a dequantize row per dequantize-only one
    assert len(rows) == 2 * len(bench.GEMV_FORMATS) + len(bench.DEQUANT_ONLY_FORMATS)
    assert [r.split(" | ")[1] for r in rows[-len(bench.DEQUANT_ONLY_FORMATS):]] == [
        f"{fmt} dequantize" for fmt in bench.DEQUANT_ONLY_FORMATS]
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


def test_cold_cases_cycle_through_copies_of_the_same_weights(capsys, monkeypatch):
    bench = _bench()
    made = []

    class Fake:
        nbytes = 1000

        def __init__(self):
            made.append(self)
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return x

    monkeypatch.setattr(bench, "COLD_BYTES", 3500)
    gs = bench._copies(Fake, True)
    assert len(gs) == 4 and made == gs                  # ceil(3500 / 1000) copies
    assert len(bench._copies(Fake, False)) == 1         # hot: one
    call = bench._cycling(gs, "x")
    for _ in range(9):
        assert call() == "x"
    assert [g.calls for g in gs] == [3, 2, 2, 2]        # round-robin
    # the table script with --cold: a row per case, the same bits from every copy
    monkeypatch.setattr(bench, "COLD_BYTES", 64 << 10)
    bench.main(["--shape", "32x512", "--rounds", "1", "--budget-ms", "1", "--isa", "scalar",
                "--only", "b1", "--cold"])
    out = capsys.readouterr().out
    assert '"weights": "cold"' in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 32x512 |")]
    assert len(rows) == 2 * len(bench.GEMV_FORMATS)    # b1 and b1 threads=2
    import numpy as np

    import pagedkv.quant as Q
    w = bench._weights(32, 512)
    raw = Q.quantize(w, "mq4g256v2")
    gs = bench._copies(lambda: Q.prepare_gemv(raw, "mq4g256v2", (32, 512)), True)
    assert len(gs) > 1
    x = bench._weights(2, 512, seed=1)
    assert len({g(x).tobytes() for g in gs}) == 1
    assert np.array_equal(gs[0](x), gs[-1](x))


def test_asv_cold_suite_sets_up_and_runs(monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "COLD_BYTES", 20 << 20)  # 3 copies of 8.5 MiB, not 29
    suite = bench.PreparedGemvCold()
    suite.setup("hfq4g256")
    suite.time_call("hfq4g256")
