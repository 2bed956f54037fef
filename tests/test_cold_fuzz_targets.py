"""The cold-tier fuzz targets (tests/fuzz/fuzz_cold_*.py) on their seeds, their regression
inputs and a few hundred fixed pseudo-random inputs: each returns normally, and each
oracle fires on a planted bug (docs/reliability.md, "Cold tier")."""

from __future__ import annotations

import glob
import importlib.util
import os
import random

import pytest

FUZZ_DIR = os.path.join(os.path.dirname(__file__), "fuzz")
TARGETS = ["fuzz_cold_block", "fuzz_cold_sidecar", "fuzz_cold_index"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(FUZZ_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(name: str, n: int) -> list[bytes]:
    rng = random.Random(name)
    out = []
    for i in range(n):
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 96)))
        out.append(bytes([0x80 | i % 128]) + body if i % 4 else body)
    return out


@pytest.mark.parametrize("name", TARGETS)
def test_a_target_accepts_its_seeds_regressions_and_random_inputs(name):
    target = _load(name)
    seeds = list(target.seeds())
    assert seeds and all(isinstance(s, str) and isinstance(d, bytes) for s, d in seeds)
    for _, data in seeds:
        target.one_input(data)
    regressions = sorted(glob.glob(os.path.join(FUZZ_DIR, "regressions", name.removeprefix(
        "fuzz_"), "*.bin")))
    for path in regressions:
        with open(path, "rb") as f:
            target.one_input(f.read())
    for data in _inputs(name, 150 if name == "fuzz_cold_index" else 400):
        target.one_input(data)


def test_the_seeds_are_objects_pagedkv_accepts():
    """Raw-mode seeds hold valid objects: the fuzzer starts from what the writers write."""
    from pagedkv.cold.codec import decode_block, decode_sidecar
    block, sidecar = _load("fuzz_cold_block"), _load("fuzz_cold_sidecar")
    import cold_inputs
    raw = [d[1:] for n, d in block.seeds() if n.startswith("raw-")]
    assert len(raw) == len(cold_inputs.GEOMETRIES)
    for obj, g in zip(raw, cold_inputs.GEOMETRIES, strict=True):
        assert decode_block(obj, abi=cold_inputs.ABI, checksum_tag=cold_inputs.TAG).geometry == g
    for (n, d), layout in zip([s for s in sidecar.seeds() if s[0].startswith("raw-")],
                              cold_inputs.LAYOUTS, strict=True):
        fields, _ = decode_sidecar(d[1:], abi=cold_inputs.ABI, checksum_tag=cold_inputs.TAG,
                                   group=layout.group.label)
        assert layout.matches(fields)


def test_structured_inputs_reach_past_the_header(monkeypatch):
    """The structure-aware half of the input space must produce objects that parse far
    enough to fail late (metadata, tensors, checksum), not only at the length field."""
    from pagedkv.cold.codec import decode_block
    from pagedkv.errors import FormatError
    _load("fuzz_cold_block")
    import cold_inputs
    reasons = set()
    for data in _inputs("reach", 600):
        obj = cold_inputs.structured(data, [cold_inputs.block_object(g, 0)
                                            for g in cold_inputs.GEOMETRIES])
        try:
            decode_block(obj, abi=cold_inputs.ABI, checksum_tag=cold_inputs.TAG)
            reasons.add("accepted")
        except FormatError as exc:
            reasons.add(type(exc).__name__)
    assert {"accepted", "BadMetadata", "SizeMismatch", "Truncated"} <= reasons


def test_the_block_oracle_catches_a_laxer_verify_path(monkeypatch):
    """Planted bug: the verify path accepts any checksum. The differential oracle fires."""
    target = _load("fuzz_cold_block")
    monkeypatch.setattr(target, "_streamed_ok", lambda obj: True)
    with pytest.raises(AssertionError, match="disagree"):
        target.one_input(b"\0" + b"junk")


def test_the_index_oracle_catches_a_miscount(monkeypatch):
    """Planted bug: the index counts a byte more than it owns. The totals oracle fires."""
    from pagedkv.cold.index import ColdIndex
    target = _load("fuzz_cold_index")
    real = ColdIndex.rebuild

    def miscount(self, items):
        real(self, items)
        self.total_bytes += 1
    monkeypatch.setattr(ColdIndex, "rebuild", miscount)
    with pytest.raises(AssertionError, match="total_bytes"):
        target.one_input(bytes([1, 0, 0, 0, 0, 0, 0, 0]))


def test_running_a_target_leaves_the_cold_logger_as_it_was():
    import logging
    logger = logging.getLogger("pagedkv.cold")
    before = logger.level
    logger.setLevel(logging.NOTSET)
    try:
        _load("fuzz_cold_index").one_input(bytes([1, 0, 0, 0, 0, 0, 0, 0]))
        assert logger.level == logging.NOTSET  # later tests' caplog still sees warnings
    finally:
        logger.setLevel(before)
