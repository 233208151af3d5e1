"""`raymesh run [--nproc-per-node N] [--nnodes N] [--max-restarts K] script.py [args...]`: a
torchrun script, unchanged, on a proc mesh (`raymesh.spmd.launch`); torchrun's own flags where
they mean something here, with `-m module` as torchrun's. A rank that fails stops the attempt,
and up to `--max-restarts` times the group starts again; the exit status is 0 when an attempt
succeeded, 1 (with each rank's failure on one line) when none did. torchrun's rendezvous flags
are refused by name: raymesh rendezvous at rank 0's proc itself."""

from __future__ import annotations

import argparse
from typing import Any

from raymesh.cli import errors

__all__ = ["add_parser", "run"]

# torchrun flags that have no meaning here, and what to do instead.
_REFUSED = {
    "rdzv_backend": "raymesh rendezvous at rank 0's proc by itself; drop it",
    "rdzv_endpoint": "raymesh rendezvous at rank 0's proc by itself; drop it",
    "rdzv_id": "raymesh rendezvous at rank 0's proc by itself; drop it",
    "master_addr": "rank 0's proc is the master; drop it",
    "master_port": "rank 0's proc chooses and keeps the port; drop it",
    "node_rank": "one `raymesh run` starts every node's ranks; run it once, not per node",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run a torchrun script unchanged on a proc mesh")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="hosts of the cluster")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K")
    p.add_argument("--timeout", type=float, default=86400.0, metavar="S", help="per attempt")
    p.add_argument("--standalone", action="store_true", help="accepted, as torchrun's")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    for name in _REFUSED:
        p.add_argument(
            "--" + name.replace("_", "-"), "--" + name, dest=name, help=argparse.SUPPRESS
        )
    p.add_argument("script", help="the script (or, with -m, the module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    return errors.run("run", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from raymesh import spmd

    for name, instead in _REFUSED.items():
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')}: {instead}")
    script = (["-m", args.script] if args.module else [args.script]) + list(args.args)
    try:
        attempts = spmd.launch(
            script,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
        )
    except spmd.SPMDError as e:
        return errors.say("run", e, errors.FAILED)
    if len(attempts) > 1:
        print(f"raymesh run: succeeded at attempt {len(attempts)}")
    return 0
