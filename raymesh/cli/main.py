"""`raymesh`: the command line.

    raymesh --version
    raymesh info [--json]      Ray address, hosts with their CPUs/GPUs, versions

`info` connects like any raymesh program: to RAYMESH_ADDRESS or RAY_ADDRESS when set, else it
starts the embedded local Ray (and stops it again on exit).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from raymesh._version import __version__


def _info() -> dict[str, Any]:
    import ray
    import torch

    from raymesh._src import backend

    backend.ensure_ray()
    return {
        "raymesh": __version__,
        "ray": ray.__version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "address": "local (started by raymesh)" if backend.started_local() else backend.address(),
        "hosts": [
            {
                "node_id": n.node_id,
                "ip": n.ip,
                "hostname": n.hostname,
                "cpus": n.cpus,
                "gpus": n.gpus,
                "memory_gib": round(n.memory_bytes / 2**30, 1),
            }
            for n in backend.nodes()
        ],
    }


def _print_info(info: dict[str, Any]) -> None:
    print(f"raymesh {info['raymesh']}  ray {info['ray']}  torch {info['torch']}")
    print(f"Ray address: {info['address']}")
    print(f"{'host':<20} {'ip':<16} {'CPUs':>6} {'GPUs':>5} {'memory':>10}  node id")
    for h in info["hosts"]:
        print(
            f"{h['hostname'][:20]:<20} {h['ip']:<16} {h['cpus']:>6g} {h['gpus']:>5g} "
            f"{h['memory_gib']:>7.1f} GiB  {h['node_id'][:12]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raymesh", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"raymesh {__version__}")
    sub = parser.add_subparsers(dest="command")
    info = sub.add_parser("info", help="show the Ray cluster raymesh would use, and versions")
    info.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
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
