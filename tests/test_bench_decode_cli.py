"""``python -m pagedkv.bench decode``'s host side without a device or PyTorch: the
``--torch-compile`` flag, and how a row and the targets print the compiled bf16 peer."""

from __future__ import annotations

import pytest

from pagedkv.bench import decode as bench

ROW = {"weights": "hfq4g256", "kv": "q8", "batch": 8, "context": 32768, "path": "gemv",
       "nodes": 322, "us": 2000.0, "tok_s": 4000.0, "bytes": 3 * 2**30, "floor_us": 1000.0,
       "of_floor": 0.5, "torch_us": 6000.0, "torch_tok_s": 1333.3, "speedup_vs_torch": 3.0}
COMPILED = {"torch_compiled_us": 5000.0, "torch_compiled_tok_s": 1600.0,
            "speedup_vs_torch_compiled": 2.5}
LINE = ("hfq4g256   kv q8       b8   ctx  32768 gemv          322 nodes      2000 us     4000 "
        "tok/s      3072 MiB floor     1000 us (50.0%) | torch      6000 us     1333 tok/s "
        "-> 3.00x")


def test_row_without_the_compiled_peer(capsys):
    bench._print_row(ROW)
    assert capsys.readouterr().out == LINE + "\n"


def test_row_with_the_compiled_peer(capsys):
    bench._print_row({**ROW, **COMPILED})
    assert capsys.readouterr().out == (LINE + " | compiled      5000 us     1600 tok/s "
                                       "-> 2.50x\n")


def test_targets_print_the_compiled_ratio_next_to_the_eager_one(capsys):
    bench.print_targets([ROW, {**ROW, **COMPILED, "speedup_vs_torch": 1.5}])
    assert capsys.readouterr().out == (
        "target hfq4g256 kv q8 b8 ctx 32768 (gemv): 3.00x torch bf16 (>= 1.6x) met\n"
        "target hfq4g256 kv q8 b8 ctx 32768 (gemv): 1.50x torch bf16 (>= 1.6x) MISSED; "
        "2.50x torch.compile bf16\n")


def test_torch_compile_flag_parses(monkeypatch):
    sessions = []
    monkeypatch.setattr(bench, "open_session",
                        lambda prog, *, no_torch: sessions.append(no_torch))
    assert bench.main(["--torch-compile", "--quick"]) == 1  # no session: returns 1
    assert sessions == [False]
    with pytest.raises(SystemExit) as exc:
        bench.main(["--torch-compiled"])
    assert exc.value.code == 2
