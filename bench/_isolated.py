"""Running one benchmark measurement in a fresh Python, in a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_isolated(cmd: list[str], env: dict[str, str], timeout: float) -> int | None:
    """Run `cmd` (stdout to our stderr) in a new session, then kill that whole session: the
    child's Ray and anything else it left behind. Returns its exit code, None if it ran past
    `timeout` seconds."""
    proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
