"""Federated rounds: raymesh.federated (with secure aggregation) against the anchors, in one run.

The task of ../shared/anchors/fedavg_ray_plain.py and flower_sim.py (raymesh.examples.fedmlp:
100 clients, Dirichlet 0.5, MLP 20-64-64-10, one local epoch, FedAvg, 5 rounds, the anchors'
client sampling and shuffle seeds), at 10 % and 100 % participation; raymesh with secure
aggregation (the figure the targets compare) and without it (where the time goes). Each
repeat of each side is a fresh process (cold start), interleaved. Then raymesh alone: 10,000
simulated clients at 1 %, and 4 edge clients over HTTP (each a process of its own, `python
edge/device.py`, no Ray).

    python bench/federated.py [--repeats 3] [--flower-python /path/to/flwr-venv/bin/python]

Flower 1.42 pins ray 2.55.1, so it runs from its own venv (`--flower-python`, default
$FLOWER_PYTHON); without one, Flower's published figures are shown, marked as such.
start_s: process start -> the first client's training; steady_round_s: median of rounds 2-5.
Prints one JSON line.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ANCHORS = REPO.parent / "shared" / "anchors"
PUBLISHED_FLOWER = {  # the figures (Flower 1.42, this task, a quiet 2-core machine)
    0.1: {"steady_round_s": 0.27, "start_s": 16.7},
    1.0: {"steady_round_s": 1.46, "start_s": 16.7},
}


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# --- the raymesh side, in a child process --------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import numpy as np

    from raymesh import federated as fl
    from raymesh.examples import fedmlp

    class AnchorSampling(fl.FedAvg):
        """The anchors' clients per round: default_rng(100 + round), k = round(p * n)."""

        def sample(self, round_, clients, seed=0):
            k = max(1, round(self.fraction * len(clients)))
            rng = np.random.default_rng(100 + round_)
            return sorted(rng.choice(len(clients), k, replace=False).tolist())

    marker = Path(args.marker)
    rounds: list[float] = []
    accs: list[float] = []
    edge_procs = []
    options: dict = {"hosts": args.hosts}
    if args.edge:
        port = _free_port()
        token = "bench-edge-token"
        options["edge"] = fl.EdgeConfig(port=port, token=token, wait_for=args.edge)
        script = (
            "import sys, runpy; sys.modules['ray'] = None; "
            f"sys.argv = ['device.py', '--server', 'http://127.0.0.1:{port}', '--token', "
            f"'{token}', '--client', 'raymesh/examples/fedmlp.py:client_fn', '--threads', '1']; "
            "runpy.run_path('raymesh/federated/edge/device.py', run_name='__main__')"
        )
        edge_procs = [
            subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.DEVNULL)
            for _ in range(args.edge)
        ]
    result = fl.run(
        _marking(marker),
        AnchorSampling(fraction=args.participation, min_clients=1),
        clients=args.clients,
        rounds=args.rounds,
        secure_aggregation=not args.plain,
        evaluate_fn=fedmlp.evaluate,
        on_round=lambda r: (rounds.append(r.seconds), accs.append(r.metrics["accuracy"])),
        **options,
    )
    for p in edge_procs:
        p.wait(timeout=60)
    first_fit = float(marker.read_text()) if marker.exists() else float("nan")
    print(
        json.dumps(
            {
                "start_s": first_fit - T_START,
                "round_s": rounds,
                "acc": accs,
                "responded": [r.responded for r in result.history],
                "total_s": time.time() - T_START,
            }
        )
    )


def _marking(marker: Path):
    """fedmlp's client_fn whose clients stamp the first training's start into `marker`."""
    from functools import partial

    return partial(_marked_client, str(marker))


def _marked_client(marker: str, cid: int):
    from raymesh.examples import fedmlp

    client = fedmlp.client_fn(cid)
    train = client.train_fn

    def stamped(model, data, config):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, repr(time.time()).encode())
            os.close(fd)
        return train(model, data, config)

    client.train_fn = stamped
    return client


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the parent ------------------------------------------------------------------------------


