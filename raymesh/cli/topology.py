"""`raymesh topology`: the cluster's hosts, GPUs, link matrix and measured network.

    raymesh topology                     a table for people
    raymesh topology --json              `Topology.to_dict()`, for machines
    raymesh topology --probe-timeout 30  allow the probes longer (large or busy clusters)

It connects like any raymesh program: to RAYMESH_ADDRESS or RAY_ADDRESS when set, else it
starts the embedded local Ray (and stops it again on exit).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from raymesh.cli import errors

if TYPE_CHECKING:
    from raymesh.topology import Host, Link, Topology

_GIB = 1 << 30
# Said wherever a host shows more of Ray's logical CPUs than it has cores (the embedded Ray).
SLOTS_NOTE = (
    "CPU slots are Ray's logical CPUs: each proc reserves one. The local Ray raymesh starts "
    "offers at least 64, so that meshes of many procs can start on a small machine; they share "
    "its cores. Size a job by cores, not slots."
)


def add_parser(sub: Any) -> None:
    """Register the `topology` subcommand on `raymesh`'s subparsers."""
    p = sub.add_parser(
        "topology", help="show hosts, GPUs, the GPU link matrix and measured network figures"
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="seconds the probes may take in all (default 15); unmeasured links are marked",
    )


def run(args: argparse.Namespace) -> int:
    return errors.run("topology", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from raymesh import cluster, topology

    if not args.probe_timeout > 0:
        raise ValueError(f"--probe-timeout {args.probe_timeout:g}: give a number of seconds > 0")
    cluster.ensure_ray()  # connect first, so that the time shown is discovery's own
    start = time.monotonic()
    topo = topology.discover(probe_timeout=args.probe_timeout)
    took = time.monotonic() - start
    if args.json:
        print(json.dumps(topo.to_dict(), indent=1))
    else:
        print(render(topo, took))
    return 0


def render(topo: Topology, took: float | None = None) -> str:
    """The topology as text: hosts, each host's GPUs and link matrix, the network, notes."""
    n_gpus = topo.num_devices
    lines = [
        f"raymesh topology: {len(topo.hosts)} host(s), {n_gpus} GPU(s)"
        + (f", discovered in {took:.1f}s" if took is not None else "")
        + "  (~ marks a nominal figure, not measured)",
        "",
        f"{'host':<16} {'ip':<16} {'cores':>5} {'CPU slots':>9} {'GPUs':>5} {'memory':>10} "
        f"{'sockets':>7} {'NUMA':>4}  node id",
    ]
    for h in topo.hosts:
        sockets = "-" if h.sockets is None else str(h.sockets)
        cores = "-" if h.cores is None else str(h.cores)
        lines.append(
            f"{h.name[:16]:<16} {h.ip[:16]:<16} {cores:>5} {h.cpus:>9g} {h.gpus:>5g} "
            f"{h.memory_bytes / _GIB:>6.1f} GiB {sockets:>7} {len(h.numa_nodes):>4}  "
            f"{h.node_id[:12]}"
        )
    if any(h.cores is not None and h.cpus > h.cores for h in topo.hosts):
        lines.append(SLOTS_NOTE)
    for h in topo.hosts:
        lines += ["", *_host_lines(h)]
    lines += ["", *_network_lines(topo)]
    if topo.notes:
        lines += ["", "notes:", *(f"  - {n}" for n in topo.notes)]
    return "\n".join(lines)


def _host_lines(h: Host) -> list[str]:
    numa = "; ".join(
        f"node{n.index}: CPUs {n.cpus}"
        + ("" if n.memory_bytes is None else f", {n.memory_bytes / _GIB:.1f} GiB")
        for n in h.numa_nodes
    )
    head = f"{h.name}: " + (f"{len(h.devices)} GPU(s)" if h.devices else "no GPUs")
    out = [head + (f"; NUMA {numa}" if numa else "")]
    if not h.devices:
        return out
    for d in h.devices:
        mem = "? GiB" if d.memory_bytes is None else f"{d.memory_bytes / _GIB:.1f} GiB"
        extra = "  (from Ray's GPU resource)" if d.source == "ray" else f"  {d.pci_bus_id}"
        out.append(f"  GPU{d.index:<3} {d.name[:28]:<28} {mem:>10}{extra}".rstrip())
    # the matrix, as `nvidia-smi topo -m` prints it
    width = max(6, *(len(k.kind) + 2 for row in h.links for k in row))
    names = [f"GPU{d.index}" for d in h.devices]
    out.append("  " + " " * 7 + "".join(f"{n:>{width}}" for n in names) + "  CPU affinity  NUMA")
    for d, name, row in zip(h.devices, names, h.links):
        numa_node = "-" if d.numa_node is None else str(d.numa_node)
        out.append(
            f"  {name:<7}"
            + "".join(f"{link.kind:>{width}}" for link in row)
            + f"  {d.cpu_affinity or '-':<12}  {numa_node}"
        )
    islands = [i for i in h.islands() if len(i) > 1]
    if islands:
        out.append(
            "  NVLink islands: "
            + " ".join("{" + ",".join(f"GPU{h.devices[p].index}" for p in i) + "}" for i in islands)
        )
    return out


def _fmt(link: Link) -> str:
    mark = "" if link.measured else "~"
    return f"{mark}{link.latency * 1e6:.0f}us {mark}{link.bandwidth / 1e9:.3g}GB/s"


def _network_lines(topo: Topology) -> list[str]:
    names = [h.name[:14] for h in topo.hosts]
    cells = [[_fmt(link) for link in row] for row in topo.network]
    width = max(16, *(len(c) + 2 for row in cells for c in row), *(len(n) + 2 for n in names))
    out = ["network (one-way latency, bandwidth; the diagonal is a host's own object store):"]
    out.append(" " * 16 + "".join(f"{n:>{width}}" for n in names))
    for name, row in zip(names, cells):
        out.append(f"{name:<16}" + "".join(f"{c:>{width}}" for c in row))
    return out
