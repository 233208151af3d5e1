"""Monarch's `Accumulator`, `get_or_spawn_controller`, `hosts_from_config` and
`ProcMesh.logging_option` on real Ray procs."""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raymesh import (
    Accumulator,
    ActorError,
    SupervisionError,
    get_or_spawn_controller,
    host_mesh,
    hosts_from_config,
    this_host,
)
from raymesh._src.logs import log_path

from ..scripts import run_python
from ..waiting import alive
from .monarch_api_actors import (
    Asker,
    AsyncAsker,
    OtherRegistry,
    Registry,
    StartsOnSecondTry,
    Summand,
    Talker,
)

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"procs": 4}, name="monarch-api")
    yield procs
    procs.stop()


# ---- Accumulator --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_accumulate_folds_every_actors_reply_with_combine(procs):
    summands = procs.spawn("sum", Summand)
    total = Accumulator(summands.value_plus, 0, operator.add).accumulate(10)
    assert total.get(timeout=30) == (0 + 1 + 2 + 3) + 4 * 10
    ranks = Accumulator(summands.value_plus, [], lambda acc, r: [*acc, r]).accumulate()
    assert sorted(ranks.get(timeout=30)) == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_accumulate_returns_at_once_and_folds_off_the_callers_thread(procs):
    summands = procs.spawn("slow-sum", Summand)
    folded_on: list[str] = []

    def combine(acc: int, reply: int) -> int:
        folded_on.append(threading.current_thread().name)
        return acc + reply

    started = time.monotonic()
    total = Accumulator(summands.value_plus, 0, combine).accumulate(delay=0.3)
    assert time.monotonic() - started < 0.25
    assert not total.done()
    assert total.get(timeout=30) == 6
    assert total.done()
    assert len(folded_on) == 4 and threading.current_thread().name not in folded_on


@pytest.mark.timeout(60)
def test_accumulate_on_a_slice_folds_only_that_slice(procs):
    summands = procs.spawn("slice-sum", Summand)
    half = summands.slice(procs=slice(2, 4))
    assert Accumulator(half.value_plus, 0, operator.add).accumulate().get(timeout=30) == 5


@pytest.mark.timeout(60)
def test_accumulate_sees_the_callers_earlier_messages_first(procs):
    summands = procs.spawn("fifo-sum", Summand)
    summands.bump.broadcast()
    total = Accumulator(summands.value_plus, 0, operator.add).accumulate()
    assert total.get(timeout=30) == 6 + 400


@pytest.mark.timeout(60)
def test_an_endpoint_error_surfaces_from_the_accumulated_future_as_from_call(procs):
    summands = procs.spawn("failing-sum", Summand)
    future = Accumulator(summands.fail_at, 0, operator.add).accumulate(2)
    with pytest.raises(ActorError) as info:
        future.get(timeout=30)
    assert info.value.rank == 2, "the failing actor's rank, as call reports it"
    assert info.value.mesh_name == "failing-sum" and info.value.endpoint == "fail_at"
    assert info.value.remote_type == "ValueError" and "rank 2 refuses" in str(info.value)
    with pytest.raises(ActorError) as again:  # settled: the same error, at once
        future.get(timeout=0)
    assert again.value is info.value
    # the actors live on
    assert Accumulator(summands.fail_at, 0, operator.add).accumulate(-1).get(timeout=30) == 6


@pytest.mark.timeout(60)
def test_an_error_in_combine_surfaces_from_the_accumulated_future(procs):
    summands = procs.spawn("bad-combine", Summand)

    def combine(acc: int, reply: int) -> int:
        raise KeyError("combine broke")

    with pytest.raises(KeyError, match="combine broke"):
        Accumulator(summands.value_plus, 0, combine).accumulate().get(timeout=30)


@pytest.mark.timeout(60)
def test_a_dead_proc_fails_the_accumulated_future_with_supervision_error():
    victims = this_host().spawn_procs(per_host={"procs": 1}, name="acc-victims")
    try:
        summands = victims.spawn("sum", Summand)
        future = Accumulator(summands.value_plus, 0, operator.add).accumulate(delay=0.0)
        assert future.get(timeout=30) == 0
        os.kill(victims.pids[0], signal.SIGKILL)
        future = Accumulator(summands.value_plus, 0, operator.add).accumulate()
        with pytest.raises(SupervisionError) as info:
            future.get(timeout=20)
        assert info.value.failure.mesh_name == "acc-victims"
        assert info.value.failure.kind == "proc_died"
    finally:
        victims.stop()


