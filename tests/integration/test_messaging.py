"""Endpoints and adverbs on a real local Ray: call, call_one, choose, stream, broadcast."""

from __future__ import annotations

import ast
import collections
import pickle
import re
import threading
from pathlib import Path

import pytest
import torch

from raymesh import ActorError, SupervisionError, ValueMesh, this_host, this_proc

from .actors import AsyncWorker, Counter, Recorder, TensorActor, Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"procs": 4}, name="msg")
    yield procs
    procs.stop()


def _readme_example() -> tuple[str, int]:
    """The README's python block that defines `class Counter(Actor)`, and the README's line
    number of its first line."""
    text = README.read_text()
    blocks = [
        m
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)
        if "class Counter(Actor)" in m[1]
    ]
    assert len(blocks) == 1, f"{README} has {len(blocks)} python blocks with class Counter(Actor)"
    return blocks[0][1], text.count("\n", 0, blocks[0].start(1))


# What each commented expression of the README's example promises, by its comment.
README_PROMISES = {
    "ValueMesh: 4 values, all 15": lambda v: isinstance(v, ValueMesh) and v.values() == [15] * 4,
    "16": lambda v: v == 16,
    "one rank": lambda v: v in range(4),
    "no reply": lambda v: v is None,
}


def test_the_readme_example_runs_as_written(capsys):
    """The README's code itself, statement by statement in one namespace (as a script runs it,
    in this session's Ray): each expression's value is kept and checked against its comment."""
    code, offset = _readme_example()
    tree = ast.parse(code, str(README))
    ast.increment_lineno(tree, offset)  # tracebacks point into README.md
    lines = README.read_text().splitlines()
    namespace: dict = {"__name__": "readme_example"}  # not importable: classes go by value
    checked = []
    try:
        for stmt in tree.body:
            if not isinstance(stmt, ast.Expr):
                exec(compile(ast.Module([stmt], []), str(README), "exec"), namespace)
                continue
            value = eval(compile(ast.Expression(stmt.value), str(README), "eval"), namespace)
            line = lines[stmt.lineno - 1]
            if "#" not in line:
                continue
            comment = line.split("#", 1)[1].strip()
            assert comment in README_PROMISES, f"README line {stmt.lineno}: {comment!r} unchecked"
            assert README_PROMISES[comment](value), f"README line {stmt.lineno}: {value!r}"
            checked.append(comment)
    finally:
        if "procs" in namespace and namespace["procs"].failure is None:
            namespace["procs"].stop()  # only if the example failed before its own stop()
    assert checked == list(README_PROMISES)
    # the stream loop printed every rank once, in order of arrival
    printed = [x for x in capsys.readouterr().out.splitlines() if x.strip().isdigit()]
    assert sorted(int(x) for x in printed) == [0, 1, 2, 3]
    assert namespace["procs"].failure.kind == "stopped"


def test_call_returns_a_value_mesh_indexed_by_points(procs):
    # this_host() has no axes (as in Monarch): the procs have only their per_host axes.
    counters = procs.spawn("ranks", Counter)
    vm = counters.rank.call().get(timeout=30)
    assert len(vm) == 4
    assert [dict(p) for p, _ in vm] == [{"procs": i} for i in range(4)]
    assert vm.item(procs=3) == 3
    assert vm.slice(procs=slice(1, 3)).values() == [1, 2]


def test_call_one_on_a_mesh_of_many_names_the_fix(procs):
    counters = procs.spawn("many", Counter)
    with pytest.raises(ValueError, match="slice it first"):
        counters.incr.call_one()


