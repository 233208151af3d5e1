"""`raymesh up` / `status` / `down`: the local runtime that programs attach to (a Ray head and
warm procs that outlive them; raymesh.cluster.up)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from raymesh.cli import errors

__all__ = ["add_parsers", "run"]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("up", help="start the local runtime programs attach to (Ray + warm procs)")
    p.add_argument("--cpus", type=int, help="Ray's logical CPUs (default: max(64, cores))")
    p.add_argument("--warm", type=int, help="warm procs it keeps (default: RAYMESH_WARM_PROCS, 8)")
    s = sub.add_parser("status", help="show the local runtime: address, uptime, procs, programs")
    s.add_argument("--json", action="store_true", help="print JSON for machines")
    sub.add_parser("down", help="stop the local runtime (exactly the processes it started)")


def run(args: argparse.Namespace) -> int:
    from raymesh import cluster

    try:
        return errors.run(
            args.command, lambda: _run(args), mistakes=(ValueError, cluster.RuntimeDirError)
        )
    except cluster.RuntimeStartError as e:
        return errors.say(args.command, e, errors.FAILED)


def _run(args: argparse.Namespace) -> int:
    from raymesh import cluster

    if args.command == "up":
        done = cluster.up(cpus=args.cpus, warm=args.warm, preload=("raymesh.train",))
        r = done.record
        if not done.started:
            print(f"raymesh: a runtime is up already at {r.address} (pid {r.pid}); nothing started")
        else:
            print(
                f"raymesh: runtime up at {r.address} (pid {r.pid}, {r.cpus} logical CPUs, "
                f"{r.warm} warm procs); programs on this machine attach to it. "
                "`raymesh down` stops it"
            )
        return 0
    if args.command == "down":
        stopped = cluster.down()
        if stopped is None:
            print("raymesh: no runtime is up; nothing to stop")
        else:
            print(f"raymesh: stopped the runtime at {stopped.address} (pid {stopped.pid})")
        return 0
    info = cluster.status()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    if info is None:
        print("raymesh: no runtime is up (`raymesh up` starts one)")
        return 0
    warm = info.get("warm_procs")
    warm_text = "off" if not warm else f"{warm['ready']} ready of {warm['size']}"
    if warm:
        warm_text += f", {warm['claimed']} adopted so far"
    programs = info.get("programs", [])
    print(f"runtime   {info['address']} (pid {info['pid']}), up {info['uptime']}")
    print(f"versions  raymesh {info['raymesh']}, ray {info['ray']}")
    print(f"CPUs      {info['cpus']} logical")
    gib = info["memory_bytes"] / 2**30
    print(f"memory    {gib:.2f} GiB resident in {info['processes']} processes")
    print(f"warm      {warm_text}")
    pids = ", ".join(str(p["pid"]) for p in programs) or "none"
    print(f"programs  {len(programs)} attached (pids: {pids})")
    print(f"log       {info['log']}")
    return 0
