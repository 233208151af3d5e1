"""One Ray for the whole test session: a local runtime (`raymesh up`) in a directory of the
session's own, started before the first test (so no test can start another Ray first),
which this process and every raymesh program the tests start attach to (a
command run in a subprocess finds it as a user's would), so that none of them starts a Ray, a
host agent or cold procs of its own unless it tests exactly that (`RAYMESH_RUNTIME=0`). The
session ends it. Every test has a timeout (pytest-timeout, see pyproject)."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def ray_cluster():
    from raymesh import cluster
    from raymesh._src import backend

    folder = tempfile.mkdtemp(prefix="raymesh-tests-runtime-")  # mode 0700
    os.environ["RAYMESH_RUNTIME_DIR"] = folder
    os.environ.pop("RAYMESH_RUNTIME", None)
    up = cluster.up(preload=("raymesh.train",))
    try:
        backend.ensure_ray()
        assert backend.attached() == up.record, "the session did not attach to its runtime"
        yield
    finally:
        backend.shutdown()
        cluster.down()


@pytest.fixture(scope="module")
def fit(ray_cluster):
    """`train.fit`, with each job of the module in procs that earlier jobs of it trained in
    (`train.WarmRanks`): the guarantees hold in reused procs as in new ones (two runs with one
    seed are bitwise equal though the second runs where the first one did, a healed job ends
    with the weights of a clean run that ran elsewhere), and the module starts few procs."""
    from raymesh import train

    with train.WarmRanks() as warm:
        yield functools.partial(train.fit, warm=warm)
