"""What a cluster looks like, as plain frozen data: hosts, their devices, and the links between.

One module past 400 lines on purpose: hosts, devices, NUMA nodes, links and the topology are one
data model, nested in one another, checked against one link vocabulary (below) and round-tripped
through JSON together (`to_dict`/`from_dict` at every level).

A `Topology` is what `discover()` returns and what `plan()` reads. It is plain data on purpose:
tests build one by hand (`Host.gpu_box`, `Topology.of`), and `to_dict()`/`from_dict()` round-trip
it through JSON (what `raymesh topology --json` prints).

Links use `nvidia-smi topo -m`'s vocabulary inside a host, plus two kinds of our own:

    X      a device to itself
    NV<n>  joined by n NVLinks (directly, or through NVSwitches)
    PIX    at most one PCIe bridge between them
    PXB    several PCIe bridges, no host bridge
    PHB    through a PCIe host bridge (one CPU)
    NODE   across host bridges within one NUMA node
    SYS    across NUMA nodes (the CPUs' interconnect, e.g. UPI)
    NET    between two hosts (the network, as Ray's object transfer sees it)
    LOOP   a host to itself (procs of one host; the diagonal of `Topology.network`)

Every link carries a one-way bandwidth (bytes/s) and latency (s). A measured link says so
(`measured=True`); any other carries the nominal figure for its kind (`Link.nominal`), a rough
guide that ranks kinds in the right order rather than a promise about any one machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from raymesh._common import check_int

__all__ = ["Device", "Host", "Link", "NumaNode", "Topology"]

GIB = 1 << 30
NVLINK_BYTES_PER_S = 25e9  # one NVLink (gen 3/4), one direction
_KIND = re.compile(r"^(X|NV[1-9][0-9]*|PIX|PXB|PHB|NODE|SYS|NET|LOOP)$")
# (bandwidth bytes/s, latency s) by kind: PCIe 4 x16 peer-to-peer through ever more hops; a
# 100 Gb/s NIC between hosts; shared memory for procs of one host.
_NOMINAL: dict[str, tuple[float, float]] = {
    "X": (1e12, 0.0),
    "PIX": (24e9, 4e-6),
    "PXB": (20e9, 5e-6),
    "PHB": (16e9, 6e-6),
    "NODE": (12e9, 8e-6),
    "SYS": (8e9, 10e-6),
    "NET": (12.5e9, 25e-6),
    "LOOP": (20e9, 3e-6),
}
_NVLINK_LATENCY_S = 2e-6


def _check_kind(kind: str, where: str) -> None:
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise ValueError(
            f"{where}: kind={kind!r} is not a link kind. Fix: use one of X, NV<n> (e.g. NV4), "
            "PIX, PXB, PHB, NODE, SYS, NET, LOOP"
        )


@dataclass(frozen=True, kw_only=True)
class Link:
    """One direction of a connection: what it is, how fast, and whether that was measured."""

    kind: str  # see the module docstring: "X", "NV<n>", "PIX", ..., "SYS", "NET", "LOOP"
    bandwidth: float  # bytes per second, one direction
    latency: float  # seconds, one way
    measured: bool = False  # True: probes timed it; False: the nominal figure for its kind

    def __post_init__(self) -> None:
        _check_kind(self.kind, "Link")
        if not self.bandwidth > 0:
            raise ValueError(f"Link({self.kind}): bandwidth={self.bandwidth!r} must be > 0 B/s")
        if not self.latency >= 0:
            raise ValueError(f"Link({self.kind}): latency={self.latency!r} must be >= 0 s")

    @classmethod
    def nominal(cls, kind: str) -> Link:
        """The textbook figure for `kind` (NV<n>: n x 25 GB/s), marked as not measured."""
        _check_kind(kind, "Link.nominal")
        if kind.startswith("NV"):
            n = int(kind[2:])
            return cls(kind=kind, bandwidth=n * NVLINK_BYTES_PER_S, latency=_NVLINK_LATENCY_S)
        bandwidth, latency = _NOMINAL[kind]
        return cls(kind=kind, bandwidth=bandwidth, latency=latency)

    @property
    def nvlinks(self) -> int:
        """How many NVLinks join the two ends (0 when the link is not NVLink)."""
        return int(self.kind[2:]) if self.kind.startswith("NV") else 0

    def describe(self) -> str:
        """E.g. 'NV4 100 GB/s 2us' ('~' marks a nominal, unmeasured figure)."""
        mark = "" if self.measured else "~"
        return f"{self.kind} {mark}{self.bandwidth / 1e9:.3g} GB/s {mark}{self.latency * 1e6:.3g}us"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "measured": self.measured,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        return cls(
            kind=d["kind"],
            bandwidth=float(d["bandwidth"]),
            latency=float(d["latency"]),
            measured=bool(d.get("measured", False)),
        )


@dataclass(frozen=True, kw_only=True)
class Device:
    """One GPU of a host."""

    index: int  # NVML index on its host (the CUDA ordinal when CUDA_VISIBLE_DEVICES is unset)
    name: str  # product name, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int | None  # total device memory; None when unknown (source "ray")
    pci_bus_id: str = ""  # e.g. "0000:07:00.0"
    uuid: str = ""
    numa_node: int | None = None  # the NUMA node closest to the device (None: unknown)
    cpu_affinity: str = ""  # the CPUs closest to the device, as a cpulist ("0-31,64-95")
    source: str = "nvml"  # "nvml": read on its host; "ray": only Ray's GPU count said so

    def __post_init__(self) -> None:
        check_int("Device: index", self.index, 0)
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise ValueError(f"Device {self.index}: memory_bytes={self.memory_bytes!r} is < 0")
        if self.source not in ("nvml", "ray"):
            raise ValueError(f"Device {self.index}: source={self.source!r}; use 'nvml' or 'ray'")

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "pci_bus_id": self.pci_bus_id,
            "uuid": self.uuid,
            "numa_node": self.numa_node,
            "cpu_affinity": self.cpu_affinity,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Device:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True, kw_only=True)
class NumaNode:
    """One NUMA node of a host: its CPUs and memory."""

    index: int
    cpus: str  # cpulist, e.g. "0-15,32-47"
    memory_bytes: int | None = None  # None: unknown

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "cpus": self.cpus, "memory_bytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NumaNode:
        return cls(index=d["index"], cpus=d["cpus"], memory_bytes=d.get("memory_bytes"))


@dataclass(frozen=True, kw_only=True)
class Host:
    """One Ray node: what Ray says of it, plus what its own hardware says.

    Guarantees: `links` is a len(devices) square matrix whose diagonal is "X" and whose
    off-diagonal entries are device-to-device kinds (NV<n>, PIX, ..., SYS); device indexes are
    distinct. The planner refers to a device by its position in `devices`, and reports its
    `index`.
    """

    node_id: str  # Ray node id
    hostname: str = ""
    ip: str = ""
    cpus: float = 0.0  # Ray's logical CPUs
    gpus: float = 0.0  # Ray's GPU resource (may differ from len(devices): see discovery)
    memory_bytes: float = 0.0  # Ray's memory resource
    labels: Mapping[str, str] = field(default_factory=dict)  # Ray node labels
    resources: Mapping[str, float] = field(default_factory=dict)  # all of Ray's resources
    devices: tuple[Device, ...] = ()
    links: tuple[tuple[Link, ...], ...] = ()  # devices x devices, like `nvidia-smi topo -m`
    sockets: int | None = None  # CPU packages (None: unknown)
    numa_nodes: tuple[NumaNode, ...] = ()
    cpu_affinity: str = ""  # CPUs a process on this host may run on (cpulist)

    def __post_init__(self) -> None:
        where = f"Host {self.node_id[:12]!r}"
        if not self.node_id:
            raise ValueError("Host: node_id='' must name the host (its Ray node id)")
        n = len(self.devices)
        if len(self.links) != n or any(len(row) != n for row in self.links):
            raise ValueError(
                f"{where}: links must be a {n}x{n} matrix (one row and column per device), got "
                f"{[len(r) for r in self.links]}. Fix: build it with Host.gpu_box or give one "
                "Link per pair of devices"
            )
        indexes = [d.index for d in self.devices]
        if len(set(indexes)) != n:
            raise ValueError(f"{where}: device indexes {indexes} repeat; each must be distinct")
        for i, row in enumerate(self.links):
            for j, link in enumerate(row):
                if (i == j) != (link.kind == "X"):
                    raise ValueError(
                        f"{where}: links[{i}][{j}].kind={link.kind!r}; the diagonal (and only "
                        "the diagonal) must be 'X'"
                    )
                if link.kind in ("NET", "LOOP"):
                    raise ValueError(
                        f"{where}: links[{i}][{j}].kind={link.kind!r} is a host-level kind; "
                        "devices of one host are joined by NV<n>, PIX, PXB, PHB, NODE or SYS"
                    )

    @property
    def cores(self) -> int | None:
        """The CPUs a process on this host may run on (`cpu_affinity` counted), None when
        unknown. Ray's logical CPUs (`cpus`) can be many more: each is a slot a proc
        reserves, not a core."""
        if not self.cpu_affinity:
            return None
        count = 0
        for part in self.cpu_affinity.split(","):
            low, _, high = part.partition("-")
            count += int(high or low) - int(low) + 1
        return count

    @property
    def name(self) -> str:
        """A short name for people: the `raymesh.io/host` label, else hostname, else node id."""
        return self.labels.get("raymesh.io/host") or self.hostname or self.node_id[:12]

    def islands(self) -> list[list[int]]:
        """Positions of devices joined by NVLink (connected components), largest first.

        A device with no NVLink is an island of one. Order within an island is by position.
        """
        seen: set[int] = set()
        out = []
        for start in range(len(self.devices)):
            if start in seen:
                continue
            stack, comp = [start], []
            seen.add(start)
            while stack:
                i = stack.pop()
                comp.append(i)
                for j, link in enumerate(self.links[i]):
                    if j not in seen and link.nvlinks:
                        seen.add(j)
                        stack.append(j)
            out.append(sorted(comp))
        out.sort(key=lambda c: (-len(c), c[0]))
        return out

    @classmethod
    def gpu_box(
        cls,
        node_id: str,
        *,
        gpus: int = 8,
        islands: Sequence[Sequence[int]] | None = None,
        nvlinks: int = 12,
        between: str = "SYS",
        memory_bytes: int | Sequence[int] = 80 * GIB,
        name: str = "GPU",
        cpus: float = 64.0,
        **host_fields: Any,
    ) -> Host:
        """A synthetic GPU host, for tests and what-if plans.

        islands: groups of device positions joined by `nvlinks` NVLinks each (default: all of
        them in one island); pairs in different islands are joined by `between` (e.g. "PHB",
        "SYS"). memory_bytes: one figure for all devices, or one per device.
        """
        if islands is None:
            islands = [list(range(gpus))]
        island_of = {d: k for k, isl in enumerate(islands) for d in isl}
        if sorted(island_of) != list(range(gpus)) or sum(map(len, islands)) != gpus:
            raise ValueError(
                f"Host.gpu_box: islands={[list(i) for i in islands]} must cover each of the "
                f"{gpus} device positions exactly once"
            )
        mems = [memory_bytes] * gpus if isinstance(memory_bytes, int) else list(memory_bytes)
        if len(mems) != gpus:
            raise ValueError(f"Host.gpu_box: {len(mems)} memory_bytes for gpus={gpus} devices")
        nv, other, self_link = (
            Link.nominal(f"NV{nvlinks}"),
            Link.nominal(between),
            Link.nominal("X"),
        )
        links = tuple(
            tuple(
                self_link if i == j else nv if island_of[i] == island_of[j] else other
                for j in range(gpus)
            )
            for i in range(gpus)
        )
        devices = tuple(
            Device(index=i, name=name, memory_bytes=mems[i], source="nvml") for i in range(gpus)
        )
        return cls(
            node_id=node_id,
            hostname=host_fields.pop("hostname", node_id),
            cpus=cpus,
            gpus=float(gpus),
            devices=devices,
            links=links,
            **host_fields,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "ip": self.ip,
            "cpus": self.cpus,
            "gpus": self.gpus,
            "memory_bytes": self.memory_bytes,
            "labels": dict(self.labels),
            "resources": dict(self.resources),
            "devices": [d.to_dict() for d in self.devices],
            "links": [[link.to_dict() for link in row] for row in self.links],
            "sockets": self.sockets,
            "numa_nodes": [n.to_dict() for n in self.numa_nodes],
            "cpu_affinity": self.cpu_affinity,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Host:
        return cls(
            node_id=d["node_id"],
            hostname=d.get("hostname", ""),
            ip=d.get("ip", ""),
            cpus=float(d.get("cpus", 0.0)),
            gpus=float(d.get("gpus", 0.0)),
            memory_bytes=float(d.get("memory_bytes", 0.0)),
            labels=dict(d.get("labels", {})),
            resources=dict(d.get("resources", {})),
            devices=tuple(Device.from_dict(x) for x in d.get("devices", ())),
            links=tuple(tuple(Link.from_dict(x) for x in row) for row in d.get("links", ())),
            sockets=d.get("sockets"),
            numa_nodes=tuple(NumaNode.from_dict(x) for x in d.get("numa_nodes", ())),
            cpu_affinity=d.get("cpu_affinity", ""),
        )


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Hosts and the network between them.

    Guarantees: node ids are distinct; `network` is a len(hosts) square matrix whose diagonal
    is "LOOP" (procs of one host) and whose other entries are "NET". `notes` says what discovery
    could not see (no NVML, a probe that ran out of time), so an unmeasured figure is never
    mistaken for a measured one.
    """

    hosts: tuple[Host, ...]
    network: tuple[tuple[Link, ...], ...]  # hosts x hosts, network[a][b]: from host a to b
    notes: tuple[str, ...] = ()  # what discovery could not see, for people
    measured_at: float | None = None  # unix time of the measurement (None: synthetic)

    def __post_init__(self) -> None:
        ids = [h.node_id for h in self.hosts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"Topology: node ids repeat: {ids}; each host must be distinct")
        n = len(self.hosts)
        if len(self.network) != n or any(len(row) != n for row in self.network):
            raise ValueError(
                f"Topology: network must be a {n}x{n} matrix (one row and column per host). "
                "Fix: build it with Topology.of(hosts, links=...)"
            )
        for a, row in enumerate(self.network):
            for b, link in enumerate(row):
                want = "LOOP" if a == b else "NET"
                if link.kind != want:
                    raise ValueError(
                        f"Topology: network[{a}][{b}].kind={link.kind!r}; it must be {want!r} "
                        "(LOOP on the diagonal, NET between hosts)"
                    )

    @classmethod
    def of(
        cls,
        hosts: Iterable[Host],
        *,
        links: Mapping[tuple[str, str], Link] | None = None,
        default: Link | None = None,
        notes: Sequence[str] = (),
    ) -> Topology:
        """Hosts joined by `default` (nominal NET unless given), except the pairs in `links`.

        links: {(node_a, node_b): Link} applies to both directions; a Link of kind NET.
        """
        hosts = tuple(hosts)
        default = default or Link.nominal("NET")
        loop = Link.nominal("LOOP")
        pos = {h.node_id: i for i, h in enumerate(hosts)}
        matrix = [[loop if a == b else default for b in range(len(hosts))] for a in pos.values()]
        for (x, y), link in (links or {}).items():
            if x not in pos or y not in pos:
                raise ValueError(f"Topology.of: links names ({x!r}, {y!r}); not both are hosts")
            matrix[pos[x]][pos[y]] = matrix[pos[y]][pos[x]] = link
        return cls(hosts=hosts, network=tuple(tuple(r) for r in matrix), notes=tuple(notes))

    def host(self, node_id: str) -> Host:
        for h in self.hosts:
            if h.node_id == node_id:
                return h
        raise KeyError(f"no host with node id {node_id!r}")

    @property
    def num_devices(self) -> int:
        return sum(len(h.devices) for h in self.hosts)

    def with_notes(self, *notes: str) -> Topology:
        return replace(self, notes=self.notes + notes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (plain dicts, lists, str, numbers, bool, None); `from_dict` inverts it."""
        return {
            "hosts": [h.to_dict() for h in self.hosts],
            "network": [[link.to_dict() for link in row] for row in self.network],
            "notes": list(self.notes),
            "measured_at": self.measured_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        return cls(
            hosts=tuple(Host.from_dict(h) for h in d["hosts"]),
            network=tuple(tuple(Link.from_dict(x) for x in row) for row in d["network"]),
            notes=tuple(d.get("notes", ())),
            measured_at=d.get("measured_at"),
        )
