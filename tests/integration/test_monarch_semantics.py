"""Monarch's actor semantics on real Ray procs: concurrent endpoints, the actor's identity and
abort, endpoint options and explicit response ports, one thread per actor, a BaseException
that kills the actor, `__supervise__` that never waits behind a running endpoint, and
`__cleanup__` with the recursive stop."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

import raymesh
import raymesh.actor
from raymesh import (
    Actor,
    ActorError,
    MeshFailure,
    SupervisionError,
    concurrent_endpoint,
    current_actor_name,
    endpoint,
    this_host,
)
from raymesh._src.port import Reply
from raymesh.actor import Port

from ..waiting import alive, wait_for
from .monarch_actors import (
    Adopter,
    AsyncCleaned,
    AsyncExiter,
    AsyncSuperviseWatcher,
    AsyncWatcher,
    Cleaned,
    Exiter,
    Finalized,
    Gate,
    Identity,
    Log,
    Named,
    NeverReady,
    Options,
    Owner,
    Streamer,
    ThreadBound,
    Watcher,
)

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="semantics")
    yield procs
    procs.stop()


@pytest.fixture
def hook_calls():
    """Replaces the fault hook Monarch's way, by assigning the module attribute, and puts the
    saved one back (the tests using it fail if the assignment does not reach supervision)."""
    calls: list[MeshFailure] = []
    saved = raymesh.actor.unhandled_fault_hook
    raymesh.actor.unhandled_fault_hook = calls.append
    yield calls
    raymesh.actor.unhandled_fault_hook = saved


def _failures_of(calls: list[MeshFailure], mesh_name: str) -> list[MeshFailure]:
    return [f for f in calls if f.mesh_name == mesh_name]


# ---- 1. @concurrent_endpoint --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_concurrent_endpoint_lets_the_actors_next_messages_run_while_it_waits(procs):
    gate = procs.slice(procs=0).spawn("gate", Gate)
    waiting = gate.wait.call_one()
    assert gate.ping.call_one().get(timeout=10) == "pong"  # a sync endpoint, meanwhile
    assert gate.release_when_ready.call_one().get(timeout=10) == "released"
    assert waiting.get(timeout=10) == "done"


@pytest.mark.timeout(30)
def test_concurrent_endpoints_start_in_the_order_they_were_sent(procs):
    gate = procs.slice(procs=1).spawn("order", Gate)
    futures = [gate.record.call_one(i) for i in range(30)]
    assert [f.get(timeout=10) for f in futures] == list(range(30))
    assert gate.log.call_one().get(timeout=10) == list(range(30))


@pytest.mark.timeout(30)
def test_an_exception_in_a_concurrent_endpoint_returns_as_actor_error_and_the_actor_serves_on(
    procs,
):
    gate = procs.slice(procs=0).spawn("failing-gate", Gate)
    with pytest.raises(ActorError, match="concurrent boom") as info:
        gate.fail.call_one("concurrent boom").get(timeout=10)
    assert info.value.remote_type == "ValueError" and info.value.endpoint == "fail"
    assert gate.ping.call_one().get(timeout=10) == "pong"


@pytest.mark.timeout(10)
def test_concurrent_endpoint_takes_async_methods_only_and_not_an_endpoint():
    with pytest.raises(ValueError, match="can only wrap async endpoints"):

        class SyncConcurrent(Actor):
            @concurrent_endpoint
            def ping(self) -> str:
                return "pong"

    with pytest.raises(ValueError, match="does not wrap @endpoint"):

        class Stacked(Actor):
            @concurrent_endpoint  # type: ignore[call-overload]
            @endpoint
            async def ping(self) -> str:
                return "pong"

    assert Gate.wait.concurrent and not Gate.ping.concurrent


# ---- 2. current_actor_name() and context().actor_instance ---------------------------------


@pytest.mark.timeout(30)
def test_current_actor_name_is_the_actor_id_unique_per_actor_and_root_in_the_controller(procs):
    ids = procs.spawn("ids", Identity)
    names = ids.whoami.call().get(timeout=10).values()
    infos = ids.instance.call().get(timeout=10).values()
    assert len(set(names)) == 2
    assert names == [info["actor_id"] for info in infos]
    proc, actor = names[1].rsplit(",", 1)
    assert proc.startswith("semantics[") and proc.endswith("procs=1]")  # the proc, then the actor
    assert actor.startswith("ids-") and actor.endswith("[1]")
    assert current_actor_name() == "controller,root[0]"


@pytest.mark.timeout(30)
def test_actor_instance_gives_rank_actor_id_names_and_its_proc(procs):
    ids = procs.spawn("who", Identity)
    info = ids.slice(procs=1).instance.call_one().get(timeout=10)
    assert info["rank"] == 1
    assert info["actor_name"] == info["name"] == "who"
    assert info["class_name"] == "tests.integration.monarch_actors.Identity"
    assert info["proc_id"].startswith("semantics[") and info["proc_id"].endswith("procs=1]")
    assert info["repr"].startswith("<tests.integration.monarch_actors.Identity who{")
    assert info["repr"].endswith("'procs': 1/2}>")
    pid, helper_pid = ids.slice(procs=1).helper_pid.call_one().get(timeout=30)
    assert pid == helper_pid == procs.slice(procs=1).pids[0]
    # who spawned it, and on what (Monarch's creator and proc_mesh): here the root client
    assert info["creator"].name == "root" and repr(info["creator"]) == "<root>"
    assert repr(raymesh.context().actor_instance) == "<root>"  # the client's own, as Monarch's
    assert info["proc_mesh_pids"] == procs.pids
    child = ids.slice(procs=1).spawn_child.call_one().get(timeout=30)
    assert str(child.instance.call_one().get(timeout=10)["creator"].actor_id) == info["actor_id"]


@pytest.mark.timeout(30)
def test_abort_fails_the_actor_its_owner_hears_of_it_and_later_calls_raise(procs, hook_calls):
    ids = procs.slice(procs=0).spawn("aborter", Identity)
    assert ids.abort.call_one("test abort reason").get(timeout=10) == "aborted"
    [failure] = wait_for(lambda: _failures_of(hook_calls, "aborter"), 8.0, interval=0.02)
    assert failure.kind == "actor_failed" and "test abort reason" in failure.cause
    with pytest.raises(SupervisionError, match="test abort reason"):
        ids.whoami.call_one().get(timeout=10)
    # only the actor failed: its proc serves others
    assert procs.slice(procs=0).spawn("after", Identity).whoami.call_one().get(timeout=10)


# ---- 3. endpoint options and explicit response ports --------------------------------------


@pytest.mark.timeout(30)
def test_endpoint_accepts_monarchs_propagate_and_instrument_options(procs):
    assert Options.plain.propagate == "inspect" and Options.plain.instrument is False
    options = procs.slice(procs=0).spawn("options", Options)
    assert options.plain.call_one(1).get(timeout=10) == 2
    with pytest.raises(ValueError, match="propagate='sometimes'"):
        endpoint(propagate="sometimes")  # type: ignore[call-overload]


@pytest.mark.timeout(30)
def test_an_explicit_port_replies_from_another_thread_after_the_endpoint_returned(procs):
    options = procs.slice(procs=0).spawn("later", Options)
    reply = options.later.call_one(0.5)
    assert options.ping.call_one().get(timeout=10) == "pong"  # the turn ended at the return
    assert reply.get(timeout=10) == "from replier"


@pytest.mark.timeout(30)
def test_an_explicit_port_reply_comes_before_the_body_ends_and_later_messages_wait_for_it(
    procs,
):
    options = procs.slice(procs=1).spawn("early", Options)
    started = time.monotonic()
    assert options.early.call_one(2.0).get(timeout=10) == "started"
    assert time.monotonic() - started < 1.5
    assert options.ping.call_one().get(timeout=10) == "pong"
    assert options.seen.call_one().get(timeout=10) == ["body", "ping"]


@pytest.mark.timeout(30)
def test_port_exception_returns_as_actor_error_and_a_dropped_port_never_hangs(procs):
    options = procs.slice(procs=0).spawn("refuser", Options)
    with pytest.raises(ActorError, match="no such key") as info:
        options.refuse.call_one("no such key").get(timeout=10)
    assert info.value.remote_type == "KeyError"
    with pytest.raises(ActorError, match="dropped its response port"):
        options.drop.call_one().get(timeout=10)
    assert options.ping.call_one().get(timeout=10) == "pong"


@pytest.mark.timeout(30)
def test_an_exception_that_escapes_an_explicit_port_endpoint_fails_the_actor(procs, hook_calls):
    options = procs.slice(procs=1).spawn("escaper", Options)
    with pytest.raises(SupervisionError, match="escaped the port"):  # as in Monarch
        options.escape.call_one().get(timeout=10)
    [failure] = wait_for(lambda: _failures_of(hook_calls, "escaper"), 8.0, interval=0.02)
    assert failure.kind == "actor_failed" and "escaped the port" in failure.cause
    with pytest.raises(SupervisionError):
        options.ping.call_one().get(timeout=10)


@pytest.mark.timeout(10)
def test_a_port_replies_once_and_stays_in_its_proc():
    reply = Reply(None)
    port: Port[int] = Port(reply)
    port.send(1)
    with pytest.raises(RuntimeError, match="already sent its one value"):
        port.send(2)
    with pytest.raises(TypeError, match="cannot be sent to another actor"):
        pickle.dumps(port)
    assert reply.wait() == 1


# ---- 4. one thread per actor ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_sync_actors_constructor_and_endpoints_share_its_thread_and_thread_local_state(procs):
    bound = procs.spawn("bound", ThreadBound)
    for _ in range(5):
        assert (
            bound.observe.call().get(timeout=10).values() == [(True, "set in __init__", False)] * 2
        )
    # callers on several threads at once: still the actor's one thread
    results: list = []

    def call() -> None:
        results.append(bound.slice(procs=0).slow.call_one(0.01).get(timeout=10))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8


class _Mixed(Actor):
    @endpoint
    def plain(self) -> None:
        pass

    @endpoint
    async def awaited(self) -> None:
        pass


class _SyncWithAsyncCleanup(Actor):
    @endpoint
    def plain(self) -> None:
        pass

    async def __cleanup__(self, exc: Exception | None) -> None:
        pass


@pytest.mark.timeout(30)
def test_an_actor_mixing_sync_and_async_endpoints_is_refused_at_spawn_saying_why(procs):
    with pytest.raises(ValueError, match="mixes both async and sync") as info:
        procs.spawn("mixed", _Mixed)
    assert "['plain']" in str(info.value) and "['awaited']" in str(info.value)
    assert "asyncio.to_thread" in str(info.value)  # the fix
    with pytest.raises(ValueError, match="async __cleanup__"):
        procs.spawn("mixed-cleanup", _SyncWithAsyncCleanup)


@pytest.mark.timeout(30)
def test_a_constructor_that_never_returns_fails_the_spawn_with_a_typed_error_naming_it(
    procs, hook_calls, monkeypatch
):
    monkeypatch.setenv("RAYMESH_SPAWN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RAYMESH_SPAWN_TIMEOUT_S='soon'"):
        procs.slice(procs=1).spawn("never", NeverReady)
    monkeypatch.setenv("RAYMESH_SPAWN_TIMEOUT_S", "1.5")
    with pytest.raises(SupervisionError, match=r"NeverReady.__init__ did not return within 1.5s"):
        procs.slice(procs=1).spawn("never", NeverReady)
    [failure] = wait_for(lambda: _failures_of(hook_calls, "never"), 8.0, interval=0.02)
    assert failure.kind == "init_error" and "RAYMESH_SPAWN_TIMEOUT_S" in failure.cause


# ---- 5. a BaseException kills the actor ----------------------------------------------------


@pytest.mark.timeout(30)
def test_system_exit_in_an_endpoint_fails_the_actor_and_supervision_runs(procs, hook_calls):
    exiter = procs.slice(procs=0).spawn("exiter", Exiter)
    neighbour = procs.slice(procs=0).spawn("neighbour", Exiter)
    with pytest.raises(SupervisionError, match="SystemExit") as info:  # as in Monarch
        exiter.exit.call_one(3).get(timeout=10)
    assert info.value.failure.kind == "actor_failed"
    [failure] = wait_for(lambda: _failures_of(hook_calls, "exiter"), 8.0, interval=0.02)
    assert failure.kind == "actor_failed" and "SystemExit" in failure.cause
    with pytest.raises(SupervisionError, match="SystemExit"):
        exiter.ping.call_one().get(timeout=10)
    assert neighbour.ping.call_one().get(timeout=10) == "pong"  # the proc lives on


@pytest.mark.timeout(30)
def test_keyboard_interrupt_in_an_async_endpoint_fails_the_actor_but_not_the_event_loop(
    procs, hook_calls
):
    exiter = procs.slice(procs=1).spawn("interrupted", AsyncExiter)
    neighbour = procs.slice(procs=1).spawn("async-neighbour", AsyncExiter)
    with pytest.raises(SupervisionError, match="KeyboardInterrupt"):
        exiter.interrupt.call_one().get(timeout=10)
    [failure] = wait_for(lambda: _failures_of(hook_calls, "interrupted"), 8.0, interval=0.02)
    assert failure.kind == "actor_failed"
    assert neighbour.aping.call_one().get(timeout=10) == "apong"  # the loop still runs


@pytest.mark.timeout(30)
def test_an_owner_actor_sees_its_childs_system_exit_in_supervise(procs):
    watcher = procs.slice(procs=0).spawn("exit-watcher", Watcher)
    watcher.spawn_children.call_one(True).get(timeout=30)
    [failure] = wait_for(lambda: watcher.seen.call_one().get(timeout=10), 8.0, interval=0.02)
    assert failure.kind == "actor_failed" and failure.mesh_name == "kid"
    assert "SystemExit" in failure.cause


# ---- 6. __supervise__ does not wait behind a running endpoint ------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("watcher_cls", "waits"),
    [(AsyncWatcher, "wait_async"), (AsyncSuperviseWatcher, "wait_async"), (Watcher, "wait_sync")],
)
def test_supervise_runs_while_an_endpoint_of_its_owner_waits_for_it(procs, watcher_cls, waits):
    watcher = procs.slice(procs=1).spawn(f"waiter-{watcher_cls.__name__}-{waits}", watcher_cls)
    child_pid = watcher.spawn_children.call_one(False).get(timeout=30)
    waiting = getattr(watcher, waits).call_one(8.0)  # holds the owner's turn while it waits
    time.sleep(0.2)
    os.kill(child_pid, signal.SIGKILL)
    assert waiting.get(timeout=10) == "proc_died"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "exit", "sigkill"])
def test_the_actor_that_spawned_a_mesh_on_procs_it_was_handed_supervises_it(procs, hook_calls, how):
    # Monarch's test_no_reply_port_exception_delivered_to_supervisor: the controller owns the
    # procs, the adopter owns the actor mesh it spawned there, so the failure is the adopter's.
    given = procs.slice(procs=1)
    if how == "sigkill":  # a proc of its own to kill
        given = this_host().spawn_procs(per_host={"procs": 1}, name=f"given-{how}")
    adopter = procs.slice(procs=0).spawn(f"adopter-{how}", Adopter)
    [failure] = adopter.fail_child.call_one(given, how, 20.0).get(timeout=40)
    assert failure.mesh_name == "adopted"
    assert failure.kind == {"raise": "endpoint_error", "exit": "actor_failed"}.get(how, "proc_died")
    if how == "raise":
        assert "the child broke" in failure.cause
    time.sleep(0.5)  # a late delivery to the controller's hook would show now
    assert _failures_of(hook_calls, "adopted") == []
    if how == "sigkill":
        given.stop()


# ---- 7. stopping: __cleanup__, and what an actor owns stops with it ------------------------


@pytest.mark.timeout(60)
def test_stopping_a_proc_mesh_lets_its_procs_exit_as_python_does(tmp_path):
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="finalized")
    path = tmp_path / "marker"
    pid = procs.spawn("finalized", Finalized, str(path)).pid.call_one().get(timeout=30)
    procs.stop()  # returns once the process has exited (a zombie until Ray reaps it)
    assert not alive(pid)
    assert path.read_text() == "finalized"  # a module global's __del__ ran
    assert (tmp_path / "marker.atexit").exists()  # and the proc's atexit handlers


@pytest.fixture
def log(procs):
    log = procs.slice(procs=1).spawn("log", Log)
    yield log
    log.stop()


@pytest.mark.timeout(60)
def test_stopping_an_actor_mesh_runs_cleanup_once_on_each_actors_thread(procs, log):
    cleaned = procs.spawn("cleaned", Cleaned, log, "cleaned")
    assert list(cleaned.ping.call().get(timeout=10).values()) == ["pong", "pong"]
    assert log.read.call_one().get(timeout=10) == []  # nothing before stop
    cleaned.stop().get(timeout=60)
    lines = log.read.call_one().get(timeout=10)
    assert lines == ["cleaned cleanup exc=None same_thread=True"] * 2
    with pytest.raises(SupervisionError, match="stopped"):
        cleaned.ping.call().get(timeout=10)


@pytest.mark.timeout(60)
def test_a_failed_actor_gets_cleanup_with_the_reason(procs, log, hook_calls):
    cleaned = procs.slice(procs=0).spawn("aborts", Cleaned, log, "aborts")
    cleaned.abort.call_one("disk full").get(timeout=10)
    [line] = wait_for(lambda: log.read.call_one().get(timeout=10), 8.0, interval=0.02)
    assert line.startswith("aborts cleanup exc=actor aborts-") and "disk full" in line
    cleaned.stop().get(timeout=30)  # a failed actor's cleanup has run: not again
    assert log.read.call_one().get(timeout=10) == [line]


@pytest.mark.timeout(60)
def test_stopping_procs_cancels_running_async_endpoints_before_an_async_cleanup(log):
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="cancelled")
    actor = procs.spawn("async-cleaned", AsyncCleaned, log)
    assert actor.run.call_one().get(timeout=10) == "started"
    procs.stop().get(timeout=60)
    assert log.read.call_one().get(timeout=10) == ["task ended", "cleanup exc=None"]


@pytest.mark.timeout(90)
def test_stopping_an_owner_stops_the_meshes_it_spawned_and_their_cleanups_run(procs, log):
    owner = procs.slice(procs=0).spawn("owner", Owner, procs.slice(procs=1), log)
    [pid] = owner.own_pids.call_one().get(timeout=30)
    owner.stop().get(timeout=60)
    lines = log.read.call_one().get(timeout=10)
    assert sorted(lines) == [
        "on-given cleanup exc=None same_thread=True",
        "on-own cleanup exc=None same_thread=True",
    ]
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, interval=0.02)  # its own procs ended


# ---- 8. stream() in an async endpoint --------------------------------------------------------


@pytest.mark.timeout(60)
def test_streaming_from_an_async_endpoint_to_actors_on_its_own_event_loop_does_not_block(procs):
    named = procs.spawn("named", Named)
    streamer = procs.slice(procs=0).spawn("streamer", Streamer)
    # whoami runs on the proc's event loop, the one fetch awaits on: iterating the stream must
    # hand back futures without waiting for replies
    names = streamer.fetch.call_one(named).get(timeout=20)
    assert len(set(names)) == 2 and all("named-" in n for n in names), names
