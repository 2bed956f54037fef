"""A real redis-server for the cold tier's fleet tests: started on a free loopback port with
its own temp directory, stopped (or SIGKILLed and restarted) by the test.

Without ``redis-server`` (or the ``redis`` client) the tests skip with the reason, except
under CI (``PAGEDKV_EXPECT_REDIS=1``, set by ``.ci/run``), where they fail instead: a lost
package must not silently turn the fleet tests off.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")


def require_redis() -> None:
    """Skip (or, under ``PAGEDKV_EXPECT_REDIS=1``, fail) when the server or client is absent."""
    missing = []
    if REDIS_SERVER is None:
        missing.append("redis-server is not installed (apt-get install -y redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("the redis client is not installed (pip install 'pagedkv[redis]')")
    if not missing:
        return
    reason = "; ".join(missing)
    if os.environ.get("PAGEDKV_EXPECT_REDIS") == "1":
        pytest.fail(f"PAGEDKV_EXPECT_REDIS=1 but {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process: AOF with ``appendfsync always`` (an acknowledged write
    survives a SIGKILL of the server), no RDB snapshots, loopback only."""

    def __init__(self, directory, *, password: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.directory = str(directory)
        self.port = free_port()
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.directory, "--appendonly", "yes", "--appendfsync", "always",
                "--save", "", "--daemonize", "no", "--logfile",
                os.path.join(self.directory, "redis.log"), *self.extra]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see "
                                   f"{self.directory}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer within 10 s")

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> RedisServer:
        """Start again on the same port and directory (the AOF is replayed)."""
        self.stop()
        return self.start()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh server for one test, stopped after it."""
    require_redis()
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(d).start()
    try:
        yield server
    finally:
        server.stop()
