"""The weight-digest cache of a cold root (docs/contracts/cold-tier.md, '4.3 Weight identity'):
full-digest fallbacks read
every weight byte once per weight file, not once per load."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from pagedkv.atomic_write import AtomicFile
from pagedkv.cold.names import WEIGHT_DIGESTS_NAME

__all__ = ["WeightDigestCache"]

log = logging.getLogger("pagedkv.cold")
_MAX_CACHE_BYTES = 1 << 22


def _stat_key(st: os.stat_result) -> str:
    # ctime too: weights rewritten in place at the same size with mtime put back (`cp -p`,
    # `rsync --inplace -t`) keep the other four, and no call can set ctime back.
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class WeightDigestCache:
    """Shard digests keyed by the file's (device, inode, size, mtime_ns, ctime_ns); an entry
    is used only when all five match. Stored as ``weight-digests.json`` in the root, replaced
    atomically; never indexed, counted against the quota or evicted."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._lock = threading.Lock()
        self._entries: dict[str, str] = self._load()

    def __repr__(self) -> str:
        return f"WeightDigestCache(entries={len(self._entries)})"

    def _load(self) -> dict[str, str]:
        try:
            fd = os.open(WEIGHT_DIGESTS_NAME, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.root_fd)
        except OSError:
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                raw = json.loads(f.read(_MAX_CACHE_BYTES))
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)
                and len(v) == 64}

    def get(self, st: os.stat_result) -> bytes | None:
        v = self._entries.get(_stat_key(st))
        return bytes.fromhex(v) if v is not None else None

    def put(self, st: os.stat_result, digest: bytes) -> None:
        with self._lock:
            self._entries[_stat_key(st)] = digest.hex()
            data = json.dumps(self._entries, sort_keys=True).encode()
            tmp = f".{WEIGHT_DIGESTS_NAME}.{os.getpid()}.{time.time_ns()}"
            try:
                with AtomicFile(WEIGHT_DIGESTS_NAME, dir_fd=self.root_fd, temp_name=tmp,
                                mode=0o600) as file:
                    file.write(data)
            except OSError as exc:
                log.warning("cold tier: cannot update %s: %s", WEIGHT_DIGESTS_NAME, exc)
