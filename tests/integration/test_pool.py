"""Warm procs: spawns adopt procs started ahead of time, and nothing else changes.

Every other integration test spawns from the pool too (it is on by default), so supervision,
ordering and stop() are tested on adopted procs there; these tests check the pool itself."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import ray

import raymesh
from raymesh import Actor, current_rank, endpoint, this_host
from raymesh._src.backend import current_node_id, pool

pytestmark = pytest.mark.usefixtures("ray_cluster", "_default_pool")


KEEP = 2  # warm procs this module's pool keeps: the most a test here takes at once


def _restart_pool(n: int) -> None:
    """End every warm proc and start `n` anew, importing what the pool imports now."""
    pool.drain()
    pool.fill({current_node_id(): n})


@pytest.fixture(scope="module")
def _default_pool():
    """A pool of this module's own, of KEEP warm procs importing the defaults (the package's
    conftest turns them off), started again as it was at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAYMESH_PRELOAD", raising=False)
        _restart_pool(KEEP)
        yield
    _restart_pool(pool.size())


class Probe(Actor):
    @endpoint
    def tensors_zero_copy(self) -> bool:
        """Imports torch, then says whether Ray sends this proc's tensors zero-copy."""
        import torch  # noqa: F401
        from ray._private import worker

        contexts = worker.global_worker.serialization_context_map.values()
        return bool(contexts) and all(c._zero_copy_tensors_enabled for c in contexts)

    @endpoint
    def facts(self) -> dict:
        return {
            "pid": os.getpid(),
            "torch_loaded": "torch" in sys.modules,  # nothing in this module imports torch
            "point": dict(current_rank()),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "modules": sorted(
                m for m in ("email.mime.text", "raymesh.train.rank.worker") if m in sys.modules
            ),
        }


def _warm_pids() -> set[int]:
    assert pool.wait_ready(120), "the warm procs did not start within 120 s"
    with pool._lock:
        infos = [w.info for w in pool._warm.get(current_node_id(), ())]
    return {info["pid"] for info in ray.get(infos, timeout=30)}


def test_a_spawn_adopts_warm_procs_with_torch_loaded_and_the_pool_refills():
    # The node keeps as many as the largest spawn asked for: the module's pool, KEEP.
    warm = _warm_pids()
    assert len(warm) == KEEP
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="adopted")
    try:
        facts = procs.spawn("p", Probe).facts.call().get(timeout=60)
        pids = {f["pid"] for f in facts.values()}
        assert pids == set(procs.pids) and pids <= warm
        assert all(f["torch_loaded"] for f in facts.values())
        assert [f["point"] for f in facts.values()] == [
            {"procs": 0},
            {"procs": 1},
        ]
        refilled = _warm_pids()
        assert len(refilled) == len(warm) and not refilled & pids
    finally:
        procs.stop()


def test_a_spawn_whose_warm_procs_died_waiting_starts_fresh_procs_in_their_place():
    # A proc whose worker dies before it runs (killed waiting here; a Ray worker can also die
    # as it registers with a loaded raylet) is no fault of the spawn: it is started again.
    dead = _warm_pids()
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="after-deaths")
    try:
        facts = procs.spawn("p", Probe).facts.call().get(timeout=60)
        assert {f["pid"] for f in facts.values()} == set(procs.pids)
        assert not set(procs.pids) & dead
    finally:
        procs.stop()


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="the driver sets OMP_NUM_THREADS")
def test_an_adopted_proc_gets_the_threads_ray_would_give_its_cpus():
    _warm_pids()
    procs = this_host().spawn_procs(per_host={"procs": 1}, cpus_per_proc=2)
    try:
        [facts] = procs.spawn("p", Probe).facts.call().get(timeout=60).values()
        assert facts["omp"] == "2"
    finally:
        procs.stop()


def test_with_the_pool_off_procs_start_cold_without_torch_and_get_zero_copy_once_they_use_it(
    monkeypatch,
):
    warm = _warm_pids()
    monkeypatch.setenv("RAYMESH_WARM_PROCS", "0")
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        probe = procs.spawn("p", Probe)
        [facts] = probe.facts.call().get(timeout=60).values()
        # A cold proc does not pay torch's import (most of its start) before it uses torch.
        assert facts["pid"] not in warm and not facts["torch_loaded"]
        assert probe.tensors_zero_copy.call_one().get(timeout=60)
    finally:
        procs.stop()
    monkeypatch.delenv("RAYMESH_WARM_PROCS")
    assert _warm_pids() == warm  # the pool was left as it was


@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_pool_size_names_the_variable_and_the_fix(monkeypatch, value):
    monkeypatch.setenv("RAYMESH_WARM_PROCS", value)
    with pytest.raises(ValueError, match=rf"RAYMESH_WARM_PROCS='{value}'.*int >= 0.*0 turns"):
        this_host().spawn_procs(per_host={"procs": 1})


def test_preloaded_modules_are_imported_by_warm_procs_started_after():
    import raymesh.train  # (it preloads what a training rank imports)

    raymesh.preload("email.mime.text")  # stdlib, imported by nothing else here
    try:
        _restart_pool(1)  # every warm proc starts after the preload
        _warm_pids()
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            [facts] = procs.spawn("p", Probe).facts.call().get(timeout=60).values()
            assert facts["modules"] == ["email.mime.text", "raymesh.train.rank.worker"]
        finally:
            procs.stop()
    finally:
        pool._imports.remove("email.mime.text")
        _restart_pool(KEEP)


@pytest.mark.parametrize("name", ["", "not a module", 3])
def test_preload_rejects_what_is_not_a_module_name(name):
    with pytest.raises(ValueError, match="dotted module names"):
        raymesh.preload(name)


def test_raymesh_preload_is_all_that_warm_procs_import_and_a_bad_one_is_refused(monkeypatch):
    import raymesh.train  # noqa: F401  (its preloads do not apply either)

    monkeypatch.setenv("RAYMESH_PRELOAD", " email.mime.text ,")
    _restart_pool(1)  # every warm proc starts after the setting
    _warm_pids()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        [facts] = procs.spawn("p", Probe).facts.call().get(timeout=60).values()
        assert facts["modules"] == ["email.mime.text"] and not facts["torch_loaded"]
    finally:
        procs.stop()
    monkeypatch.setenv("RAYMESH_PRELOAD", "torch,not a module")
    with pytest.raises(ValueError, match=r"RAYMESH_PRELOAD='torch,not a module'.*'not a module'"):
        this_host().spawn_procs(per_host={"procs": 1})
    monkeypatch.delenv("RAYMESH_PRELOAD")
    _restart_pool(KEEP)
