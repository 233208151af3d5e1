"""The distributed debugger on real procs (`raymesh.debug`, `raymesh debug`; Monarch's
`monarch debug`): `breakpoint()` in an endpoint pauses that actor in pdb over a loopback socket;
the client lists the paused ranks, casts pdb commands to them, attaches to one and resumes it,
and the call's result then arrives. Mistakes are `DebugError`s; a wrong token is refused; a
paused actor never holds up `stop()`.

Each mesh has a name of its own per run: a developer may run these tests beside us, and the
paused actors of this user on this host are all listed together.
"""

from __future__ import annotations

import io
import os
import socket
import uuid

import pytest

from raymesh import ActorError, SupervisionError, this_host
from raymesh import debug as dbg
from raymesh.actor import Actor, current_rank, endpoint
from raymesh.cli.main import main as cli_main

from ..waiting import wait_for

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(120)]

HERE = __file__.removesuffix("c")  # the source, not a .pyc


class Debuggee(Actor):
    @endpoint
    def to_debug(self, fail_rank: int) -> int:
        x = current_rank().rank * 10 + 1
        breakpoint()
        if current_rank().rank == fail_rank:  # the line pdb stops at
            raise ValueError(f"bad rank {x}")
        return x

    @endpoint
    def fail(self) -> None:
        y = 5
        raise KeyError(y)

    @endpoint
    def setenv(self, name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class Bystander(Actor):
    @endpoint
    def ping(self) -> int:
        return current_rank().rank


with open(HERE) as _f:
    STOP_LINE = next(i for i, t in enumerate(_f, 1) if t.endswith("# the line pdb stops at\n"))


@pytest.fixture(scope="module")
def procs(ray_cluster):
    procs = this_host().spawn_procs(per_host={"procs": 2})
    yield procs
    procs.stop()


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _paused(name: str, n: int) -> list[dbg.PausedActor]:
    return wait_for(
        lambda: (found := [a for a in dbg.list() if a.mesh == name]) and len(found) == n and found,
        60,
        what=f"{n} paused ranks of {name}",
    )


def test_breakpoint_pauses_each_rank_which_the_debugger_lists_casts_to_and_resumes(procs):
    name = _unique("debugee")
    mesh = procs.spawn(name, Debuggee)
    others = procs.spawn(_unique("bystander"), Bystander)
    calls = [mesh.slice(procs=r).to_debug.call_one(0) for r in (0, 1)]

    ranks = _paused(name, 2)
    assert [a.rank for a in ranks] == [0, 1]
    for a in ranks:
        assert (a.file, a.line, a.function, a.reason) == (HERE, STOP_LINE, "to_debug", "breakpoint")
        assert a.coords == {"procs": a.rank} and a.extent == {"procs": 2}
        assert "token" not in repr(a)
    # The other actors of the procs keep running while these are paused.
    assert others.ping.call().get(timeout=30).values() == [0, 1]

    assert dbg.cast(name, "ranks(0:2)", "p x") == {0: "1\n", 1: "11\n"}
    assert dbg.cast("Debuggee", [1], "p x + 1") == {1: "12\n"}  # by class name too

    # Mistakes: each a DebugError that says what is wrong.
    with pytest.raises(dbg.DebugError, match=r"rank 7 does not exist; the mesh has 2 ranks"):
        dbg.cast(name, "ranks(7)", "p x")
    with pytest.raises(dbg.DebugError, match=r"has no rank 7: its ranks are 0..1"):
        dbg.attach(name, 7)
    with pytest.raises(dbg.DebugError, match=r"no actor named 'nobody' is paused"):
        dbg.attach("nobody", 0)

    # A wrong token is refused, and the actor stays paused for the right one.
    with socket.create_connection(("127.0.0.1", ranks[1].port), timeout=10) as s:
        s.sendall(b"not-the-token\n")
        assert s.recv(100) == b"refused: wrong token\n"

    with dbg.attach(name, 1) as session:
        assert "to_debug" in session.intro and f"({STOP_LINE})" in session.intro
        with pytest.raises(dbg.DebugError, match="another client is attached"):
            dbg.attach(name, 1)
        assert session.send("p x") == "11\n"
        session.send("c")
        assert session.resumed
    assert calls[1].get(timeout=30) == 11  # the call's result arrives once resumed
    _paused(name, 1)
    with pytest.raises(dbg.DebugError, match=rf"{name} rank 1 is not paused"):
        dbg.attach(name, 1)

    # Rank 0 raises after its breakpoint: it pauses again at the raise (post-mortem), and its
    # caller gets the error once it is resumed.
    dbg.cast(name, 0, "c")
    [pm] = wait_for(
        lambda: [a for a in dbg.list() if a.mesh == name and a.reason.startswith("post")],
        60,
        what="the post-mortem pause",
    )
    assert pm.reason == "post-mortem: ValueError: bad rank 1" and pm.line == STOP_LINE + 1
    assert dbg.cast(name, "ranks(0)", "p x") == {0: "1\n"}
    dbg.continue_all(job=pm.job)
    with pytest.raises(ActorError, match="bad rank 1"):
        calls[0].get(timeout=30)
    assert [a for a in dbg.list() if a.mesh == name] == []


def test_opt_in_post_mortem_pythonbreakpoint_0_and_a_stop_that_ends_a_pause(procs):
    name = _unique("debugee")
    mesh = procs.spawn(name, Debuggee)
    rank0 = mesh.slice(procs=0)

    # RAYMESH_DEBUG_POST_MORTEM=1: an endpoint that raises pauses at the raise, with no
    # breakpoint() before it; its caller gets the error once it is resumed.
    rank0.setenv.call_one("RAYMESH_DEBUG_POST_MORTEM", "1").get(timeout=30)
    failing = rank0.fail.call_one()
    [pm] = _paused(name, 1)
    assert (pm.rank, pm.function, pm.reason) == (0, "fail", "post-mortem: KeyError: 5")
    assert dbg.cast(name, "ranks(:)", "p y") == {0: "5\n"}
    dbg.cast(name, 0, "c")
    with pytest.raises(ActorError, match="KeyError"):
        failing.get(timeout=30)
    rank0.setenv.call_one("RAYMESH_DEBUG_POST_MORTEM", None).get(timeout=30)

    # PYTHONBREAKPOINT=0 in a proc: breakpoint() does nothing there, as in Python.
    rank0.setenv.call_one("PYTHONBREAKPOINT", "0").get(timeout=30)
    assert rank0.to_debug.call_one(-1).get(timeout=30) == 1
    rank0.setenv.call_one("PYTHONBREAKPOINT", None).get(timeout=30)

    # Stopping a paused actor (no client attached) ends its pause: its call fails, its socket
    # and its listing go, and stop() returns.
    paused_call = mesh.slice(procs=1).to_debug.call_one(-1)
    [p] = _paused(name, 1)
    mesh.stop().get(timeout=60)
    with pytest.raises((ActorError, SupervisionError)):
        paused_call.get(timeout=30)
    wait_for(lambda: not [a for a in dbg.list() if a.mesh == name], 30, what="no listing")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", p.port), timeout=5).close()


def test_the_command_line_lists_casts_attaches_and_continues(procs, capsys, monkeypatch):
    name = _unique("debugee")
    mesh = procs.spawn(name, Debuggee)
    calls = mesh.to_debug.call(-1)
    job = _paused(name, 2)[0].job

    assert cli_main(["debug", "--job", job, "list"]) == 0
    listing = capsys.readouterr().out
    assert f"{HERE}:{STOP_LINE}" in listing and name in listing and "token" not in listing
    assert cli_main(["debug", "--job", job, "cast", name, "ranks(7)", "p", "x"]) == 2
    assert "rank 7 does not exist" in capsys.readouterr().err

    script = [
        f"cast {name} ranks(0:2) p x",
        f"attach {name} 1",
        "p x * 2",
        "detach",
        f"attach {name} 9",
        "help",
        "continue",
        "quit",
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(script) + "\n"))
    assert cli_main(["debug", "--job", job]) == 0
    out = capsys.readouterr().out
    assert "--- rank 0 ---\n1\n--- rank 1 ---\n11" in out
    assert "22\n" in out and f"Detached from {name}[1]; it stays paused" in out
    assert f"error: {name} has no rank 9" in out and "cast MESH ranks(...) COMMAND" in out
    [resumed] = [line for line in out.splitlines() if "resumed: " in line]
    assert {f"{name}[0]", f"{name}[1]"} <= set(resumed.partition("resumed: ")[2].split(", "))
    assert calls.get(timeout=30).values() == [1, 11]
