"""Multi-host start: a raymesh.train job's `fit` to its first step on N simulated hosts, against
the same job on one host, in one run (issue 39, item 5).

    python bench/train_hosts.py                  # 4, 8 and 16 hosts (~6-8 min on 2 cores)
    python bench/train_hosts.py --hosts 4 --no-save

Each measurement is a fresh python in a session of its own (`_isolated.run_isolated`) that starts
a `ray.cluster_utils.Cluster` on this machine: a head without CPUs (a cluster's usual head) and
N nodes of one CPU each, each node a raylet of its own, as a new user would simulate a cluster.
The job: raymesh.examples.mlp, elastic workers=(4, 8), 5 steps, report_every=1, warm procs off
(`RAYMESH_WARM_PROCS=0`: every node's pool importing torch would only add to the start). Its
world is min(N, 8) ranks, one per host. The one-host side: the same job on a Cluster of one node
with min(N, 8) CPUs, so both sides start as many ranks.

Figures per run (seconds): `cluster_up_s` (the Cluster and ray.init; not raymesh's), then from
the call to `fit`: `placed_s` (raymesh.train's log says where the ranks go: topology probes and
placement), `running_s` (its -> Running: ranks spawned, built, process groups up, strategy
decided) and `first_step_s` (the progress callback of step 1). The load average at start and end
is recorded; on 2 cores every simulated host's raylet, host agent and rank share the same CPUs,
so the figures show how raymesh's start grows with hosts, not how fast a real cluster starts.
One JSON object to stdout, also to bench/results/train_hosts.json (unless --no-save).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolated import run_isolated

RESULTS = Path(__file__).resolve().parent / "results" / "train_hosts.json"
WORKERS, STEPS = (4, 8), 5


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(spec: dict[str, Any]) -> None:
    """One measurement (in its own python): a Cluster of `nodes` nodes of `cpus` CPUs each."""
    import logging

    t0 = time.time()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(spec["nodes"]):
        cluster.add_node(num_cpus=spec["cpus"])
    cluster.wait_for_nodes()
    import ray

    ray.init(address=cluster.address)
    up = time.time()

    said: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((record.created, record.getMessage()))

    logging.getLogger("raymesh").addHandler(Keep())
    logging.getLogger("raymesh").setLevel(logging.INFO)
    from raymesh import train
    from raymesh.examples import mlp

    first: list[float] = []
    config = train.TrainConfig(
        workers=WORKERS, steps=STEPS, global_batch_size=48, seed=0, report_every=1
    )

    def progress(_: dict[str, Any]) -> None:
        if not first:
            first.append(time.time())

    start = time.time()
    train.fit(mlp.build, config, progress=progress)

    def at(*prefixes: str) -> float | None:
        return next(
            (round(t - start, 2) for t, m in said if m.startswith(prefixes)),
            None,
        )

    out = {
        "nodes": spec["nodes"],
        "cpus_per_node": spec["cpus"],
        "world": _world(said),
        "cluster_up_s": round(up - t0, 2),
        "placed_s": at(
            "raymesh.train: placement:",
            "raymesh.train: room for",
            "raymesh.train: no placement plan",
        ),
        "running_s": at("raymesh.train: -> Running"),
        "first_step_s": round(first[0] - start, 2),
    }
    Path(spec["out"]).write_text(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


def _world(said: list[tuple[float, str]]) -> int | None:
    """The first world's ranks, from raymesh.train's -> Running line."""
    import re

    for _, message in said:
        if m := re.match(r"raymesh\.train: -> Running \((\d+) ranks", message):
            return int(m.group(1))
    return None


def measure(nodes: int, cpus: int, td: str, timeout: float) -> dict[str, Any]:
    out = os.path.join(td, f"{nodes}x{cpus}.json")
    spec = {"nodes": nodes, "cpus": cpus, "out": out}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAYMESH_"))}
    env.update(RAYMESH_WARM_PROCS="0", RAYMESH_RUNTIME="0")
    t = time.time()
    code = run_isolated([sys.executable, __file__, "--child", json.dumps(spec)], env, timeout)
    if code != 0 or not os.path.exists(out):
        took = round(time.time() - t, 1)
        return {"nodes": nodes, "cpus_per_node": cpus, "error": f"exit {code} after {took} s"}
    got: dict[str, Any] = json.loads(Path(out).read_text())
    log(f"{nodes} node(s) x {cpus} CPU: {got}")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="4,8,16", help="simulated host counts (default 4,8,16)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child))
    counts = [int(x) for x in args.hosts.split(",")]
    load0 = os.getloadavg()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as td:
        for n in counts:
            world = min(n, WORKERS[1])
            many = measure(n, 1, td, args.timeout)
            one = measure(1, world, td, args.timeout)
            ratio = (
                round(many["first_step_s"] / one["first_step_s"], 2)
                if "first_step_s" in many and "first_step_s" in one
                else None
            )
            rows[str(n)] = {"hosts": many, "one_host": one, "first_step_over_one_host": ratio}
    firsts = {n: r["hosts"].get("first_step_s") for n, r in rows.items()}
    report = {
        "bench": "train_hosts",
        "job": f"raymesh.examples.mlp, workers={WORKERS}, {STEPS} steps, warm procs off",
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load0],
        "rows": rows,
        "first_step_s_by_hosts": firsts,
        "target": "first step within 2x the same job on one host; grows at most linearly",
        "within_2x": {n: (r["first_step_over_one_host"] or 99) <= 2.0 for n, r in rows.items()},
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(report))
    if not args.no_save:
        RESULTS.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
