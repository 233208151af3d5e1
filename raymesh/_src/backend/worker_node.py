"""A machine made a host of a Ray cluster by a command of its own (`run_worker_loop_forever`):
`ray start --address=<head> --block`, with a node label that names the worker, so that a
controller can pick exactly those hosts by the names it was given (`attach_to_workers`)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LABEL", "label_value", "run_node"]

LABEL = "raymesh-worker"  # the node label whose value names a worker (see `label_value`)


def label_value(worker: str) -> str:
    """The label value for a worker's name: a digest, as Ray's label values allow only 63
    letters, digits, '-', '_' and '.', and a name such as "tcp://host:4444" has others."""
    return hashlib.sha256(worker.encode()).hexdigest()[:40]


def run_node(worker: str, head: str, num_cpus: int | None, num_gpus: int | None) -> int:
    """Join the cluster at `head` as a node labelled for `worker`, and block until the node
    ends (the raylet dies, or this process is signalled: `ray start --block` then stops the
    node's processes). Returns `ray start`'s exit status."""
    ray = Path(sys.executable).with_name("ray")
    command = [str(ray) if ray.exists() else (shutil.which("ray") or "ray"), "start"]
    command += [f"--address={head}", "--block", "--disable-usage-stats"]
    command += ["--labels", json.dumps({LABEL: label_value(worker)})]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus}")
    # Its own process group: `ray start --block` does not stop the raylet on SIGTERM, so the
    # node is ended by signalling the group (the raylet, and the workers it started).
    # A node joins a cluster: the setting that keeps an embedded Ray single-machine (which
    # this process may have inherited from one, see `runtime._loopback_only`) must not apply.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    node = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    ended = _end_on_sigterm()
    try:
        return node.wait()
    finally:
        if node.poll() is None:  # this process was stopped: end the node with it
            _end_group(node)
        ended()


def _end_group(node: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, sig)  # SIGTERM first: the raylet leaves the cluster at once
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(timeout=wait)
            if sig == signal.SIGKILL or _group_gone(node.pid):
                return


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _end_on_sigterm() -> Callable[[], None]:
    """SIGTERM to this process ends the node too (it raises SystemExit, so `finally` runs);
    returns what puts the previous handler back. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)

    def restore() -> None:
        signal.signal(signal.SIGTERM, before)

    return restore


def _die_with_parent() -> None:
    """In `ray start` (Linux): SIGKILL when this process dies, whatever kills it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
