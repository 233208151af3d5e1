"""Supervision on real processes: SIGKILL, os._exit, owners' __supervise__, stop(), orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import raymesh
from raymesh import MeshFailure, SupervisionError, this_host

from ..waiting import alive, wait_for
from .actors import Counter, FailsToStart, Parent

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture
def hook_calls():
    calls: list[MeshFailure] = []
    previous = raymesh.unhandled_fault_hook  # the hook in force, put back after
    raymesh.unhandled_fault_hook = calls.append
    yield calls
    raymesh.unhandled_fault_hook = previous


def test_sigkill_of_a_proc_fails_pending_and_later_calls_with_the_rank_and_signal(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="victims")
    counters = procs.spawn("c", Counter)
    pending = counters.slice(procs=1).slow.call_one(30.0)
    victim = procs.pids[1]
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(SupervisionError) as info:
        pending.get(timeout=20)
    elapsed = time.monotonic() - started
    failure = info.value.failure
    # Milliseconds in fact (bench/messaging.py --sigkill measures it); 2 s allows a loaded machine.
    assert elapsed < 2.0, f"took {elapsed:.1f}s to surface"
    assert failure.mesh_name == "victims"
    assert failure.ranks == (1,)
    assert failure.kind == "proc_died"
    assert failure.signal == signal.SIGKILL and failure.signal_name == "SIGKILL"
    assert "SIGKILL" in str(info.value)
    # later calls that include the dead rank fail at once, without being sent
    with pytest.raises(SupervisionError, match="SIGKILL"):
        counters.incr.call().get(timeout=5)
    # the survivor keeps serving calls addressed to it alone
    assert counters.slice(procs=0).incr.call_one().get(timeout=10) == 1
    # the controller's fault hook saw it
    seen = wait_for(lambda: hook_calls, 10.0)
    assert seen[0].ranks == (1,) and seen[0].signal == signal.SIGKILL
    procs.stop()


def test_an_idle_mesh_still_reports_a_death_to_the_hook(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="idle")
    procs.spawn("c", Counter)
    os.kill(procs.pids[0], signal.SIGKILL)
    failure = wait_for(lambda: hook_calls, 5.0)[0]
    assert failure.mesh_name == "idle" and failure.signal == signal.SIGKILL
    # Monarch's report names an actor that ran on the dead proc, and how the proc ended
    assert failure.report().splitlines()[:2] == [
        "The actor <tests.integration.actors.Counter c{'procs': 0/1}> and all its "
        "descendants have failed:",
        "  the process this actor was running on failed: Killed(sig=9)",
    ]
    procs.stop()


def test_os_exit_reports_the_exit_code(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="exiter")
    counter = procs.spawn("c", Counter)
    with pytest.raises(SupervisionError) as info:
        counter.die.call_one("3").get(timeout=20)
    assert info.value.failure.exit_code == 3
    assert "exited with code 3" in str(info.value)
    procs.stop()


def test_broadcast_exception_reaches_supervision(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="bcast")
    counters = procs.spawn("bc", Counter)
    counters.fail.broadcast("lost")
    failures = wait_for(lambda: len(hook_calls) >= 2 and hook_calls, 10.0)
    assert {f.kind for f in failures} == {"endpoint_error"}
    assert sorted(r for f in failures for r in f.ranks) == [0, 1]
    assert {f.actor for f in failures} == {
        f"<tests.integration.actors.Counter bc{{'procs': {r}/2}}>" for r in (0, 1)
    }
    assert "lost" in failures[0].cause
    # unhandled at the controller: the error stays on the actor mesh
    with pytest.raises(SupervisionError, match="lost"):
        counters.incr.call().get(timeout=10)
    procs.stop()


def test_owner_actor_gets_supervise_for_its_child_mesh_and_the_controller_hears_nothing(
    hook_calls,
):
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="owner")
    parent = owner_procs.spawn("parent", Parent, True)
    child_pids = parent.spawn_children.call_one(2).get(timeout=60)
    assert parent.call_children.call_one().get(timeout=30) == [101, 101]
    os.kill(child_pids[0], signal.SIGKILL)
    seen = wait_for(lambda: parent.seen.call_one().get(timeout=10), 10.0)
    assert seen[0].mesh_name == "children"
    assert seen[0].ranks == (0,) and seen[0].signal == signal.SIGKILL
    # handled by the owner (its __supervise__ returned True): nothing goes up to the
    # controller. Unhandled, the owner's proc would report child_failed at once, and the
    # controller's watcher picks it up within its 0.2 s poll: give it a second.
    time.sleep(1.0)
    assert hook_calls == []
    assert owner_procs.failure is None
    assert parent.seen.call_one().get(timeout=10) == seen  # and the owner keeps serving
    owner_procs.stop()


def test_unhandled_child_failure_goes_up_to_the_controller(hook_calls):
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="careless")
    parent = owner_procs.spawn("parent", Parent, False)
    child_pids = parent.spawn_children.call_one(1).get(timeout=60)
    os.kill(child_pids[0], signal.SIGKILL)
    failure = wait_for(lambda: hook_calls, 10.0)[0]
    assert failure.kind == "child_failed"
    assert failure.mesh_name == "parent"
    assert failure.child is not None and failure.child.signal == signal.SIGKILL
    assert failure.actor == "<tests.integration.actors.Parent parent{'procs': 0/1}>"
    report = failure.report()  # where it started (the child's actor), then the whole chain
    assert report.startswith(
        "The actor <tests.integration.actors.Counter kids{'procs': 0/1}> and all its descendants"
    )
    assert "  child_failed: mesh 'parent'" in report and "    proc_died: mesh " in report
    owner_procs.stop()


def test_a_constructor_that_raises_returns_the_mesh_and_each_rank_reaches_the_hook(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="bad-start")
    broken = procs.spawn("broken", FailsToStart, "no config")  # returns, as in Monarch
    failures = wait_for(lambda: len(hook_calls) >= 2 and hook_calls, 10.0)
    assert sorted(f.ranks for f in failures) == [(0,), (1,)]
    for f in failures:
        assert f.kind == "init_error" and f.mesh_name == "broken"
        assert "FailsToStart.__init__ raised RuntimeError: cannot start: no config" in f.cause
    with pytest.raises(SupervisionError, match="cannot start: no config"):
        broken.ping.call().get(timeout=10)
    assert procs.spawn("fine", Counter, 1).incr.call(1).get(timeout=30).values() == [2, 2]
    procs.stop()


def test_an_owner_actor_gets_supervise_for_a_child_whose_constructor_raised():
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="starter")
    parent = owner_procs.spawn("parent", Parent, True)
    parent.spawn_broken_children.call_one().get(timeout=60)
    [failure] = wait_for(lambda: parent.seen.call_one().get(timeout=10), 10.0)
    assert failure.kind == "init_error" and "cannot start" in failure.cause
    owner_procs.stop()


def test_a_mesh_that_does_not_escalate_records_a_death_but_never_calls_the_hook(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="healer", escalate=False)
    counter = procs.spawn("c", Counter)
    assert counter.incr.call_one().get(timeout=10) == 1
    assert procs.failure is None
    os.kill(procs.pids[0], signal.SIGKILL)
    failure = wait_for(lambda: procs.failure, 5.0)
    assert isinstance(failure, MeshFailure)
    assert failure.mesh_name == "healer" and failure.ranks == (0,)
    assert failure.kind == "proc_died" and failure.signal == signal.SIGKILL
    with pytest.raises(SupervisionError, match="SIGKILL"):
        counter.incr.call_one().get(timeout=5)
    # the hook runs on a thread started right after the failure is recorded: give it time
    time.sleep(0.5)
    assert hook_calls == []
    procs.stop()


def test_failure_is_none_on_a_live_mesh_and_names_the_dead_proc_in_each_view(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="views", escalate=False)
    procs.spawn("c", Counter)
    assert procs.failure is None
    assert procs.slice(procs=0).failure is None and procs.slice(procs=1).failure is None
    os.kill(procs.pids[1], signal.SIGKILL)
    failure = wait_for(lambda: procs.failure, 5.0)
    assert failure.ranks == (1,) and failure.signal == signal.SIGKILL
    assert procs.slice(procs=1).failure == failure
    assert procs.slice(procs=0).failure is None  # calls to the survivor still go through
    procs.stop()
    stopped = procs.failure
    assert stopped is not None and stopped.kind == "stopped"
    assert hook_calls == []


def test_an_owner_actor_that_does_not_escalate_gets_no_supervise_but_sees_the_failure(
    hook_calls,
):
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="quiet-owner")
    parent = owner_procs.spawn("parent", Parent, True)
    child_pids = parent.spawn_children.call_one(1, escalate=False).get(timeout=60)
    assert parent.children_failure.call_one().get(timeout=10) is None
    os.kill(child_pids[0], signal.SIGKILL)
    failure = wait_for(lambda: parent.children_failure.call_one().get(timeout=10), 10.0)
    assert failure.mesh_name == "children" and failure.signal == signal.SIGKILL
    time.sleep(0.5)
    assert parent.seen.call_one().get(timeout=10) == []
    assert hook_calls == []
    owner_procs.stop()


def test_this_proc_inside_an_actor_hosts_a_helper_in_the_same_process():
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="hosting")
    parent = procs.spawn("parent", Parent, True)
    assert parent.local_helper.call_one().get(timeout=30) == 8
    actor_pid, helper_pid = parent.local_helper_pids.call_one().get(timeout=30)
    assert helper_pid == actor_pid == procs.pids[0]
    assert actor_pid != os.getpid()  # not the controller's
    procs.stop()


def test_stop_leaves_no_processes():
    procs = this_host().spawn_procs(per_host={"procs": 3}, name="stopper")
    procs.spawn("c", Counter)
    pids = procs.pids
    assert all(alive(p) for p in pids)
    procs.stop()
    assert not any(alive(p) for p in pids)


def test_nested_meshes_stop_with_their_owner():
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="nest")
    parent = owner_procs.spawn("parent", Parent, True)
    child_pids = parent.spawn_children.call_one(2).get(timeout=60)
    owner_procs.stop()
    wait_for(lambda: not any(alive(p) for p in child_pids), 15)


def test_a_gpus_axis_on_hosts_without_gpus_gives_cpu_procs_as_in_monarch():
    assert this_host().gpus == 0  # this test machine has none
    procs = this_host().spawn_procs(per_host={"gpus": 2}, timeout=30)
    counters = procs.spawn("on_cpu", Counter, 1)
    assert counters.incr.call(1).get(timeout=30).values() == [2, 2]
    assert counters.slice(gpus=1).incr.call_one(1).get(timeout=30) == 3
    procs.stop()


def test_asking_for_more_cpus_than_the_host_has_says_what_it_has():
    with pytest.raises(raymesh.PlacementError, match=r"needs 100000 CPU .* which has \d+ CPU"):
        this_host().spawn_procs(per_host={"procs": 100000}, timeout=5)
    # What the host could hold at all bounds what is free now.
    host = this_host()
    [free] = host.free_procs(cpus_per_proc=1.0).values()
    assert host.capacity(cpus_per_proc=1.0) >= free > 0
    assert host.capacity(cpus_per_proc=0.5) == 2 * host.capacity(cpus_per_proc=1.0)
    assert host.capacity(cpus_per_proc=1.0, gpu=True) == 0  # no GPU here


def test_bad_per_host_sizes_are_rejected():
    with pytest.raises(ValueError, match="procs=0"):
        this_host().spawn_procs(per_host={"procs": 0})
    with pytest.raises(ValueError, match="already a host axis"):
        raymesh.host_mesh().spawn_procs(per_host={"hosts": 2})


CONTROLLER = textwrap.dedent(
    """
    import sys, time
    from raymesh import Actor, endpoint, this_host

    class Talker(Actor):
        @endpoint
        def say(self, text):
            print(text, flush=True)

    procs = this_host().spawn_procs(per_host={"procs": 2}, name="talkers")
    talkers = procs.spawn("t", Talker)
    talkers.say.call("hello from a proc").get(timeout=60)
    from raymesh._src.backend import pool  # the warm procs waiting for the next spawn
    import ray
    pool.wait_ready(120)
    warm = [ray.get(w.info)["pid"] for q in pool._warm.values() for w in q]
    print("PIDS", *procs.pids, *warm, flush=True)
    time.sleep(600)
    """
)


def test_worker_output_is_prefixed_and_procs_die_with_a_crashed_controller(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    # One warm proc is enough to see that warm procs die too (the default 8, each importing
    # torch on 2 cores, took ~20 s to get ready).
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAYMESH_WARM_PROCS="1")
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: list[str] = []
    pids: list[int] = []
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if pids and any("hello from a proc" in x for x in lines):
            break
    output = "".join(lines)
    assert pids, output
    assert "talkers[procs=" in output, output
    assert len(pids) > 2, "no warm procs seen"
    proc.kill()  # the controller crashes: no cleanup runs in it
    proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in pids), 30)


def test_choose_skips_a_dead_actor_and_says_so_when_none_is_left(hook_calls):
    procs = this_host().spawn_procs(per_host={"procs": 4}, name="choosers")
    counters = procs.spawn("c", Counter)
    os.kill(procs.pids[2], signal.SIGKILL)
    wait_for(lambda: procs.failure, 10.0)  # the death is known (the watcher recorded it)
    # As a user sends them: many at once, then one at a time. None may go to the dead rank.
    at_once = [counters.rank.choose() for _ in range(40)]
    assert sorted({f.get(timeout=30) for f in at_once}) == [0, 1, 3]
    one_by_one = [counters.rank.choose().get(timeout=30) for _ in range(12)]
    assert sorted(set(one_by_one)) == [0, 1, 3], one_by_one
    for rank in (0, 1, 3):
        os.kill(procs.pids[rank], signal.SIGKILL)
    wait_for(lambda: len(hook_calls) >= 4, 10.0)
    with pytest.raises(SupervisionError, match=r"no live actor left.*all 4 procs are dead"):
        counters.rank.choose().get(timeout=5)
    procs.stop()