def test_an_accumulator_needs_a_meshs_endpoint_and_names_the_fix():
    with pytest.raises(TypeError, match=r"Accumulator\(counters.get_value"):
        Accumulator(Summand.value_plus, 0, operator.add)


# ---- get_or_spawn_controller --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_concurrent_first_calls_spawn_one_controller_on_a_proc_of_its_own(tmp_path):
    constructions = tmp_path / "constructions"
    futures: list = []

    def ask() -> None:
        futures.append(get_or_spawn_controller("one", Registry, str(constructions)))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    controllers = [f.get(timeout=60) for f in futures]
    pids = {c.pid.call_one().get(timeout=30) for c in controllers}
    assert len(pids) == 1
    assert constructions.read_text().split() == [str(pid) for pid in pids]
    assert pids != {os.getpid()}
    # a mesh of one with no axes, like Monarch's: call_one reaches it, call gives one value
    assert controllers[0].sizes == {}
    assert [c.visit.call_one().get(timeout=30) for c in controllers] == [1, 2, 3, 4, 5, 6]


@pytest.mark.timeout(60)
def test_actors_and_the_controller_script_get_the_same_controller(procs):
    askers = procs.spawn("askers", Asker)
    mine = get_or_spawn_controller("shared", Registry).get(timeout=60)
    pid = mine.pid.call_one().get(timeout=30)
    visits = askers.visit.call("shared").get(timeout=60).values()
    assert {p for p, _ in visits} == {pid}
    assert sorted(n for _, n in visits) == [1, 2, 3, 4]
    async_asker = procs.slice(procs=0).spawn("async-asker", AsyncAsker)
    assert async_asker.visit_async.call_one("shared").get(timeout=60) == 5
    assert mine.visit.call_one().get(timeout=30) == 6


@pytest.mark.timeout(60)
def test_a_dead_controller_fails_its_calls_and_later_requests_and_is_not_respawned():
    controller = get_or_spawn_controller("mortal", Registry).get(timeout=60)
    controller.die.broadcast()
    with pytest.raises(SupervisionError) as info:
        for _ in range(100):  # until the death is seen
            controller.visit.call_one().get(timeout=10)
            time.sleep(0.05)
    assert info.value.failure.kind == "proc_died"
    deadline = time.monotonic() + 10
    while True:  # the registry learns of the death from its supervisor (milliseconds)
        try:
            get_or_spawn_controller("mortal", Registry).get(timeout=30)
        except SupervisionError as e:
            assert e.failure.mesh_name == "mortal" and e.failure.kind == "proc_died"
            break
        assert time.monotonic() < deadline, "the registry still hands out a dead controller"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_controller_whose_constructor_raises_is_not_kept_and_the_next_call_retries(tmp_path):
    flag = tmp_path / "ready"
    with pytest.raises((ActorError, SupervisionError), match="does not exist yet"):
        get_or_spawn_controller("second-try", StartsOnSecondTry, str(flag)).get(timeout=60)
    flag.touch()
    controller = get_or_spawn_controller("second-try", StartsOnSecondTry, str(flag))
    assert controller.get(timeout=60).pid.call_one().get(timeout=30) > 0


@pytest.mark.timeout(60)
def test_asking_for_a_controller_with_another_class_names_the_fix():
    get_or_spawn_controller("typed", Registry).get(timeout=60)
    with pytest.raises(ValueError, match=r"already a .*Registry; ask for it with that class"):
        get_or_spawn_controller("typed", OtherRegistry).get(timeout=60)


def test_get_or_spawn_controller_rejects_an_empty_name_and_an_instance():
    with pytest.raises(ValueError, match="non-empty name"):
        get_or_spawn_controller("", Registry)
    with pytest.raises(TypeError, match="not an instance"):
        get_or_spawn_controller("x", Registry())  # type: ignore[arg-type]


