"""One Ray cluster per test session: raymesh starts its embedded local Ray on first use, and the
session ends it. Every test has a timeout (pytest-timeout, see pyproject)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    from raymesh._src import backend

    backend.ensure_ray()
    yield
    backend.shutdown()
