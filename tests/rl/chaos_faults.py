"""Rewards that SIGKILL their own process at counted calls, for bench/chaos.py's rl suite.

The procs import them by name (`tests.rl.chaos_faults:...`). Calls are counted across every
process in one file (`counter`, one byte appended per call: an O_APPEND write is atomic, and the
offset after it is this call's number), so a kill lands at the `at`-th call made anywhere,
whichever proc makes it: mid-rollout for a generator, mid-score for a reward actor.
"""

from __future__ import annotations

import os
import signal

from raymesh.actor import Actor, concurrent_endpoint

from .rewards import es


def _count(counter: str) -> int:
    """This call's number (1-based) among all calls counted in `counter`."""
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b".")
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def es_killing_at(prompt: bytes, completion: bytes, *, counter: str, at: tuple[int, ...]) -> float:
    """`es`, but the calls numbered in `at` SIGKILL the process making them (a generator)."""
    if _count(counter) in at:
        os.kill(os.getpid(), signal.SIGKILL)
    return es(prompt, completion)


class KillableRewardModel(Actor):
    """A reward actor scoring `es`; the calls numbered in `at` SIGKILL its proc."""

    def __init__(self, counter: str, at: tuple[int, ...]) -> None:
        self.counter, self.at = counter, at

    @concurrent_endpoint
    async def score(self, prompt: bytes, completion: bytes) -> float:
        return es_killing_at(prompt, completion, counter=self.counter, at=self.at)
