"""The integration tests' actors never use torch (those that send a tensor import it then), so
their warm procs import nothing while they wait (`RAYMESH_PRELOAD=`): a proc here then costs
about 0.9 CPU-seconds to start rather than 2.5 with torch and what `raymesh.train` preloads,
most of these tests' time on a 2-core machine. The warm procs already waiting when the package
starts are used first; `test_pool` checks the default imports in a pool of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def _warm_procs_import_nothing():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYMESH_PRELOAD", "")
        yield
