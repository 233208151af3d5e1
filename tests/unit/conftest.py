"""Unit tests are pure Python: none may start Ray (they run beside the session's cluster in a
full run, so a test is checked against itself: Ray down before it, still down after)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ray_started():
    import ray

    before = ray.is_initialized()
    yield
    assert before or not ray.is_initialized(), "a unit test started Ray: move it to integration"