def test_choose_never_picks_a_busy_actor_and_takes_turns_among_the_idle_ones(procs, tmp_path):
    counters = procs.spawn("choosy", Counter)
    gate = tmp_path / "gate"
    blocker = counters.wait_for.choose(str(gate), 60.0)  # busy until the gate opens
    # Each pick is awaited before the next, so the busy actor always has one choose() call in
    # flight and the other three none. Plain round robin would hit the busy actor every 4th
    # pick (and then wait for the gate: a TimeoutError here); uniformly random picks avoid it
    # in all 60 with probability (3/4)**60 = 3.2e-8, and split 20/20/20 even more rarely.
    picks = [counters.rank.choose().get(timeout=30) for _ in range(60)]
    assert not blocker.done()
    gate.touch()
    busy = blocker.get(timeout=30)
    assert busy not in picks
    assert collections.Counter(picks) == {r: 20 for r in range(4) if r != busy}


def test_stream_yields_replies_in_order_of_arrival(procs):
    counters = procs.spawn("streamer", Counter)
    # rank r replies after (3 - r) * 0.4 s, so replies arrive in reverse rank order
    assert [f.get(timeout=30) for f in counters.countdown.stream(0.4)] == [3, 2, 1, 0]


def test_messages_from_one_caller_run_in_order(procs):
    rec = procs.slice(procs=0).spawn("rec", Recorder)
    for i in range(300):
        rec.add.broadcast(i)
    assert rec.log.call_one().get(timeout=30) == list(range(300))


def test_messages_from_several_threads_keep_each_threads_order(procs):
    rec = procs.slice(procs=1).spawn("rec2", Recorder)

    def send(tag: str) -> None:
        for i in range(100):
            rec.add.broadcast((tag, i))

    threads = [threading.Thread(target=send, args=(t,)) for t in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = rec.log.call_one().get(timeout=30)
    assert len(log) == 300
    for tag in "abc":
        assert [i for t, i in log if t == tag] == list(range(100))


def test_an_actor_runs_one_message_at_a_time_even_when_async(procs):
    workers = procs.slice(procs=2).spawn("async", AsyncWorker)
    futures = [workers.work.call_one(0.05) for _ in range(5)]
    assert [f.get(timeout=30) for f in futures] == [0] * 5
    assert workers.overlap.call_one().get(timeout=30) == 1


def test_await_a_future(procs):
    import asyncio

    counters = procs.spawn("awaited", Counter, 1)

    async def main() -> list:
        vm = await counters.incr.call(1)
        return vm.values()

    assert asyncio.run(main()) == [2, 2, 2, 2]


def test_a_futures_done_callback_runs_once_when_every_reply_is_in(procs):
    import threading

    workers = procs.spawn("called_back", AsyncWorker)
    calls: list[bool] = []
    woken = threading.Event()

    def note() -> None:
        calls.append(future.done())
        woken.set()

    future = workers.work.call(0.3)
    future.add_done_callback(note)
    assert woken.wait(30) and calls == [True]  # once, after the replies of all four
    future.get(timeout=30)
    future.add_done_callback(lambda: calls.append(True))  # already done: at once, here
    assert calls == [True, True]


def test_context_gives_the_rank_and_the_message_rank_within_the_slice(procs):
    counters = procs.spawn("ctx", Counter)
    whole = counters.where.call().get(timeout=30).values()
    assert [w["message_rank"] for w in whole] == [0, 1, 2, 3]
    assert whole[2]["rank"] == {"procs": 2}
    assert whole[0]["size"] == {"procs": 4}
    part = counters.slice(procs=slice(2, 4)).where.call().get(timeout=30).values()
    assert [w["message_rank"] for w in part] == [0, 1]
    assert part[0]["message_extent"] == {"procs": 2}
    assert [w["rank"]["procs"] for w in part] == [2, 3]


def test_exception_in_endpoint_returns_to_caller_and_actor_survives(procs):
    counters = procs.spawn("faulty", Counter, 5)
    with pytest.raises(ActorError) as info:
        counters.slice(procs=1).fail.call_one("boom").get(timeout=30)
    err = info.value
    assert err.remote_type == "ValueError"
    assert err.remote_message == "boom"
    assert "raise ValueError(message)" in err.remote_traceback
    assert err.rank == 0 and err.mesh_name == "faulty"
    assert counters.incr.call(1).get(timeout=30).values() == [6, 6, 6, 6]


def test_calling_a_method_that_is_not_an_endpoint_names_the_fix(procs):
    counters = procs.spawn("plain", Counter)
    with pytest.raises(TypeError, match="add @endpoint"):
        counters.not_an_endpoint  # noqa: B018
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        counters.nope  # noqa: B018


def test_unpicklable_arguments_name_the_argument_and_the_fix(procs):
    counters = procs.spawn("pickly", Counter)
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"argument 0 \(lock.*cannot be pickled.*Fix"):
        counters.incr.call(lock)
    # the failed call did not consume a sequence number: later calls still run
    assert counters.incr.call(1).get(timeout=30).values() == [1, 1, 1, 1]


