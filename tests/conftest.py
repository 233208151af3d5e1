"""One Ray cluster per test session: raymesh starts its embedded local Ray on first use, and the
session ends it. Every test has a timeout (pytest-timeout, see pyproject).

`RAYMESH_RUNTIME=0`: the session, and every program its tests start, never attaches to a local
runtime a developer may have up (`raymesh up`); the runtime's own tests start theirs, each in a
directory of its own, and say which programs attach to it."""

from __future__ import annotations

import functools
import os

import pytest

os.environ["RAYMESH_RUNTIME"] = "0"


def warm_procs_import(modules: str):
    """A package's autouse fixture: warm procs started while its tests run import `modules`
    (`RAYMESH_PRELOAD`) rather than torch and what `raymesh.train` preloads (which the session
    imports at collection). A proc then starts on less CPU: 0.9 CPU-seconds with nothing, 1.7
    with torch, 2.5 with `raymesh.train`'s modules (bench/proc_start.py, 2 cores), and
    procs' starts are most of the suite's time. Warm procs already waiting are used first."""

    @pytest.fixture(scope="package", autouse=True)
    def _warm_procs_import():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAYMESH_PRELOAD", modules)
            yield

    return _warm_procs_import


@pytest.fixture(scope="session")
def ray_cluster():
    from raymesh._src import backend

    backend.ensure_ray()
    yield
    backend.shutdown()


@pytest.fixture(scope="package")
def fit(ray_cluster):
    """`train.fit`, with each job of the package in procs that earlier jobs of it trained in
    (`train.WarmRanks`): the guarantees hold in reused procs as in new ones (two runs with one
    seed are bitwise equal though the second runs where the first one did, a healed job ends
    with the weights of a clean run that ran elsewhere), and the package starts few procs
    (each costs 2 to 3 CPU-seconds to start, most of the suite's time on 2 cores)."""
    from raymesh import train

    with train.WarmRanks() as warm:
        yield functools.partial(train.fit, warm=warm)
