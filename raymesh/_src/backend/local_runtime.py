"""The local runtime: a Ray head and warm procs that outlive programs (`raymesh up`).

Every program otherwise builds its world anew: Ray's start (seconds), then cold procs. `up()`
starts a daemon process that starts the embedded Ray (on loopback, as a program would) and
the shared warm procs (`shared_pool`), then writes the runtime file (`runtime_file`); programs
with no address of their own attach to it (`runtime.ensure_ray`). The daemon's Ray processes
are its children and end with it, so `down()` stops exactly what `up()` started: the daemon
(by the pid in the file, checked to be the daemon) and, if it does not end in time, each of
its descendants by pid, and nothing else.

Guarantees: `up()` with a runtime up says so and starts nothing; a stale file (its daemon
gone) is removed and a new runtime starts; every wait has a timeout and a failure to start
raises `RuntimeStartError` with the daemon's log. A program attached to the runtime keeps only
its own procs and placement groups in it, which Ray ends with the program, and the shared
procs it adopted end with it too (`shared_pool`): the runtime outlives any program.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from raymesh._src.backend import runtime_file
from raymesh._src.backend.runtime_file import DAEMON_MODULE, RuntimeRecord
from raymesh._version import __version__

logger = logging.getLogger("raymesh")

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


class RuntimeStartError(RuntimeError):
    """The runtime's daemon did not come up (its log's last lines say why)."""


@dataclass(frozen=True)
class Up:
    """What `up()` did: `started` False when a runtime was up already."""

    record: RuntimeRecord
    started: bool


def up(
    *,
    cpus: int | None = None,
    warm: int | None = None,
    preload: tuple[str, ...] = (),
    timeout: float = START_TIMEOUT_S,
) -> Up:
    """Start the local runtime, or find the one that is up. `cpus`: Ray's logical CPUs
    (default as the embedded Ray's); `warm`: warm procs it keeps (default `RAYMESH_WARM_PROCS`,
    else 8); `preload`: modules the daemon imports first, each adding what its procs import
    to what the warm procs import (`raymesh.preload`; the CLI passes raymesh.train)."""
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
        raise ValueError(f"cpus={cpus!r}: give Ray's logical CPUs as an int >= 1 (--cpus 8)")
    if warm is not None and (isinstance(warm, bool) or not isinstance(warm, int) or warm < 0):
        raise ValueError(f"warm={warm!r}: give the warm procs to keep as an int >= 0 (--warm 8)")
    record = runtime_file.current()
    if record is not None:
        return Up(record, False)
    from raymesh._src.backend import pool

    cpus = (
        cpus
        if cpus is not None
        else int(os.environ.get("RAYMESH_NUM_CPUS", max(64, os.cpu_count() or 1)))
    )
    warm = warm if warm is not None else pool.size()
    folder = runtime_file.runtime_dir(create=True)
    log_path = folder / "runtime.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYMESH_ADDRESS")}
    env.update(RAYMESH_RUNTIME="0", RAYMESH_WARM_PROCS="0", RAYMESH_NUM_CPUS=str(cpus))
    with open(log_path, "ab") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", DAEMON_MODULE, "--warm", str(warm), "--log", str(log_path)]
            + [f"--preload={m}" for m in preload],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # not the terminal's: Ctrl-C in it does not reach the runtime
            cwd=folder,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeStartError(
                f"the local runtime exited with status {daemon.returncode} while starting; "
                f"its log ({log_path}) ends:\n{_tail(log_path)}"
            )
        record = runtime_file.read()
        if record is not None and record.pid == daemon.pid:
            return Up(record, True)
        time.sleep(0.1)
    stop_tree(psutil.Process(daemon.pid), STOP_TIMEOUT_S)
    raise RuntimeStartError(
        f"the local runtime did not start within {timeout:g}s (stopped again); its log "
        f"({log_path}) ends:\n{_tail(log_path)}"
    )


def down(timeout: float = STOP_TIMEOUT_S) -> RuntimeRecord | None:
    """Stop the local runtime: the daemon, which stops its Ray; its processes by pid if they
    outlive it. The record it stopped, or None when none was up."""
    record = runtime_file.current()
    if record is None:
        return None
    try:
        daemon = psutil.Process(record.pid)
    except psutil.NoSuchProcess:
        runtime_file.remove_if(record)
        return record
    stop_tree(daemon, timeout)
    runtime_file.remove_if(record)
    return record


def status() -> dict[str, Any] | None:
    """The runtime that is up, as plain data (None when none is): its record, uptime, memory
    (resident, the daemon and every process under it: Ray's and the procs'), warm procs and
    the programs attached now."""
    record = runtime_file.current()
    if record is None:
        return None
    tree = _tree(psutil.Process(record.pid))
    rss = 0
    for p in tree:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    info: dict[str, Any] = {
        **record.__dict__,
        "uptime": runtime_file.uptime(record.started),
        "processes": len(tree),
        "memory_bytes": rss,
        "warm_procs": None,
        "programs": [],
    }
    info.update(_ask(record))
    return info


def _ask(record: RuntimeRecord) -> dict[str, Any]:
    """The runtime's warm procs and attached programs, asked of its Ray (this process
    connects for the question, and disconnects)."""
    import ray

    from raymesh._src.backend import runtime, shared_pool

    if ray.is_initialized() or not runtime_file.answers(record):
        return {}
    runtime.attach(record.address, log_to_driver=False, level=logging.ERROR)
    try:
        me = ray.get_runtime_context().get_job_id()
        b = shared_pool.broker()
        warm = ray.get(b.status.remote(), timeout=10) if b is not None else None
        programs = [
            {"job": j["JobID"], "pid": j["DriverPid"]}
            for j in ray._private.state.state.job_table()
            if not j["IsDead"] and j["JobID"] != me and j["DriverPid"] != record.pid
        ]
        return {"warm_procs": warm, "programs": programs}
    finally:
        ray.shutdown()


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def stop_tree(daemon: psutil.Process, timeout: float) -> None:
    """SIGTERM `daemon` (a runtime's daemon, or `ray start --block`, stops its Ray), then
    SIGKILL whatever of its tree is left after `timeout`."""
    tree = _tree(daemon)  # taken first: once the daemon ends, its orphans are nobody's children
    try:
        daemon.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def _tail(path: Any, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _serve(warm: int, log: str, preload: list[str]) -> None:
    """The daemon: start the embedded Ray and the broker, write the file, wait for SIGTERM."""
    from raymesh._src.backend import pool, runtime, shared_pool
    from raymesh._src.backend.host_agent import runtime_agent

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Before Ray: a module that fails to import fails the start at once, with nothing to stop.
    for module in preload:  # each adds what its procs import (`raymesh.preload`)
        importlib.import_module(module)
    runtime.ensure_ray()
    import ray

    imports = pool.imports()
    # Both held until the end (the agent by host_agent's cache): Ray ends an actor, named or
    # not, once no handle to it is left.
    agent = runtime_agent(runtime.current_node_id())
    ray.get(agent.info.remote(), timeout=START_TIMEOUT_S)
    broker = shared_pool.start_broker(warm, imports) if warm > 0 else None
    record = RuntimeRecord(
        address=runtime.address(),
        pid=os.getpid(),
        started=time.time(),
        raymesh=__version__,
        ray=ray.__version__,
        code=runtime_file.code_fingerprint(),
        cpus=int(ray.cluster_resources().get("CPU", 0)),
        warm=warm,
        log=log,
    )
    runtime_file.write(record)
    print(f"raymesh runtime up at {record.address} (pid {record.pid})", flush=True)
    while not stop.wait(1.0):
        pass
    runtime_file.remove_if(record)
    del broker
    runtime.shutdown()
    print("raymesh runtime down", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=DAEMON_MODULE)
    parser.add_argument("--warm", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _serve(args.warm, args.log, args.preload)


if __name__ == "__main__":
    main()
