"""The parity gate (docs/contracts/cold-tier.md, '2.3 Parity gate') on the reference model, in three
separate processes:
(a) persist on, run, drain; (b) a fresh process restores and runs; (c) persist off. (b) and
(c) must give identical greedy tokens and bit-identical logits; (b) must hit, uncorrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from cold_support import reference_session  # noqa: F401  (the children import it too)
from pagedkv.tiny_model import ReferenceModel

_CHILD = ("import json, sys; sys.path.insert(0, {tests!r}); "
          "from cold_support import reference_session; "
          "print(json.dumps(reference_session({root!r}, {model!r}, persist={persist}, "
          "prompt={prompt!r}, max_new=8)))")


def _run(tmp_path, persist: bool, prompt) -> dict:
    code = _CHILD.format(tests=os.path.dirname(__file__), root=str(tmp_path / "cold"),
                         model=str(tmp_path / "model"), persist=persist, prompt=prompt)
    env = dict(os.environ, PAGEDKV_METRICS="0")
    env.pop("PAGEDKV_PERSIST_PAGED_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restart_parity_across_three_processes(tmp_path):
    ReferenceModel().save(tmp_path / "model")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 500, 37)]
    a = _run(tmp_path, True, prompt)
    assert a["drained"] and a["enqueued"] > 0 and a["cached_tokens"] == 0
    b = _run(tmp_path, True, prompt)
    c = _run(tmp_path, False, prompt)
    assert b["hits"] > 0 and b["corruptions"] == 0 and b["misses"] == 0
    assert b["cached_tokens"] == 36 and b["restored_blocks"] == 9  # all full blocks of 36
    assert c["cached_tokens"] == 0
    assert b["tokens"] == c["tokens"] == a["tokens"]
    assert len(b["tokens"]) == len(c["tokens"]) == 8
    assert b["logits_sha256"] == c["logits_sha256"] == a["logits_sha256"]
