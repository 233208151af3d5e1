"""`raymesh`: the command line.

    raymesh --version
    raymesh up [--cpus N] [--warm N] / raymesh status [--json] / raymesh down
                               the local runtime: a Ray head and warm procs that programs on
                               this machine attach to (each starts in about a second)
    raymesh info [--json]      Ray address, hosts with their CPUs/GPUs, versions
    raymesh topology [--json] [--probe-timeout S]
                               hosts, GPUs, the GPU link matrix, measured network figures
    raymesh train JOB.toml [--inject kill:rank=1:step=100] [--resume] [--steps N] [--dashboard]
                               run a training job (TrainConfig as TOML) with a progress bar,
                               and with --dashboard its web page, live (the URL is printed)
    raymesh dashboard RUNS/    a web page of the run folders under RUNS/, live and afterwards
    raymesh tune JOB.toml      a hyperparameter study over training jobs
    raymesh serve JOB.toml [--checkpoint DIR] [--replicas 1:4] [--port 8000]
                               serve the trained model over HTTP; `serve reload --checkpoint
                               NEW` rolls a running server to a new checkpoint; `serve --hf
                               FOLDER` serves a Hugging Face folder
    raymesh export RUN --hf OUT [--merge] [--build module:function]
                               write a trained model as a Hugging Face folder (a LoRA adapter,
                               or with --merge base + adapter as one model)
    raymesh federated JOB.toml federated learning, a line per round
    raymesh federated client --server URL --token-file F --client module:fn
                               an edge client taking part in a federated run
    raymesh rl JOB.toml [--steps N]
                               post-train a policy with GRPO (a line per step)
    raymesh run [--nproc-per-node N] [--max-restarts K] script.py [args...]
                               a torchrun script, unchanged, on a proc mesh
    raymesh debug [list | attach MESH RANK | cast MESH 'ranks(0:4)' CMD | continue]
                               actors paused at breakpoint(): list them, attach to one's pdb,
                               send a pdb command to many; alone, an interactive prompt

`info` connects like any raymesh program: to RAYMESH_ADDRESS or RAY_ADDRESS when set, else to
the local runtime when one is up, else it starts the embedded local Ray (and stops it again on
exit); it says which.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from raymesh import __version__
from raymesh.cli import dashboard as dashboard_cli
from raymesh.cli import debug as debug_cli
from raymesh.cli import export as export_cli
from raymesh.cli import federated as federated_cli
from raymesh.cli import rl as rl_cli
from raymesh.cli import run as run_cli
from raymesh.cli import runtime as runtime_cli
from raymesh.cli import serve as serve_cli
from raymesh.cli import topology as topology_cli
from raymesh.cli import train as train_cli
from raymesh.cli import tune as tune_cli


def _info() -> dict[str, Any]:
    import torch

    from raymesh import cluster

    cluster.ensure_ray()
    here = cluster.current_node_id()
    return {
        "raymesh": __version__,
        "ray": cluster.ray_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "address": _where(cluster),
        "hosts": [
            {
                "node_id": n.node_id,
                "ip": n.ip,
                "hostname": n.hostname,
                # Cores known for the host this runs on (`raymesh topology` reads each
                # host's); CPU slots are Ray's logical CPUs, which procs reserve.
                "cores": len(os.sched_getaffinity(0)) if n.node_id == here else None,
                "cpu_slots": n.cpus,
                "gpus": n.gpus,
                "memory_gib": round(n.memory_bytes / 2**30, 1),
            }
            for n in cluster.nodes()
        ],
    }


def _where(cluster: Any) -> str:
    """Where this program attached: the embedded Ray, the local runtime, or an address."""
    if cluster.started_local():
        return "local (the embedded Ray, started by raymesh for this program)"
    record = cluster.attached()
    if record is not None:
        return f"{record.address} (the local runtime, `raymesh up`, pid {record.pid})"
    return cluster.address()


def _print_info(info: dict[str, Any]) -> None:
    print(f"raymesh {info['raymesh']}  ray {info['ray']}  torch {info['torch']}")
    print(f"Ray address: {info['address']}")
    print(
        f"{'host':<20} {'ip':<16} {'cores':>5} {'CPU slots':>9} {'GPUs':>5} {'memory':>10}  node id"
    )
    for h in info["hosts"]:
        cores = "?" if h["cores"] is None else str(h["cores"])
        print(
            f"{h['hostname'][:20]:<20} {h['ip']:<16} {cores:>5} {h['cpu_slots']:>9g} "
            f"{h['gpus']:>5g} {h['memory_gib']:>7.1f} GiB  {h['node_id'][:12]}"
        )
    if any(h["cores"] is not None and h["cpu_slots"] > h["cores"] for h in info["hosts"]):
        print(topology_cli.SLOTS_NOTE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raymesh", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"raymesh {__version__}")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="show the Ray cluster raymesh would use, and versions")
    info.add_argument("--json", action="store_true", help="print JSON for machines")
    runtime_cli.add_parsers(sub)
    train_cli.add_parser(sub)
    topology_cli.add_parser(sub)
    tune_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    export_cli.add_parser(sub)
    federated_cli.add_parser(sub)
    rl_cli.add_parser(sub)
    run_cli.add_parser(sub)
    dashboard_cli.add_parser(sub)
    debug_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("up", "status", "down"):
        return runtime_cli.run(args)
    if args.command == "topology":
        return topology_cli.run(args)
    if args.command == "tune":
        return tune_cli.run(args)
    if args.command == "serve":
        return serve_cli.run(args)
    if args.command == "export":
        return export_cli.run(args)
    if args.command == "federated":
        return federated_cli.run(args)
    if args.command == "dashboard":
        return dashboard_cli.run(args)
    if args.command == "debug":
        return debug_cli.run(args)
    if args.command == "rl":
        return rl_cli.run(args)
    if args.command == "run":
        return run_cli.run(args)
    if args.command == "train":
        return train_cli.run(args)
    if args.command == "info":
        data = _info()
        if args.json:
            print(json.dumps(data, indent=1))
        else:
            _print_info(data)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
