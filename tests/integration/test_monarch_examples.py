"""Monarch's docs examples, as raymesh runs them (examples/monarch/): they run as a script,
and must finish and print what Monarch's do.

They spawn `gpus` axes, which on this GPU-less machine are only names (CPU procs), as in
Monarch's own CPU runs of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..scripts import run_python

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "monarch"

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _run_both() -> str:
    """Both examples, one after the other, in one script process that joins this session's
    Ray cluster (as `RAYMESH_ADDRESS=<head> python example.py` would): a Ray of their own per
    example would cost ~20 s more on a 2-core machine."""
    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAY_DEDUP_LOGS="0")
    run = "; ".join(
        f"runpy.run_path({str(EXAMPLES / name)!r}, run_name='__main__')"
        for name in ("ping_pong.py", "getting_started.py")
    )
    return run_python(["-c", f"import runpy; {run}"], env, timeout=280)


@pytest.mark.timeout(300)
def test_monarchs_ping_pong_and_getting_started_examples_run_with_only_their_imports_changed():
    out = _run_both()
    # ping_pong: the actors' prints reach the script's stdout (forwarded by Ray, prefixed by
    # proc; some after the script's own last line)
    assert "Example completed successfully!" in out.splitlines()
    assert "Identity: " in out and "msg='hey there, from script!!'" in out
    assert "Pong!, Receiver (actor_1:" in out  # (actor_0's come last: not waited for)
    # getting_started
    assert "Counter value: 0" in out
    assert "Trainer " in out and " taking a step." in out
    assert "Step with data <fake data 1> and input = None" in out
    assert "It didn't say hello" in out
    assert "Actor rank: " in out


@pytest.mark.timeout(330)
def test_monarchs_debugging_example_runs_its_debugger_session_driven_by_the_script():
    """16 actors pause at breakpoint(); the script's own thread types Monarch's walk-through
    at `raymesh debug`'s prompt; the ranks that raise pause post-mortem; the final `get()`
    raises, as Monarch's does (status 1)."""
    import subprocess
    import sys

    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "debugging.py"), "--drive"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1 and "ValueError: bad rank" in done.stderr, out + done.stderr
    assert out.count("debugging.py:59  breakpoint") >= 16  # the first `list`
    assert "(Pdb) rank\n13\n(Pdb) detach\nDetached from debugee[13]; it stays paused" in out
    assert "--- rank 4 ---\n--Call--" in out  # cast ranks(2:7:2) s
    assert out.count("post-mortem: ValueError: bad rank") == 4  # ranks 10, 14; then 2, 6
    assert "resumed: debugee[2], debugee[6]" in out
