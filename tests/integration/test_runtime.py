"""The local runtime (`raymesh up` / `status` / `down`), as a user runs it: real commands in
subprocesses, programs that attach to it and adopt its warm procs, a program SIGKILLed while
it holds them, and `down` stopping exactly what `up` started. Each test has a runtime
directory of its own (RAYMESH_RUNTIME_DIR): nothing of the session's, nor of a user's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.waiting import alive, wait_for

PROGRAM = """
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from raymesh import Actor, cluster, endpoint, this_host

class Where(Actor):
    @endpoint
    def where(self):
        return {"pid": os.getpid(), "cwd": os.getcwd(), "mark": os.environ.get("MARK")}

procs = this_host().spawn_procs(per_host={"procs": 2})
answers = list(procs.spawn("where", Where).where.call().get(timeout=120).values())
record = cluster.attached()
print("RESULT " + json.dumps({"answers": answers, "runtime": record and record.pid}), flush=True)
if sys.argv[1:] == ["hold"]:
    time.sleep(600)
procs.stop()
"""


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYMESH_ADDRESS")}
    env.update(RAYMESH_RUNTIME_DIR=str(folder), RAYMESH_NUM_CPUS="8", PYTHONUNBUFFERED="1")
    env.pop("RAYMESH_RUNTIME", None)
    return env


def _raymesh(env: dict[str, str], *argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raymesh.cli.main", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _result(stdout: str) -> dict:
    [line] = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.timeout(420)
def test_programs_attach_adopt_its_warm_procs_and_leave_it_healthy_and_down_stops_only_it(
    tmp_path,
):
    folder, work = tmp_path / "rt", tmp_path / "work"
    work.mkdir()
    (work / "program.py").write_text(PROGRAM)
    env = _env(folder)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        up = _raymesh(env, "up", "--warm", "2")
        assert up.returncode == 0 and "runtime up at 127.0.0.1:" in up.stdout, up
        record = json.loads((folder / "runtime.json").read_text())
        assert os.stat(folder).st_mode & 0o777 == 0o700
        assert os.stat(folder / "runtime.json").st_mode & 0o777 == 0o600
        again = _raymesh(env, "up")
        assert again.returncode == 0 and "up already" in again.stdout, again
        wait_for(
            lambda: (
                (s := json.loads(_raymesh(env, "status", "--json").stdout))["warm_procs"]
                and s["warm_procs"]["ready"] == 2
            ),
            180,
            what="the runtime's 2 warm procs ready",
        )

        # A program attaches (its first line says so), adopts the 2 warm procs, which run in
        # its directory with its environment, and leaves nothing behind when it ends.
        run = subprocess.run(
            [sys.executable, "program.py"],
            cwd=work,
            env=dict(env, MARK="first"),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        said = [x for x in run.stderr.splitlines() if x.startswith("raymesh")]
        assert said[0].startswith("raymesh: attached to the local runtime at"), run.stderr
        assert "may be incomplete" not in run.stderr  # the runtime's agent marks its procs' logs
        first = _result(run.stdout)
        assert first["runtime"] == record["pid"]
        assert [(a["cwd"], a["mark"]) for a in first["answers"]] == [(str(work), "first")] * 2
        status = json.loads(_raymesh(env, "status", "--json").stdout)
        assert status["warm_procs"]["claimed"] == 2, status
        wait_for(lambda: not any(alive(a["pid"]) for a in first["answers"]), 30, what="procs end")

        # A program SIGKILLed while it holds adopted procs: they end with it; the runtime lives.
        held = subprocess.Popen(
            [sys.executable, "program.py", "hold"],
            cwd=work,
            env=dict(env, MARK="held"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = wait_for(held.stdout.readline, 180, what="the holding program's answer")
        pids = [a["pid"] for a in json.loads(line[len("RESULT ") :])["answers"]]
        assert all(alive(p) for p in pids)
        held.send_signal(signal.SIGKILL)
        held.wait(timeout=30)
        wait_for(lambda: not any(alive(p) for p in pids), 30, what="a killed program's procs end")
        after = subprocess.run(
            [sys.executable, "program.py"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert after.returncode == 0 and _result(after.stdout)["runtime"] == record["pid"], after

        # down stops the daemon and every process under it, and nothing else.
        tree = [record["pid"], *(p.pid for p in psutil.Process(record["pid"]).children(True))]
        down = _raymesh(env, "down")
        assert down.returncode == 0 and "stopped the runtime" in down.stdout, down
        assert not any(alive(p) for p in tree), [p for p in tree if alive(p)]
        assert alive(bystander.pid) and not (folder / "runtime.json").exists()
        nothing = _raymesh(env, "down")
        assert nothing.returncode == 0 and "no runtime is up" in nothing.stdout, nothing
    finally:
        bystander.kill()
        _raymesh(env, "down")


def test_a_runtime_that_cannot_start_says_why_and_bad_sizes_are_refused(tmp_path, monkeypatch):
    from raymesh import cluster

    env = _env(tmp_path / "rt")
    bad = _raymesh(env, "up", "--cpus", "0")
    assert bad.returncode == 2 and "cpus=0: give Ray's logical CPUs" in bad.stderr, bad
    assert not (tmp_path / "rt" / "runtime.json").exists()
    monkeypatch.setenv("RAYMESH_RUNTIME_DIR", str(tmp_path / "rt"))
    with pytest.raises(cluster.RuntimeStartError, match="No module named 'no_such_module'"):
        cluster.up(preload=("no_such_module",), warm=0)
    assert cluster.status() is None  # nothing left up, no file


NAPPER = """
import json, os, time
from raymesh import Actor, cluster, endpoint, shutdown_context, this_host

class Napper(Actor):
    @endpoint
    def nap(self, seconds):
        time.sleep(seconds)
        return os.getpid()

procs = this_host().spawn_procs(per_host={"procs": 1})
napper = procs.spawn("n", Napper)
napper.nap.call_one(0).get(timeout=120)
print("RESULT " + json.dumps({"daemon": cluster.attached().pid}), flush=True)
try:
    napper.nap.call_one(600).get(timeout=900)
except cluster.RuntimeLostError as e:
    print("LOST", type(e).__name__, flush=True)
    shutdown_context().get(timeout=10)  # nothing is left to stop: returns at once
    print("SHUT DOWN", flush=True)
    raise
"""


@pytest.mark.timeout(300)
def test_a_program_whose_runtime_is_sigkilled_fails_with_a_typed_error_and_ends(tmp_path):
    env = _env(tmp_path / "rt")
    (tmp_path / "napper.py").write_text(NAPPER)
    up = _raymesh(env, "up", "--warm", "1")
    assert up.returncode == 0, up
    daemon = psutil.Process(json.loads((tmp_path / "rt" / "runtime.json").read_text())["pid"])
    tree = [daemon, *daemon.children(recursive=True)]
    program = subprocess.Popen(
        [sys.executable, str(tmp_path / "napper.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = wait_for(program.stdout.readline, 180, what="the program's first answer")
        assert _result(line)["daemon"] == daemon.pid, line
        daemon.kill()  # mid-call, the program blocked in get() for up to 900 s
        # Ray alone would block it 60 s on the dead GCS, then end it without an exception.
        out, err = program.communicate(timeout=30)
    finally:
        program.kill()
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert program.returncode == 1, err
    assert out.splitlines() == ["LOST RuntimeLostError", "SHUT DOWN"], out + err
    assert f"(`raymesh up`, pid {daemon.pid}) this program attached to is gone" in err, err
    assert "start it again with `raymesh up`" in err
    assert "Traceback" in err and "Failed to connect to GCS" not in err, err
