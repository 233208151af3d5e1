"""Waiting in a test for something that happens in another process or thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["alive", "wait_for"]


def wait_for(
    predicate: Callable[[], T], timeout: float, *, what: str = "the condition", interval=0.05
) -> T:
    """Call `predicate` until it returns something true, and return that; AssertionError naming
    `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not true within {timeout:g}s")


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
