"""Running Python in a subprocess from a test: a command line, or a script that starts its own
local multi-node Ray cluster (`ray.cluster_utils.Cluster`), away from the session's cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULT = "RESULT "  # a cluster script prints its answer as one line: RESULT <json>


def run_python(args: list[str], env: dict[str, str], timeout: float = 180) -> str:
    """`python *args`; asserts it exits 0 (showing its output if not); returns its stdout."""
    try:
        out = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:  # show where it was, not only that it was slow
        tail = "".join(
            (x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-6000:]
            for x in (e.stdout, e.stderr)
        )
        message = f"python {args[0]} ran past {timeout}s; its output's end:\n{tail}"
        raise AssertionError(message) from None
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


_SESSION_ONLY = ("RAY_ADDRESS", "RAYMESH_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def run_cluster_script(path: Path, text: str, timeout: float) -> Any:
    """Write `text` to `path` and run it without this session's Ray address (so its own cluster
    is the one it joins) and without warm procs; returns the JSON of its RESULT line."""
    path.write_text(text)
    # Nor the session's single-machine switch (`runtime._loopback_only`): its cluster's nodes
    # join a head at the machine's address, as a real cluster's do.
    env = {k: v for k, v in os.environ.items() if k not in _SESSION_ONLY}
    # No warm procs: a script's cluster is small and short-lived, its ranks mostly on nodes
    # the pool has not reached yet, and 8 procs importing torch would compete for the CPUs.
    env.setdefault("RAYMESH_WARM_PROCS", "0")
    stdout = run_python([str(path)], env, timeout)
    [line] = [x for x in stdout.splitlines() if x.startswith(RESULT)]
    return json.loads(line[len(RESULT) :])


def start_cli(argv: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """`raymesh *argv` started in a subprocess on this session's Ray (without warm procs), its
    output going to the file `log` (a full pipe would block it); the caller waits or kills."""
    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "raymesh.cli.main", *argv],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