# A job of its own: an actor asks first (before the job has a registry), then that actor's procs
# stop, and the driver still gets the same controller.
_ANOTHER_JOB = """
from raymesh import get_or_spawn_controller, this_host
from tests.integration.monarch_api_actors import Asker, Registry

procs = this_host().spawn_procs(per_host={"procs": 1}, name="first-asker")
asker = procs.spawn("asker", Asker)
pid, visits = asker.visit.call_one("per-job").get(timeout=60)
assert visits == 1 and pid != asker.pid.call_one().get(timeout=30), pid
procs.stop()
controller = get_or_spawn_controller("per-job", Registry).get(timeout=60)
assert controller.pid.call_one().get(timeout=30) == pid
assert controller.visit.call_one().get(timeout=30) == 2
print("CONTROLLER", pid)
"""


@pytest.mark.timeout(120)
def test_a_controller_first_asked_for_by_an_actor_outlives_it_and_ends_with_its_job():
    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = run_python(["-c", _ANOTHER_JOB], env, timeout=100)
    [theirs] = [int(line.split()[1]) for line in out.splitlines() if line.startswith("CONTROLLER")]
    deadline = time.monotonic() + 20
    while alive(theirs):
        assert time.monotonic() < deadline, f"job's controller (pid {theirs}) outlived the job"
        time.sleep(0.1)
    # This job has a controller of that name of its own.
    ours = get_or_spawn_controller("per-job", Registry).get(timeout=60)
    assert ours.pid.call_one().get(timeout=30) != theirs


# ---- hosts_from_config and ProcMesh.logging_option -----------------------------------------


@pytest.mark.timeout(30)
def test_hosts_from_config_reads_which_hosts_from_the_variable_it_names(monkeypatch):
    everyone = host_mesh()
    monkeypatch.delenv("RAYMESH_TEST_HOSTS", raising=False)
    assert hosts_from_config("RAYMESH_TEST_HOSTS").node_ids == everyone.node_ids
    monkeypatch.setenv("RAYMESH_TEST_HOSTS", "1")
    assert hosts_from_config("RAYMESH_TEST_HOSTS").node_ids == everyone.node_ids[:1]
    monkeypatch.setenv("RAYMESH_TEST_HOSTS", everyone.addresses[0])
    assert hosts_from_config("RAYMESH_TEST_HOSTS").node_ids == everyone.node_ids[:1]
    for bad, says in (("99", "ask for 1 to"), ("10.9.9.9", "no host at")):
        monkeypatch.setenv("RAYMESH_TEST_HOSTS", bad)
        with pytest.raises(ValueError, match=f"RAYMESH_TEST_HOSTS='?{bad}'?: .*{says}"):
            hosts_from_config("RAYMESH_TEST_HOSTS")


@pytest.mark.timeout(60)
def test_logging_option_sends_a_procs_output_to_its_file_and_back(procs):
    talker = procs.slice(procs=3).spawn("talker", Talker)
    asyncio.run(procs.slice(procs=3).logging_option(stream_to_client=False, level=logging.INFO))
    pid = talker.say.call_one("kept").get(timeout=10)
    text = log_path("monarch-api", pid).read_text()
    assert "print kept" in text
    assert (
        "INFO talker: [actor=<tests.integration.monarch_api_actors.Talker talker>] info kept"
        in text
    )
    asyncio.run(procs.slice(procs=3).logging_option(stream_to_client=True))
    talker.say.call_one("streamed").get(timeout=10)
    assert "streamed" not in log_path("monarch-api", pid).read_text()
    with pytest.raises(ValueError, match="aggregate_window_sec=-1"):
        asyncio.run(procs.logging_option(aggregate_window_sec=-1))


@pytest.mark.timeout(60)
def test_log_records_made_in_an_actor_name_it_and_empty_messages_stay_empty(procs):
    talker = procs.slice(procs=2).spawn("named-talker", Talker)
    prefix = "[actor=<tests.integration.monarch_api_actors.Talker named-talker>] "  # no axes
    assert talker.capture.call_one("%d%% done", 50).get(timeout=10) == prefix + "50% done"
    assert talker.capture.call_one("").get(timeout=10) == ""  # torch's structured traces
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("raymesh.test").addHandler(handler)
    try:
        logging.getLogger("raymesh.test").warning("outside any actor")
    finally:
        logging.getLogger("raymesh.test").removeHandler(handler)
    assert records[0].getMessage() == "outside any actor"


# ---- shutdown_context ---------------------------------------------------------------------

