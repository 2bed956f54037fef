"""Shared pytest setup.

Tests import the *installed* pagedkv (the source root is pkg/, never on sys.path),
so a module missing from meson.build fails here exactly as it would for a user.
"""

from __future__ import annotations

import os

# MLX's CUDA backend runs float32 matmuls in TF32 by default (10-bit mantissa): the array-ops
# path's results then differ from the float64 references by ~1e-3 relative, beyond the
# float32 tolerances the tests assert. The tests check float32 arithmetic; a user chooses
# with the same variable (docs/kernels.md, "MLX dispatch"). Set before mlx is imported.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from hypothesis import HealthCheck, settings

# CI runs the differential and property tests with more examples than a local run.
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


import pytest

# The GPU `device` fixture (skipped without a GPU), the cold tier's `redis_server` (a real
# redis-server per test, tests/redis_support.py), and the kernel compiles started ahead on
# the spare core (`compiled_ahead`, tests/compile_ahead.py), for every test module.
pytest_plugins = ["kernels_support", "redis_support", "compile_ahead"]


@pytest.fixture(autouse=True)
def _demo_cold_dir_in_tmp(tmp_path_factory, monkeypatch):
    """`pagedkv demo` keeps a cold tier in ./.pagedkv-demo by default; a test that runs the
    demo in-process must never leave one in the working directory (the repository)."""
    from pagedkv.cli import demo_restart
    monkeypatch.setattr(demo_restart, "DEFAULT_COLD_DIR",
                        str(tmp_path_factory.mktemp("demo-cold") / ".pagedkv-demo"))
