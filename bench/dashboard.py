"""Dashboard benchmark: what the run folder costs a training job, and how fast the page hears.

    python bench/dashboard.py                 # ~10 s; prints one JSON object
    python bench/dashboard.py --rows 100000   # a longer run

Measured, each as the median of `--repeats`:
- sink_us_per_step: the controller's cost of the run folder (`RunFolder.on_report` of a chunk
  of 10 steps with 4 ranks' columns, and one event), per step: what --dashboard or a run_dir
  adds to training, beside the ~tens of ms a step takes.
- api_runs_ms, api_run_ms: GET /api/runs and GET /api/run/<id> of a run of `--rows` steps
  (the page's first load), read afresh each time (a new app).
- live_ms: from appending a row to metrics.jsonl to its arrival over the page's server-sent
  events stream (the stream polls every 0.5 s, so about 250 ms is expected).
The anchor is the poll period itself: there is no other system to compare with here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from raymesh import dashboard
from raymesh.train.reporting import Event, Report, RunFolder


def _report(step: int, ranks: int = 4, n: int = 10) -> Report:
    rows = tuple(
        {"step": s, "loss": 1.0 / s, "samples_per_s": 1000.0, "end": time.time()}
        for s in range(step, step + n)
    )
    per_rank = tuple(tuple(0.01 * (r + 1) for r in range(ranks)) for _ in range(n))
    return Report(
        rows=rows,
        steps=10**9,
        samples_per_s=1000.0,
        eta_s=0.0,
        rank_losses=(1.0,) * ranks,
        failures=0,
        world_size=ranks,
        rank_step_s=per_rank,
        rank_loss=per_rank,
        spares=1,
    )


def sink_cost(folder: Path, repeats: int) -> float:
    sink = RunFolder(folder)
    times = []
    for i in range(repeats * 20):
        report = _report(1 + 10 * i)
        t0 = time.perf_counter()
        sink.on_report(report)
        sink.on_event(Event("state", {"state": "Running", "reason": "", "step": i}))
        times.append((time.perf_counter() - t0) / len(report.rows))
    return statistics.median(times) * 1e6


def write_run(folder: Path, rows: int) -> None:
    folder.mkdir(parents=True)
    sink = RunFolder(folder)
    sink.on_event(Event("job", {"name": folder.name, "pid": os.getpid(), "steps": rows + 10**6}))
    for start in range(1, rows + 1, 10):
        sink.on_report(_report(start))


def timed_get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        r.read()
    return (time.perf_counter() - t0) * 1e3


def live_latency(board: dashboard.Dashboard, folder: Path, rows: int, repeats: int) -> float:
    """Append one row at a time and time its arrival on the stream."""
    base = board.page("/").split("/?")[0].rstrip("/")
    url = f"{base}/api/stream/{folder.name}?rows={rows}&events=1"
    arrived: dict[int, float] = {}
    done = threading.Event()

    def listen() -> None:
        with urllib.request.urlopen(url, timeout=60) as r:
            for raw in r:
                line = raw.decode()
                if line.startswith("data: [") and '"step"' in line:
                    for row in json.loads(line[len("data: ") :]):
                        arrived[int(row["step"])] = time.perf_counter()
                if done.is_set():
                    return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(1.0)  # connected, and what was there is sent
    waits = []
    step = rows + 1
    for _ in range(repeats):
        sent = time.perf_counter()
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
        while step not in arrived and time.perf_counter() - sent < 10:
            time.sleep(0.001)
        waits.append((arrived.get(step, float("inf")) - sent) * 1e3)
        step += 1
        time.sleep(0.13)  # land at different points of the poll period
    done.set()
    return statistics.median(waits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    out: dict[str, object] = {
        "bench": "dashboard",
        "rows": args.rows,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    with tempfile.TemporaryDirectory() as td:
        root = Path(td)
        out["sink_us_per_step"] = round(sink_cost(root / "sink", args.repeats), 1)
        write_run(root / "big", args.rows)
        out["metrics_jsonl_mib"] = round((root / "big" / "metrics.jsonl").stat().st_size / 2**20, 2)
        runs, run = [], []
        for _ in range(args.repeats):
            with dashboard.start(root, port=0) as board:  # a new app reads the files afresh
                base = board.page("/").split("/?")[0].rstrip("/")
                runs.append(timed_get(f"{base}/api/runs"))
                run.append(timed_get(f"{base}/api/run/big"))
        out["api_runs_ms"] = round(statistics.median(runs), 1)
        out["api_run_ms"] = round(statistics.median(run), 1)
        with dashboard.start(root, port=0) as board:
            out["live_ms"] = round(live_latency(board, root / "big", args.rows, args.repeats), 1)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
