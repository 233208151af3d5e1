"""What a proc costs to start: CPU-seconds (every process on the machine, from /proc) and wall
time for `--meshes` meshes of 2 procs, each spawned, called once and stopped in turn, in one of
four ways, each in a fresh Python (its own embedded Ray):

    python bench/proc_start.py                 # all four, 8 meshes each (~2 min on 2 cores)

- cold: `RAYMESH_WARM_PROCS=0`;
- warm-nothing: warm procs importing nothing (`RAYMESH_PRELOAD=`);
- warm-torch: warm procs importing the default (torch);
- warm-train: the default plus what importing `raymesh.train` adds.
The pool is given 15 s to fill before the timed part and 15 s after it to settle (not timed:
warm procs importing after the last spawn are the pool's refill, counted in the CPU). /proc is
read 10 times a second; a process's CPU is its last reading (a process living under 0.1 s is
missed). One JSON object per way to stdout, with the load average. Nothing is saved: the
figures are in docs/benchmarks.md ("The test suite's time").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

WAYS = {
    "cold": {"RAYMESH_WARM_PROCS": "0"},
    "warm-nothing": {"RAYMESH_PRELOAD": ""},
    "warm-torch": {},
    "warm-train": {},
}
SETTLE_S = 15.0


def _cpu_seconds(seen: dict[str, int]) -> None:
    """Record each process's CPU ticks (user + system) in `seen`, by pid."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
                seen[pid] = int(fields[11]) + int(fields[12])
            except (OSError, IndexError):
                pass


def measure(way: str, meshes: int) -> dict:
    """Run in the child: the timed spawns, with /proc read by a thread meanwhile."""
    seen: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            _cpu_seconds(seen)
            time.sleep(0.1)

    if way == "warm-train":
        import raymesh.train  # noqa: F401  (its preloads)
    from raymesh import Actor, endpoint, this_host

    class Pid(Actor):
        @endpoint
        def pid(self) -> int:
            return os.getpid()

    host = this_host()
    first = host.spawn_procs(per_host={"procs": 1})  # Ray up, the pool started
    first.spawn("p", Pid).pid.call().get(timeout=120)
    first.stop()
    time.sleep(SETTLE_S)
    threading.Thread(target=sample, daemon=True).start()
    time.sleep(0.3)
    before = sum(seen.values())
    t0 = time.perf_counter()
    for _ in range(meshes):
        procs = host.spawn_procs(per_host={"procs": 2})
        procs.spawn("p", Pid).pid.call().get(timeout=120)
        procs.stop()
    wall = time.perf_counter() - t0
    time.sleep(SETTLE_S)
    cpu = (sum(seen.values()) - before) / os.sysconf("SC_CLK_TCK")
    stop.set()
    n = 2 * meshes
    return {"way": way, "procs": n, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "cpu_s_per_proc": round(cpu / n, 2)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", type=int, default=8)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one way, in a fresh Python
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.meshes)), flush=True)
        return
    for way in args.ways.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYMESH_ADDRESS")}
        env.update(RAYMESH_RUNTIME="0", **WAYS[way])
        load = os.getloadavg()
        out = subprocess.run(
            [sys.executable, __file__, "--child", way, "--meshes", str(args.meshes)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"way": way, "error": out.stderr[-2000:]}
        result["loadavg_start"] = [round(x, 2) for x in load]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
