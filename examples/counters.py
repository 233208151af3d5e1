"""A first raymesh program: a mesh of 4 procs, an actor on each, every adverb, and a proc
killed on purpose to show supervision.

    python examples/counters.py                   # embedded local Ray, any laptop
    RAYMESH_ADDRESS=<head>:6379 python examples/counters.py   # an existing Ray cluster
"""

from __future__ import annotations

import os
import signal

from raymesh import Actor, SupervisionError, current_rank, endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    def rank(self) -> int:
        print(f"rank {current_rank().rank} says hello")  # reaches the controller, prefixed
        return current_rank().rank


def main() -> None:
    procs = this_host().spawn_procs(per_host={"procs": 4}, name="procs")
    counters = procs.spawn("counters", Counter, 10)

    print("call      ->", counters.incr.call(5).get(timeout=60).values())  # [15, 15, 15, 15]
    print("call_one  ->", counters.slice(procs=2).incr.call_one().get(timeout=60))  # 16
    print("choose    ->", counters.rank.choose().get(timeout=60))
    print("stream    ->", [f.get() for f in counters.rank.stream()])
    counters.incr.broadcast(1)  # no reply
    print("after broadcast ->", counters.incr.call(0).get(timeout=60).values())

    victim = procs.pids[1]
    print(f"SIGKILL proc 1 (pid {victim}) ...")
    os.kill(victim, signal.SIGKILL)
    try:
        counters.incr.call(1).get(timeout=30)
    except SupervisionError as e:
        print(f"supervision -> {e.failure}")
    procs.stop()
    print("stopped: no procs left")


if __name__ == "__main__":
    main()