def run_child(cmd: list[str], timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if p.returncode != 0:
        log(p.stderr[-3000:])
        raise RuntimeError(f"child failed rc={p.returncode}: {' '.join(cmd)}")
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def raymesh_child(p: float, rounds: int, hosts: int, **extra: object) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--child", "--participation", str(p)]
        cmd += ["--rounds", str(rounds), "--hosts", str(hosts), "--marker", f"{tmp}/first"]
        for k, v in extra.items():
            cmd += [f"--{k}"] if v is True else [f"--{k}", str(v)]
        return run_child(cmd)


def anchor_child(python: str, script: str, p: float, rounds: int) -> dict:
    cmd = [python, str(ANCHORS / script), "--child", "--rounds", str(rounds)]
    return run_child([*cmd, "--participation", str(p)])


def summary(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "steady_round_s": round(med([med(r["round_s"][1:]) for r in runs]), 4),
        "start_s": round(med([r["start_s"] for r in runs]), 2),
        "final_acc": round(med([r["acc"][-1] for r in runs]), 4),
        "runs": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--marker", default="")
    ap.add_argument("--plain", action="store_true", help="child: no secure aggregation")
    ap.add_argument("--edge", type=int, default=0, help="child: this many edge clients")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flower-python", default=os.environ.get("FLOWER_PYTHON"))
    args = ap.parse_args()
    if args.child:
        return child(args)

    load_start = os.getloadavg()
    out: dict = {"bench": "federated", "loadavg_start": [round(x, 2) for x in load_start]}
    for p in (0.1, 1.0):
        runs: dict[str, list[dict]] = {
            "raymesh": [],
            "raymesh_no_secagg": [],
            "ray_plain": [],
            "flower": [],
        }
        for rep in range(args.repeats):
            runs["raymesh"].append(raymesh_child(p, args.rounds, args.hosts))
            runs["raymesh_no_secagg"].append(raymesh_child(p, args.rounds, args.hosts, plain=True))
            runs["ray_plain"].append(
                anchor_child(sys.executable, "fedavg_ray_plain.py", p, args.rounds)
            )
            if args.flower_python:
                runs["flower"].append(
                    anchor_child(args.flower_python, "flower_sim.py", p, args.rounds)
                )
            log(
                f"p={p} rep {rep}: "
                + ", ".join(
                    f"{k} round {statistics.median(v[-1]['round_s'][1:]):.3f} s "
                    f"start {v[-1]['start_s']:.1f} s acc {v[-1]['acc'][-1]:.3f}"
                    for k, v in runs.items()
                    if v
                )
            )
        figures = {k: summary(v) for k, v in runs.items() if v}
        flower = figures.get("flower") or {
            **PUBLISHED_FLOWER[p],
            "final_acc": None,
            "published": True,
        }
        figures["flower"] = flower
        mine = figures["raymesh"]
        figures["rounds_per_s_over_flower"] = round(
            flower["steady_round_s"] / mine["steady_round_s"], 2
        )
        figures["start_over_flower"] = round(mine["start_s"] / flower["start_s"], 2)
        if flower.get("final_acc") is not None:
            figures["acc_minus_flower"] = round(mine["final_acc"] - flower["final_acc"], 4)
        out[f"p{p}"] = figures
    big = raymesh_child(0.01, args.rounds, args.hosts, clients=10_000)
    out["clients_10000_p0.01"] = {
        "steady_round_s": round(statistics.median(big["round_s"][1:]), 4),
        "clients_per_round": big["responded"][-1],
        "start_s": round(big["start_s"], 2),
    }
    edge = raymesh_child(1.0, args.rounds, 1, clients=0, edge=4)
    out["edge_4_over_http"] = {
        "steady_round_s": round(statistics.median(edge["round_s"][1:]), 4),
        "responded": edge["responded"],
        "final_acc": round(edge["acc"][-1], 4),
    }
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
