"""Shared pytest setup.

Tests import the *installed* pagedkv (the source root is pkg/, never on sys.path),
so a module missing from meson.build fails here exactly as it would for a user.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI runs the differential and property tests with more examples than a local run.
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
