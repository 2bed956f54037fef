"""The hybrid reference model through the cold tier in separate processes (the parity gate
of its family, docs/cold.md, "Family profiles and sidecars"): (a) persist on, serve, drain;
(b) a fresh process restores the prefix *with* its GDN and sliding sidecars and continues;
(c) persist off. (b) and (c) give the same tokens and bit-identical logits. A deleted or
corrupt sidecar is a counted miss: the next process recomputes, never K/V without state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hybrid_cold_support import hybrid_session  # noqa: F401  (the children import it)
from pagedkv.tiny_model import HybridConfig, ReferenceModel

_CHILD = ("import json, sys; sys.path.insert(0, {tests!r}); "
          "from hybrid_cold_support import hybrid_session; "
          "print(json.dumps(hybrid_session({base!r}, {model!r}, persist={persist}, "
          "prompts={prompts!r})))")

PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 500, 45)]


def _run(tmp_path, persist: bool, prompts=(PROMPT,)) -> dict:
    code = _CHILD.format(tests=os.path.dirname(__file__), base=str(tmp_path / "cold"),
                         model=str(tmp_path / "model"), persist=persist,
                         prompts=[list(p) for p in prompts])
    env = dict(os.environ, PAGEDKV_METRICS="0")
    env.pop("PAGEDKV_PERSIST_PAGED_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def persisted(tmp_path):
    ReferenceModel(HybridConfig(seed=3)).save(tmp_path / "model")
    a = _run(tmp_path, True)
    # 45 tokens + 3 fed back, bs 8: the ladder publishes 8 and 40; the capture persists the
    # 6 full K/V blocks and one sidecar per part (GDN, sliding) at the deepest state, 40.
    assert a["persisting"] and a["drained"] and a["cached_tokens"] == 0
    assert a["enqueued"] == 6 + 2 and a["sidecars_enqueued"] == 2
    return tmp_path, a


def _sidecar_files(tmp_path, label):
    root = tmp_path / "cold" / "pagedkv-v1"
    return sorted(p for p in root.iterdir() if p.name.endswith(f".{label}.safetensors"))


def test_restart_parity_with_sidecars_across_processes(persisted):
    tmp_path, a = persisted
    b = _run(tmp_path, True)
    c = _run(tmp_path, False)
    assert b["cached_tokens"] == 40 and b["cold_state_restores"] == 1
    assert b["hits"] == 5 and b["misses"] == 0 and b["corruptions"] == 0
    assert b["sidecars_installed"] == 1            # the sliding rows went into the group
    assert not c["persisting"] and c["cached_tokens"] == 0
    assert a["tokens"] == b["tokens"] == c["tokens"]
    assert a["logits_sha256"] == b["logits_sha256"] == c["logits_sha256"]


@pytest.mark.parametrize("label", ["gdn_state", "sliding_window"])
def test_a_deleted_sidecar_part_means_recompute(persisted, label):
    tmp_path, a = persisted
    [victim] = _sidecar_files(tmp_path, label)
    os.unlink(victim)
    b = _run(tmp_path, True)
    assert b["cached_tokens"] == 0 and b["cold_state_restores"] == 0 and b["hits"] == 0
    assert b["restore_declines"] == 1               # the walk found no backed boundary
    assert b["tokens"] == a["tokens"] and b["logits_sha256"] == a["logits_sha256"]


def test_a_corrupt_sidecar_is_a_counted_miss_and_recompute(persisted):
    tmp_path, a = persisted
    [victim] = _sidecar_files(tmp_path, "gdn_state")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    b = _run(tmp_path, True)
    assert b["cached_tokens"] == 0 and b["hits"] == 0
    assert b["misses"] == 1 and b["corruptions"] == 1   # pruned, then written anew ...
    assert b["tokens"] == a["tokens"] and b["logits_sha256"] == a["logits_sha256"]
    # ... by the recomputing process's capture: the next process restores.
    c = _run(tmp_path, True)
    assert c["cached_tokens"] == 40 and c["cold_state_restores"] == 1
    assert c["logits_sha256"] == a["logits_sha256"]