_SHUTDOWN = """
import os, sys
import ray
from raymesh import shutdown_context, this_host
from tests.integration.monarch_api_actors import Tidy

procs = this_host().spawn_procs(per_host={"procs": 2}, name="to-shut")
tidy = procs.spawn("tidy", Tidy, sys.argv[1])
print("PIDS", *tidy.pid.call().get(timeout=60).values())
assert shutdown_context().get(timeout=1) is None
assert not ray.is_initialized()
assert shutdown_context().get(timeout=1) is None  # idempotent
print("DONE")
"""


@pytest.mark.timeout(120)
def test_shutdown_context_stops_the_procs_running_cleanup_and_disconnects(tmp_path):
    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    marker = tmp_path / "cleaned"
    out = run_python(["-c", _SHUTDOWN, str(marker)], env, timeout=100)
    assert "DONE" in out, out
    pids = [int(p) for p in out.split("PIDS", 1)[1].split("\n", 1)[0].split()]
    assert marker.read_text() == "cleaned None"
    assert not any(alive(p) for p in pids)  # the session's Ray still runs; these procs do not


# ---- the flush barrier: stop() and shutdown_context() return after the procs' last lines ----

_FAREWELLS = """
import sys
from raymesh import shutdown_context, this_host
from tests.integration.monarch_api_actors import Farewell

n = int(sys.argv[1])

def stopped(mesh):
    print(f"{mesh} STOPPED", flush=True)
    print(f"{mesh} STOPPED", file=sys.stderr, flush=True)

a = this_host().spawn_procs(per_host={"procs": 1}, name="farewell-a")
print("PIDS a", *a.spawn("farewell", Farewell, n, 0).chat.call().get(timeout=60).values())
a.kill()  # dead right after its burst, before stop(): what it wrote is flushed all the same
a.stop()
stopped("a")
b = this_host().spawn_procs(per_host={"procs": 2}, name="farewell-b")
bye = b.spawn("farewell", Farewell, 0, n)
print("PIDS b", *bye.chat.call().get(timeout=60).values(), flush=True)
bye.slice(procs=1).lose_logs.call_one().get(timeout=60)
shutdown_context()
stopped("b")
"""


def _lines_by_pid(text: str) -> dict[int, list[str]]:
    """The procs' lines Ray printed in `text` (one stream of the controller), by proc pid."""
    import re

    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        if m := re.search(r"pid=(\d+)(?:, ip=[^)]*)?\) (.*)$", line):
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


@pytest.mark.timeout(180)
def test_stop_and_shutdown_context_return_once_every_line_the_procs_wrote_has_printed():
    from raymesh._src import backend

    # Every line printed as it comes: no colours, and no aggregation of lines that differ only
    # in their numbers (Ray's, for the whole job).
    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    env.update(RAY_DEDUP_LOGS="0", RAY_COLOR_PREFIX="0", RAYMESH_LOG_FLUSH_S="60")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    n = 10_000  # a burst that Ray's log monitor takes longer to forward than the proc to end
    done = subprocess.run(
        [sys.executable, "-c", _FAREWELLS, str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    pids = {
        m: [int(p) for p in done.stdout.split(f"PIDS {m} ")[1].split("\n")[0].split()] for m in "ab"
    }
    for stream in (done.stdout, done.stderr):
        assert ":raymesh_output_end:" not in stream  # the markers are never printed
        before_a, after_a = stream.split("a STOPPED\n", 1)
        before_b, after_b = after_a.split("b STOPPED\n", 1)
        tail = ["tail"] if stream is done.stdout else []
        cleanup = [f"cleanup {i}" for i in range(3)]
        # Every line, in order, printed before stop() returned: a killed proc's...
        assert _lines_by_pid(before_a).get(pids["a"][0]) == [f"chat {i}" for i in range(n)]
        assert pids["a"][0] not in _lines_by_pid(after_a)
        # ... and those of a proc stopped by shutdown_context(), up to its atexit handlers'.
        assert (
            _lines_by_pid(before_b).get(pids["b"][0])
            == cleanup + [f"atexit {i}" for i in range(n)] + tail
        )
        assert pids["b"][0] not in _lines_by_pid(after_b)
    # A proc whose lines cannot be flushed is named, once, without the full wait.
    warnings = [x for x in done.stderr.splitlines() if "may be incomplete" in x]
    assert warnings == [
        "raymesh: the output of mesh 'farewell-b' may be incomplete: rank 1: its log files "
        "could not be marked (Ray moved them, or its agent failed)"
    ]