def test_unknown_axis_and_out_of_range_slices_are_clear_errors(procs):
    counters = procs.spawn("sliced", Counter)
    with pytest.raises(ValueError, match=r"unknown axis 'gpus'.*\['procs'\]"):
        counters.slice(gpus=0)
    with pytest.raises(ValueError, match=r"procs=7 is out of range.*0\.\.3"):
        counters.slice(procs=7)


def test_a_mesh_reference_passed_to_another_actor_is_callable_from_there(procs):
    loaders = procs.spawn("loaders", Counter)
    trainers = procs.spawn("trainers", Trainer, loaders)
    # each trainer picks the loader at its own coordinates
    assert trainers.fetch.call().get(timeout=60).values() == [0, 1, 2, 3]
    assert trainers.slice(procs=0).fetch_all.call_one().get(timeout=60) == [0, 1, 2, 3]


def test_a_64mib_tensor_round_trips_intact(procs):
    actor = procs.slice(procs=3).spawn("tensors", TensorActor)
    t = torch.randn(16 * 1024 * 1024)  # 64 MiB of float32
    back = actor.echo.call_one(t).get(timeout=60)
    assert back.shape == t.shape and torch.equal(back, t)
    made = actor.make.call_one(1000).get(timeout=30)
    assert torch.equal(made, torch.arange(1000, dtype=torch.float32))


def test_a_large_argument_to_many_actors_reaches_all_of_them(procs):
    actors = procs.spawn("fanout", TensorActor)
    t = torch.ones(4 * 1024 * 1024)  # 16 MiB: stored once, sent by reference
    assert actors.checksum.call(t).get(timeout=60).values() == [float(t.numel())] * 4


def test_this_proc_in_the_controller_runs_the_actor_here():
    import os

    local = this_proc().spawn("local", Counter, 1)
    assert local.incr.call_one(2).get(timeout=30) == 3
    assert local.pid.call_one().get(timeout=30) == os.getpid()
    with pytest.raises(TypeError, match="cannot be sent to other actors"):
        pickle.dumps(local)


def test_calls_on_a_stopped_mesh_raise_supervision_error():
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="short")
    counter = procs.spawn("c", Counter)
    procs.stop()
    with pytest.raises(SupervisionError, match="stopped"):
        counter.incr.call_one().get(timeout=30)
    with pytest.raises(SupervisionError, match="stopped"):
        procs.spawn("again", Counter)


def test_stopping_an_actor_mesh_fails_its_calls_as_stopped_and_leaves_the_procs_serving():
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="keep")
    counters = procs.spawn("going", Counter)
    others = procs.spawn("staying", Counter, 5)
    stopped = counters.slice(procs=0).stop()  # the whole actor mesh, as in Monarch
    assert stopped.get(timeout=5) is None  # a Future, already resolved
    for part in (counters, counters.slice(procs=1)):
        with pytest.raises(SupervisionError, match="stopped"):
            part.incr.call().get(timeout=30)
    assert others.incr.call(1).get(timeout=30).values() == [6, 6]
    assert procs.stop().get(timeout=5) is None
