"""``pagedkv serve`` end to end: real HTTP requests to mlx-lm's own server with pagedkv as its
prompt cache, answered exactly as mlx-lm's server with its ``LRUPromptCache`` answers them,
sharing prefix blocks, and restoring them from the cold tier after a restart.

The model directory (random qwen3 weights, a word-level tokenizer) is written by the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], log_path) -> None:
        self.port = _free_port()
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"server not ready:\n{self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:]

    def complete(self, prompt: str, **extra) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0.0, **extra})
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                         data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            out = json.loads(r.read())
        return {"text": out["choices"][0]["text"],
                "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pagedkv.integrations.mlx_lm.random_models import save_random_model
    path = tmp_path_factory.mktemp("served") / "model"
    save_random_model(str(path), "qwen3", seed=0)
    return str(path)


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_pagedkv_serve_answers_like_mlx_lm_and_shares_prefixes(model_dir, tmp_path):
    cold = tmp_path / "cold"
    paged_argv = [sys.executable, "-m", "pagedkv", "serve", "--model", model_dir,
                  "--block-size", "8", "--cold-dir", str(cold)]
    env_note = os.environ.get("PAGEDKV_PERSIST_PAGED_CACHE")
    assert env_note in (None, "1", "true"), "the restart half needs persistence on"
    servers = [Server(paged_argv, tmp_path / "paged.log"),
               Server([sys.executable, "-m", "mlx_lm", "server", "--model", model_dir],
                      tmp_path / "mlx_lm.log")]
    try:
        for s in servers:
            s.wait_ready()
        paged, ref = servers
        system = words(range(10, 50))  # 40 tokens shared by every conversation
        p1 = f"{system} {words([60, 61, 62])}"
        r1 = paged.complete(p1)
        assert r1 == {"text": ref.complete(p1)["text"], "cached": 0}
        p2 = f"{system} {words([70, 71])}"
        r2 = paged.complete(p2)
        assert r2["text"] == ref.complete(p2)["text"] and r2["cached"] >= 40
        # The next turn of conversation 1 continues a parked table exactly: at least the one
        # mlx-lm's batching published at the end of its prompt segment (p1 minus its last
        # token; the finished one also holds an <eos> this prompt does not repeat).
        p3 = f"{p1} {r1['text']} {words([80, 81, 82])}"
        r3 = paged.complete(p3)
        assert r3["text"] == ref.complete(p3)["text"] and r3["cached"] >= 42
        # A seeded request takes mlx-lm's single-request path (not batched).
        r4 = paged.complete(p2, seed=7)
        assert r4["text"] == r2["text"] and r4["cached"] >= 40
        log = (tmp_path / "paged.log").read_text()
        assert "pagedkv prompt cache for" in log and "pagedkv: published" in log
        assert "could not publish" not in log
        assert paged.stop() == 0

        # A restart with the same --cold-dir restores the system prompt from disk.
        restarted = Server(paged_argv, tmp_path / "paged2.log")
        servers.append(restarted)
        restarted.wait_ready()
        p5 = f"{system} {words([90, 91, 92, 93])}"
        r5 = restarted.complete(p5)
        assert r5["text"] == ref.complete(p5)["text"] and r5["cached"] >= 40
    finally:
        for s in servers:
            s.stop()


def test_pagedkv_serve_learns_sliding_window_prompts_batched_and_conversations_unbatched(
        tmp_path):
    """A sliding-window model (gemma3_text, window 8). Batched (mlx-lm's default) the cache
    learns each prompt, from the batch's cache at the end of the prompt segment, but not a
    finished conversation: that batched cache holds the last window only, which insert
    refuses (logged). With --unbatched-sliding mlx-lm's single-request path runs on the
    paged request itself, so the next turn continues the whole conversation."""
    from pagedkv.integrations.mlx_lm.random_models import save_random_model

    path = str(tmp_path / "gemma")
    save_random_model(path, "gemma3_text", seed=0)
    argv = [sys.executable, "-m", "pagedkv", "serve", "--model", path, "--block-size", "8"]
    servers = [Server(argv, tmp_path / "batched.log"),
               Server([*argv, "--unbatched-sliding"], tmp_path / "single.log")]
    try:
        for s in servers:
            s.wait_ready()
        system = words(range(10, 50))  # 40 tokens: five windows
        p1, p2 = f"{system} {words([60, 61, 62])}", f"{system} {words([70, 71])}"
        r1 = [s.complete(p1) for s in servers]
        assert r1[0]["cached"] == r1[1]["cached"] == 0
        r2 = [s.complete(p2) for s in servers]
        assert r2[0]["text"] == r2[1]["text"]
        assert r2[0]["cached"] >= 40 and r2[1]["cached"] >= 40  # the system prompt
        # The next turn of conversation 1: batched, the cache holds p1's prompt (block
        # aligned) only; unbatched, p1 and its reply.
        n1 = len(p1.split())
        r3 = [s.complete(f"{p1} {r1[0]['text']} {words([80, 81])}") for s in servers]
        assert r3[0]["text"] == r3[1]["text"]
        assert r3[0]["cached"] <= n1 < r3[1]["cached"]
        batched_log = (tmp_path / "batched.log").read_text()
        single_log = (tmp_path / "single.log").read_text()
        assert "pagedkv: published" in batched_log and "could not publish" in batched_log
        assert "serving it on mlx-lm's single-request path" in single_log
        assert "could not publish" not in single_log
    finally:
        for s in servers:
            s.stop()


def test_pagedkv_serve_answers_a_prompt_longer_than_the_pool(model_dir, tmp_path):
    """--max-blocks 4 (64 tokens): a 100-token prompt cannot be served from the pool, so
    mlx-lm computes it with its own cache, and the server goes on answering (the paged
    cache's CapacityExceeded used to end mlx-lm's generation thread: 404 from then on)."""
    server = Server([sys.executable, "-m", "pagedkv", "serve", "--model", model_dir,
                     "--max-blocks", "4"], tmp_path / "paged.log")
    try:
        server.wait_ready()
        assert server.complete(words(i % 200 for i in range(100)))["cached"] == 0
        short = words([1, 2, 3, 4])
        first = server.complete(short)
        assert first["cached"] == 0 and server.complete(short) == {"text": first["text"],
                                                                     "cached": 3}
        assert server.stop() == 0
        log = server.log_path.read_text()
        assert "cannot serve a 100-token prompt from the paged cache" in log
        assert "generation thread died" not in log
    finally:
        server.stop()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
def test_await_thread_teardown_waits_for_the_joined_os_thread_and_not_for_a_live_one():
    """The SIGTERM abort this guards against (a joined generation thread's MLX teardown
    racing the interpreter's exit: docs/integrations/mlx-lm.md, "Stopping the server") needs
    load to show; here the helper's contract: True only once the OS thread is gone, False
    at once for a thread still running."""
    import threading

    from pagedkv.integrations.mlx_lm.server import await_thread_teardown

    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    assert await_thread_teardown(done, timeout_s=10.0) is True
    assert not os.path.exists(f"/proc/self/task/{done.native_id}")

    release = threading.Event()
    live = threading.Thread(target=release.wait)
    live.start()
    try:
        t0 = time.monotonic()
        assert await_thread_teardown(live, timeout_s=10.0) is False
        assert time.monotonic() - t0 < 1.0
        assert os.path.exists(f"/proc/self/task/{live.native_id}")
    finally:
        release.set()
        live.join()
