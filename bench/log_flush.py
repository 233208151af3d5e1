"""What the flush barrier adds to `ProcMesh.stop()`: a mesh of `--procs` procs, each printing
`--lines` lines to stdout and to stderr as it stops (from `__cleanup__`), stopped with the
barrier (`RAYMESH_LOG_FLUSH_S` unset: up to 5 s) and without it (`RAYMESH_LOG_FLUSH_S=0`),
the two taking turns; the medians, their difference, and the barrier's own wait (timed around
`log_barrier.flush`, which starts once every proc has exited).

    python bench/log_flush.py --runs 5             # the embedded Ray, started once
    python bench/log_flush.py --runs 5 --save      # and write bench/results/log_flush.json

The procs' lines go to this process's stdout and stderr, as Ray prints them; progress and the
result (one JSON object) go to stderr. Set RAYMESH_ADDRESS to measure on a running cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from raymesh import Actor, endpoint, this_host
from raymesh._src.backend import log_barrier

_waits: list[float] = []  # the barrier's own wait in each stop with it


def _timed_flush(procs, timeout):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return _flush(procs, timeout)
    finally:
        if timeout > 0:
            _waits.append(round(time.perf_counter() - t0, 4))


_flush, log_barrier.flush = log_barrier.flush, _timed_flush


class Speaker(Actor):
    """Prints `lines` lines to stdout and to stderr as it stops."""

    def __init__(self, lines: int) -> None:
        self.lines = lines

    @endpoint
    def ready(self) -> int:
        return os.getpid()

    def __cleanup__(self, exc: Exception | None) -> None:
        for i in range(self.lines):
            print(f"goodbye {i}")
            print(f"goodbye {i}", file=sys.stderr)


def log(msg: str) -> None:
    print(f"[log_flush] {msg}", file=sys.__stderr__, flush=True)


def one_stop(procs: int, lines: int, barrier: bool) -> float:
    """Seconds `stop()` takes on a fresh mesh of `procs` procs, with or without the barrier."""
    mesh = this_host().spawn_procs(per_host={"procs": procs})
    mesh.spawn("speaker", Speaker, lines).ready.call().get(timeout=60)
    time.sleep(1.0)  # the spawn's own output printed, the procs idle
    if barrier:
        os.environ.pop("RAYMESH_LOG_FLUSH_S", None)
    else:
        os.environ["RAYMESH_LOG_FLUSH_S"] = "0"
    t0 = time.perf_counter()
    mesh.stop()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="stops of each kind")
    parser.add_argument("--procs", type=int, default=4, help="procs in the mesh")
    parser.add_argument("--lines", type=int, default=100, help="lines each proc prints")
    parser.add_argument("--save", action="store_true", help="write bench/results/log_flush.json")
    args = parser.parse_args()
    load_start = os.getloadavg()
    runs: dict[str, list[float]] = {"with_barrier_s": [], "without_s": []}
    for i in range(args.runs):
        order = [True, False] if i % 2 == 0 else [False, True]
        for barrier in order:
            s = one_stop(args.procs, args.lines, barrier)
            runs["with_barrier_s" if barrier else "without_s"].append(round(s, 4))
            log(f"run {i}: stop() {'with' if barrier else 'without'} the barrier {s:.3f} s")
    runs["barrier_wait_s"] = _waits
    medians = {k: round(statistics.median(v), 4) for k, v in runs.items()}
    result = {
        "bench": "log_flush",
        "procs": args.procs,
        "lines_per_stream": args.lines,
        "cpus": os.cpu_count(),
        "loadavg_start_end": [load_start, os.getloadavg()],
        "runs": runs,
        "medians": medians,
        "barrier_adds_s": round(medians["with_barrier_s"] - medians["without_s"], 4),
    }
    print(json.dumps(result, indent=1), file=sys.__stderr__, flush=True)
    if args.save:
        out = Path(__file__).resolve().parent / "results" / "log_flush.json"
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
