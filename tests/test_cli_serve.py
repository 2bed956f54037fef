"""`pagedkv serve` refuses a --model it cannot load in one line, before serving anything.

mlx-lm loads the model in its generation thread once the HTTP server is up, so a mistyped
path printed a traceback and left a server whose every request failed, running until killed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")

from test_serve_mlx_lm import _free_port  # after the skips


def _serve_fails(model: str) -> str:
    argv = [sys.executable, "-m", "pagedkv", "serve", "--model", model,
            "--port", str(_free_port())]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"pagedkv serve kept running with --model {model!r}:\n"
                             f"{err[-2000:]}") from None
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedkv serve: error: --model "), err
    return lines[0]


def test_serve_refuses_a_directory_that_is_not_a_model(tmp_path):
    line = _serve_fails(str(tmp_path))
    assert f"--model {str(tmp_path)!r} cannot be loaded as an mlx-lm model" in line
    assert "config.json" in line


def test_serve_refuses_a_missing_path(tmp_path):
    # Not a directory and not a valid repo id (a relative path), so no network is tried.
    line = _serve_fails("./no/such/model")
    assert "is not a path here and could not be fetched as a Hugging Face repo id" in line
    assert "pass an mlx-lm model directory" in line


def test_serve_refuses_a_cold_dir_that_cannot_hold_the_tier_before_listening(
        tmp_path, monkeypatch, capsys):
    # The paged cache (and its cold tier) was built by the first request: a --cold-dir that
    # is a file started the server, then that request ended mlx-lm's generation thread with a
    # traceback and every later request failed ("generation thread died").
    from mlx_lm import server as mlx_server

    from pagedkv.cli import main as cli_main
    from pagedkv.integrations.mlx_lm.random_models import save_random_model

    def listen(*args, **kwargs):
        raise AssertionError("the server listened with an unusable --cold-dir")

    monkeypatch.setattr(mlx_server, "_run_http_server", listen)
    model = tmp_path / "model"
    save_random_model(str(model), "qwen3", seed=0)
    blocker = tmp_path / "cold"
    blocker.write_text("")
    assert cli_main(["serve", "--model", str(model), "--cold-dir", str(blocker),
                     "--port", str(_free_port())]) == 1
    assert capsys.readouterr().err == (
        f"pagedkv serve: error: --cold-dir {str(blocker)!r} cannot hold the cold tier: File "
        f"exists ({str(blocker)!r}); pass --cold-dir a directory you can write, or run "
        "without it\n")
    assert blocker.read_text() == ""
