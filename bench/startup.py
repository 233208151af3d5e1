"""Start-up benchmark: `raymesh train examples/tinygpt.toml`, from the command to its first
step, with the local runtime up (`raymesh up`) and without it (the embedded Ray), and
`import raymesh` alone. One run, the two paths taking turns, each run on a quiet machine (the
runtime's pool refilled after the last adoption).

    python bench/startup.py --runs 3

"First step": the progress line of step 1 (`--steps 1`, so the first report is step 1), read
from the command's stderr as it is printed; the clock starts before the command launches.
Progress goes to stderr, one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from messaging import local_runtime  # bench/ is not a package: its folder on the path

JOB = Path(__file__).resolve().parents[1] / "examples" / "tinygpt.toml"
TARGETS = {"runtime_up_s": 2.0, "import_s": 0.5}


def log(msg: str) -> None:
    print(f"[startup] {msg}", file=sys.stderr, flush=True)


def first_step(env: dict[str, str]) -> float:
    """Seconds from launching `raymesh train JOB --steps 1` to its step-1 progress line."""
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.monotonic()
        p = subprocess.Popen(
            [sys.executable, "-m", "raymesh.cli.main", "train", str(JOB), "--steps", "1"],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stderr is not None
        seen = None
        for line in p.stderr:
            if line.startswith("step 1/1"):
                seen = time.monotonic() - t0
        p.wait(timeout=300)
        if p.returncode != 0 or seen is None:
            raise RuntimeError(f"raymesh train exited {p.returncode} without a step-1 line")
        return seen


def import_time() -> float:
    code = "import time; t = time.perf_counter(); import raymesh; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()
    secs: dict[str, list[float]] = {"runtime_up_s": [], "embedded_s": [], "import_s": []}
    with local_runtime() as ready:
        for i in range(args.runs):
            for path in ("runtime_up_s", "embedded_s")[:: 1 if i % 2 == 0 else -1]:
                env = ready()
                if path == "embedded_s":
                    env = dict(env, RAYMESH_RUNTIME="0")
                secs[path].append(round(first_step(env), 3))
                log(f"{path}: command to first step in {secs[path][-1]:.2f}s")
            secs["import_s"].append(round(import_time(), 3))
    medians = {k: statistics.median(v) for k, v in secs.items()}
    report = {
        "bench": "startup",
        "command": f"raymesh train {JOB.relative_to(JOB.parents[1])} --steps 1",
        "cpus": os.cpu_count(),
        "loadavg_start_end": [load, os.getloadavg()],
        "runs": secs,
        "median": medians,
        "targets": {
            k: {"target_s": t, "median_s": medians[k], "met": medians[k] <= t}
            for k, t in TARGETS.items()
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
