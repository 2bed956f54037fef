"""The parity rule of the mlx-lm integration (pagedkv.integrations.mlx_lm.parity): byte
equality for same-call runs and on MLX's CPU backend, a logprob bound with near-tie token
flips on GPU backends. Each branch is exercised here by patching the backend check, so the file runs the same on
every backend."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from pagedkv.integrations.mlx_lm import parity
from pagedkv.integrations.mlx_lm.parity import LOGPROB_BOUND, compare


def _run(tokens, rows):
    return list(tokens), np.asarray(rows, np.float32).tobytes()


REF = _run([2, 0], [[-3.0, -2.0, -1.0, -4.0], [-0.5, -2.0, -3.0, -0.6]])


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(parity, "exact_backend", lambda: False)


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(parity, "exact_backend", lambda: True)


def test_cpu_and_same_calls_require_bytes(cpu):
    assert compare(REF, REF, dtype="float32", same_calls=False).same
    nudged = _run([2, 0], [[-3.0, -2.0, np.nextafter(np.float32(-1), np.float32(0)), -4.0],
                           [-0.5, -2.0, -3.0, -0.6]])
    p = compare(nudged, REF, dtype="float32", same_calls=False)
    assert (p.same, p.exact, p.why) == (False, True, "bytes differ")
    assert p.max_abs_diff == pytest.approx(2.0 ** -24)


def test_gpu_same_calls_still_require_bytes(gpu):
    nudged = _run([2, 0], [[-3.0, -2.0, -1.0 + 1e-6, -4.0], [-0.5, -2.0, -3.0, -0.6]])
    assert not compare(nudged, REF, dtype="float32", same_calls=True).same
    assert compare(nudged, REF, dtype="float32", same_calls=False).same


def test_gpu_bound_is_per_dtype_and_names_the_step(gpu):
    b = LOGPROB_BOUND["float32"]
    within = _run([2, 0], [[-3.0, -2.0, -1.0, -4.0], [-0.5 + b / 2, -2.0, -3.0, -0.6]])
    p = compare(within, REF, dtype="float32", same_calls=False)
    assert (p.same, p.exact, p.steps) == (True, False, 2)
    assert p.max_abs_diff == pytest.approx(b / 2, rel=1e-3)
    beyond = _run([2, 0], [[-3.0, -2.0, -1.0, -4.0], [-0.5 + 4 * b, -2.0, -3.0, -0.6]])
    p = compare(beyond, REF, dtype="float32", same_calls=False)
    assert not p.same and p.steps == 2 and p.why.startswith("step 1: |logprob difference|")
    assert compare(beyond, REF, dtype="bfloat16", same_calls=False).same


def test_gpu_token_flip_only_at_a_near_tie(gpu):
    # step 1's reference: tokens 0 and 3 are 0.1 apart; bfloat16's bound (0.5) makes it a tie
    flipped = _run([2, 3], [[-3.0, -2.0, -1.0, -4.0], [-0.5, -2.0, -3.0, -0.6]])
    p = compare(flipped, REF, dtype="bfloat16", same_calls=False)
    assert (p.same, p.steps) == (True, 2)
    p = compare(flipped, REF, dtype="float32", same_calls=False)  # 0.1 > 2 x 1e-3: no tie
    assert not p.same and "not a near-tie" in p.why
    early = _run([0, 0], [[-3.0, -2.0, -1.0, -4.0], [-0.5, -2.0, -3.0, -0.6]])
    assert not compare(early, REF, dtype="bfloat16", same_calls=False).same  # 2.0 apart


def test_nan_and_shape_mismatches_fail(gpu):
    nan = _run([2, 0], [[-3.0, -2.0, np.nan, -4.0], [-0.5, -2.0, -3.0, -0.6]])
    assert not compare(nan, REF, dtype="bfloat16", same_calls=False).same
    short = _run([2], [[-3.0, -2.0, -1.0, -4.0]])
    p = compare(short, REF, dtype="float32", same_calls=False)
    assert (p.same, p.steps) == (False, 0) and "1 steps" in p.why
