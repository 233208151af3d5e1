"""Discovery: the cluster as a `Topology`, from Ray, from each host's own hardware, and from
probe actors that time the network.

- Hosts: Ray's alive nodes (node id, IP, CPUs, GPUs, memory, labels, resources), the caller's
  node first.
- On each host (read there, by its probe actor): GPUs through NVML (`nvidia-ml-py`, imported
  lazily): name, memory, PCI bus, NUMA node, CPU affinity, NVLink peers and link counts, and
  the `nvidia-smi topo -m` matrix; CPU sockets and NUMA nodes from /sys and /proc.
- Between hosts: latency and bandwidth measured by probe actors (`raymesh.cluster.probe`),
  bounded by `probe_timeout` and cached for `ttl` seconds.

No NVML (not installed, no driver) means no GPUs read, said in `Topology.notes`, never an
error. A host whose Ray GPU resource exceeds what NVML saw there (a simulated node in a local
test cluster, or a host without NVML) gets that many GPUs of `source="ray"`, described by its
node labels when present:

    raymesh.io/host            a name for the host (nodes of a test cluster share a hostname)
    raymesh.io/gpu-name        e.g. "A100-80GB" (label values allow no spaces)
    raymesh.io/gpu-memory-gib  e.g. "80"
    raymesh.io/gpu-link        the link between any two of its GPUs, e.g. "NV12" (default SYS)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from raymesh.topology.model import GIB, Device, Host, Link, NumaNode, Topology

__all__ = ["discover", "local_facts", "read_cpus", "read_gpus"]

LABEL_HOST = "raymesh.io/host"
LABEL_GPU_NAME = "raymesh.io/gpu-name"
LABEL_GPU_MEMORY = "raymesh.io/gpu-memory-gib"
LABEL_GPU_LINK = "raymesh.io/gpu-link"
_DEVICE_KIND = re.compile(r"^(NV[1-9][0-9]*|PIX|PXB|PHB|NODE|SYS)$")


def discover(
    *, probe_timeout: float = 15.0, ttl: float = 60.0, payload_bytes: int = 4 << 20
) -> Topology:
    """The cluster raymesh is connected to (connecting as `ensure_ray` does), as a Topology.

    probe_timeout: seconds for the probes (start-up, hardware reads, every pair's timing);
        what did not finish is left nominal and named in `notes`. The call takes about this
        long at most, plus Ray's node listing.
    ttl: seconds a complete measurement of the same nodes is reused (0: measure again).
    payload_bytes: size of the object timed between each pair of hosts.
    """
    from raymesh import cluster  # here, not at the top: this module also runs in probes

    nodes = cluster.nodes()
    report = cluster.probe(
        [n.node_id for n in nodes],
        local_facts,
        timeout=probe_timeout,
        ttl=ttl,
        payload_bytes=payload_bytes,
    )
    notes = list(report.errors)
    hosts = [
        _host(
            node_id=n.node_id,
            hostname=n.hostname,
            ip=n.ip,
            cpus=n.cpus,
            gpus=n.gpus,
            memory_bytes=n.memory_bytes,
            labels=n.labels,
            resources=n.resources,
            facts=report.facts.get(n.node_id),
            notes=notes,
        )
        for n in nodes
    ]
    network = []
    unmeasured = 0
    for a, na in enumerate(nodes):
        row = []
        for b, nb in enumerate(nodes):
            if a == b:
                fig = report.loopback.get(na.node_id)
            else:
                fig = report.links.get((na.node_id, nb.node_id)) or report.links.get(
                    (nb.node_id, na.node_id)
                )
            kind = "LOOP" if a == b else "NET"
            if fig is None:
                unmeasured += a != b
                row.append(Link.nominal(kind))
            else:
                row.append(Link(kind=kind, latency=fig[0], bandwidth=fig[1], measured=True))
        network.append(tuple(row))
    if unmeasured:
        notes.append(
            f"{unmeasured // 2} host pair(s) not measured: nominal NET figures used. Fix: raise "
            "probe_timeout (raymesh topology --probe-timeout S)"
        )
    return Topology(
        hosts=tuple(hosts),
        network=tuple(network),
        notes=tuple(notes),
        measured_at=report.measured_at,
    )


def _host(
    *,
    facts: dict[str, Any] | None,
    notes: list[str],
    labels: dict[str, str],
    gpus: float,
    **ray_fields: Any,
) -> Host:
    """One Host from Ray's view of a node and the facts its probe read (None: not read)."""
    name = labels.get(LABEL_HOST) or ray_fields["hostname"] or ray_fields["node_id"][:12]
    facts = facts or {}
    devices = [Device.from_dict(d) for d in facts.get("gpus", ())]
    kinds: list[list[str]] = facts.get("gpu_links", [])
    if not facts:
        nvml_note = "its hardware was not read (see the probe's note)"
    else:
        nvml_note = facts.get("gpu_note") or f"NVML saw {len(devices)}"
    if len(devices) < int(gpus):
        devices, kinds = _ray_gpus(int(gpus), labels, name, notes, nvml_note)
    elif facts.get("gpu_note") and gpus >= 1:  # where Ray has no GPUs, "no NVML" is no news
        notes.append(f"host {name}: {nvml_note}")
    elif devices and len(devices) > gpus:
        notes.append(
            f"host {name}: NVML sees {len(devices)} GPUs but Ray offers {gpus:g}: the plan may "
            "use GPUs Ray will not hand out. Fix: start Ray there with every GPU (--num-gpus)"
        )
    return Host(
        labels=dict(labels),
        gpus=gpus,
        devices=tuple(devices),
        links=tuple(tuple(Link.nominal(k) for k in row) for row in kinds),
        sockets=facts.get("sockets"),
        numa_nodes=tuple(NumaNode.from_dict(x) for x in facts.get("numa_nodes", ())),
        cpu_affinity=facts.get("cpu_affinity", ""),
        **ray_fields,
    )


def _ray_gpus(
    n: int, labels: dict[str, str], name: str, notes: list[str], nvml_note: str
) -> tuple[list[Device], list[list[str]]]:
    """n GPUs known only from Ray's GPU resource, described by the node's labels."""
    memory: int | None = None
    if LABEL_GPU_MEMORY in labels:
        try:
            memory = int(float(labels[LABEL_GPU_MEMORY]) * GIB)
        except ValueError:
            notes.append(
                f"host {name}: label {LABEL_GPU_MEMORY}={labels[LABEL_GPU_MEMORY]!r} is not a "
                "number of GiB; GPU memory left unknown"
            )
    kind = labels.get(LABEL_GPU_LINK, "SYS")
    if not _DEVICE_KIND.match(kind):
        notes.append(
            f"host {name}: label {LABEL_GPU_LINK}={kind!r} is not a device link kind (NV<n>, "
            "PIX, PXB, PHB, NODE, SYS); SYS assumed"
        )
        kind = "SYS"
    notes.append(
        f"host {name}: {n} GPU(s) known from Ray's GPU resource only, described by node labels "
        f"(links assumed {kind}); {nvml_note}"
    )
    devices = [
        Device(index=i, name=labels.get(LABEL_GPU_NAME, "GPU"), memory_bytes=memory, source="ray")
        for i in range(n)
    ]
    kinds = [["X" if i == j else kind for j in range(n)] for i in range(n)]
    return devices, kinds


# -- on each host --------------------------------------------------------------------------------


def local_facts() -> dict[str, Any]:
    """This host's GPUs and CPUs, as plain JSON-able data (runs on every host, in its probe)."""
    devices, kinds, note = read_gpus()
    return {
        "gpus": [d.to_dict() for d in devices],
        "gpu_links": kinds,
        "gpu_note": note,
        **read_cpus(),
    }


def read_gpus() -> tuple[list[Device], list[list[str]], str | None]:
    """This host's GPUs through NVML: (devices, link kinds matrix, note).

    No GPUs (nvidia-ml-py not installed, no driver, NVML failing, or none there) gives
    ([], [], a note saying why); it never raises. The link kinds are `nvidia-smi topo -m`'s:
    NV<n> when NVLink joins the pair (directly, or through NVSwitches: the fewer of the two
    GPUs' switch links), else the PCIe/NUMA distance NVML reports (PIX, PXB, PHB, NODE, SYS).
    """
    try:
        import pynvml
    except ImportError:
        return [], [], "nvidia-ml-py is not installed (pip install 'raymesh[gpu]'): GPUs not read"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], [], f"NVML is not available ({e}): no GPUs reported"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        buses = [_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        devices = [_nvml_device(pynvml, i, h, buses[i]) for i, h in enumerate(handles)]
        if not devices:
            return [], [], "NVML reports no GPUs on this host"
        return devices, _nvml_links(pynvml, handles, buses), None
    except pynvml.NVMLError as e:
        return [], [], f"NVML failed while reading GPUs ({e}): no GPUs reported"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bus_id(value: str | bytes) -> str:
    """NVML's "00000000:07:00.0" as sysfs writes it, "0000:07:00.0"."""
    text = _text(value).strip().lower()
    domain, _, rest = text.partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def _nvml_device(pynvml: Any, index: int, handle: Any, bus: str) -> Device:
    numa: int | None = None
    try:
        numa = pynvml.nvmlDeviceGetNumaNodeId(handle)
    except (pynvml.NVMLError, AttributeError):  # older drivers or bindings: ask sysfs
        numa = _read_int(Path("/sys/bus/pci/devices") / bus / "numa_node")
    if numa is not None and numa < 0:
        numa = None
    affinity = ""
    try:
        words = ((os.cpu_count() or 64) + 63) // 64  # 64-bit words in NVML's CPU mask
        mask = pynvml.nvmlDeviceGetCpuAffinity(handle, words)
        affinity = cpulist(c for w, word in enumerate(mask) for c in range(64) if word >> c & 1)
    except pynvml.NVMLError:
        pass
    try:
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    except pynvml.NVMLError:
        uuid = ""
    return Device(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        pci_bus_id=bus,
        uuid=uuid,
        numa_node=numa,
        cpu_affinity=affinity,
        source="nvml",
    )


def _nvml_links(pynvml: Any, handles: list[Any], buses: list[str]) -> list[list[str]]:
    n = len(handles)
    gpu_at = {b: i for i, b in enumerate(buses)}
    direct = [[0] * n for _ in range(n)]  # NVLinks from i straight to j
    switch = [0] * n  # NVLinks from i to an NVSwitch
    for i, h in enumerate(handles):
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except pynvml.NVMLError:  # no such link on this GPU
                continue
            j = gpu_at.get(remote)
            if j is not None and j != i:
                direct[i][j] += 1
                continue
            try:
                is_switch = (
                    pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                    == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
                )
            except (pynvml.NVMLError, AttributeError):
                is_switch = j is None  # not a GPU of this host: an NVSwitch (or a CPU, rarely)
            switch[i] += is_switch
    levels = {
        pynvml.NVML_TOPOLOGY_INTERNAL: "PIX",
        pynvml.NVML_TOPOLOGY_SINGLE: "PIX",
        pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
        pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
        pynvml.NVML_TOPOLOGY_NODE: "NODE",
        pynvml.NVML_TOPOLOGY_SYSTEM: "SYS",
    }
    kinds = [["X"] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            nv = max(direct[i][j], direct[j][i], min(switch[i], switch[j]))
            if nv:
                kind = f"NV{nv}"
            else:
                try:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    kind = levels.get(level, "SYS")
                except pynvml.NVMLError:
                    kind = "SYS"
            kinds[i][j] = kinds[j][i] = kind
    return kinds


def read_cpus() -> dict[str, Any]:
    """This host's CPU sockets, NUMA nodes and this process's CPU affinity (plain data).

    Reads /sys/devices/system/{node,cpu} and /proc/cpuinfo (Linux); elsewhere sockets is None
    and there are no NUMA nodes.
    """
    if hasattr(os, "sched_getaffinity"):
        affinity = sorted(os.sched_getaffinity(0))
    else:
        affinity = list(range(os.cpu_count() or 1))
    numa = []
    base = Path("/sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        numa.append(
            NumaNode(index=int(d.name[4:]), cpus=cpus, memory_bytes=_numa_memory(d)).to_dict()
        )
    return {"sockets": _sockets(), "numa_nodes": numa, "cpu_affinity": cpulist(affinity)}


def _numa_memory(node_dir: Path) -> int | None:
    try:
        for line in (node_dir / "meminfo").read_text().splitlines():
            if "MemTotal:" in line:  # "Node 0 MemTotal:  131897852 kB"
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sockets() -> int | None:
    packages = set()
    for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id"):
        value = _read_int(p)
        if value is not None:
            packages.add(value)
    if packages:
        return len(packages)
    try:
        ids = {
            line.split(":")[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("physical id")
        }
        return len(ids) or None
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cpulist(cpus: Iterable[int]) -> str:
    """CPU ids as the kernel's cpulist: [0, 1, 2, 3, 8] -> "0-3,8"."""
    ids = sorted(set(cpus))
    parts = []
    start = prev = None
    for c in [*ids, None]:
        if c is not None and prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = c
    return ",".join(parts)
