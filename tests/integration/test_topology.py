"""Discovery on real Ray: this session's one-host cluster, a local multi-node cluster whose
nodes stand in for GPU hosts (Ray GPU resources + labels), the `raymesh topology` command, and
NVML: the real one where a GPU is present, and a scripted stand-in for NVML's answers (not for
Ray or torch) that checks how they become a link matrix on any machine."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import textwrap
import time
import types

import pytest

import raymesh
from raymesh import topology
from raymesh._src import backend
from raymesh.cli.main import main as cli_main
from raymesh.topology.discovery import read_cpus, read_gpus

from ..scripts import run_cluster_script, run_python


def _nvidia_device_files() -> list[str]:
    """The NVIDIA driver's device files, /dev/nvidia0, /dev/nvidia1, ...: the machine's GPUs,
    counted without NVML, Ray or CUDA (the code under test reads none of these)."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return sorted(n for n in names if re.fullmatch(r"nvidia[0-9]+", n))


def _gpus_ray_offers() -> int:
    """The GPUs Ray's local node offers: every one the machine has, narrowed by
    CUDA_VISIBLE_DEVICES when it is set (as Ray narrows its GPU resource)."""
    present = len(_nvidia_device_files())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([v for v in visible.split(",") if v.strip()]))


def _pynvml_importable() -> bool:
    return importlib.util.find_spec("pynvml") is not None


def test_local_facts_read_cpus_and_report_gpus_or_why_not():
    cpus = read_cpus()
    assert cpus["cpu_affinity"]  # e.g. "0-1"
    if os.path.isdir("/sys/devices/system/node"):
        assert cpus["numa_nodes"] and cpus["numa_nodes"][0]["cpus"]
        assert cpus["sockets"] >= 1
    devices, kinds, note = read_gpus()
    assert len(kinds) == len(devices)
    assert (note is None) == bool(devices)  # no GPUs always says why
    # every GPU the machine has, counted from its device files, where the bindings are here
    expected = len(_nvidia_device_files()) if _pynvml_importable() else 0
    assert len(devices) == expected, (devices, note, _nvidia_device_files())


@pytest.mark.usefixtures("ray_cluster")
def test_discover_sees_this_one_host_and_measures_its_loopback_within_the_timeout():
    backend.ensure_ray()
    start = time.monotonic()
    topo = topology.discover(probe_timeout=10, ttl=0)
    assert time.monotonic() - start < 15  # the timeout, plus Ray's node listing
    [host] = topo.hosts
    assert host.node_id == backend.current_node_id()
    # GPUs as counted here from the device files, not by discover()'s own NVML reader: Ray's
    # GPU resource, and the devices (NVML's, all the machine's; else one per Ray GPU).
    assert host.cpus >= 1 and host.gpus == _gpus_ray_offers(), _nvidia_device_files()
    nvml_sees = len(_nvidia_device_files()) if _pynvml_importable() else 0
    assert len(host.devices) == max(nvml_sees, _gpus_ray_offers()), (host.devices, topo.notes)
    assert all(d.source == ("nvml" if nvml_sees else "ray") for d in host.devices), host.devices
    [[loop]] = topo.network
    assert loop.kind == "LOOP" and loop.measured and loop.bandwidth > 0
    assert topology.Topology.from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    again = topology.discover(probe_timeout=10, ttl=60)  # measured once more, then cached
    assert topology.discover(probe_timeout=10, ttl=60).network == again.network
    # and the planner takes it as it is: CPU procs on the one host
    # (CPU procs asked for by name, so that a GPU host places them so too; on a host without
    # GPUs "auto" means CPU procs)
    placement = topology.plan(topo, topology.JobShape(world_size=4, strategy="fsdp", device="cpu"))
    assert placement.node_ids == [host.node_id] * 4 and placement.devices == [None] * 4
    if not host.devices:
        auto = topology.plan(topo, topology.JobShape(world_size=4, strategy="fsdp"))
        assert auto.assignments == placement.assignments
    # A plan made for other hosts is refused before anything is spawned, naming the host.
    elsewhere = topology.Topology.of([topology.Host(node_id="f" * 56, hostname="far", cpus=8)])
    far = topology.plan(elsewhere, topology.JobShape(world_size=2))
    with pytest.raises(ValueError, match=r"host\(s\) \['far'\], which are not in this host"):
        raymesh.this_host().spawn_procs(placement=far)


@pytest.mark.usefixtures("ray_cluster")
def test_topology_command_prints_json_and_a_table_for_the_session_cluster(capsys):
    env = dict(os.environ, RAYMESH_ADDRESS=backend.address())
    out = run_python(
        ["-m", "raymesh.cli.main", "topology", "--json", "--probe-timeout", "10"], env, 90
    )
    topo = topology.Topology.from_dict(json.loads(out))
    assert [h.node_id for h in topo.hosts] == [backend.current_node_id()]  # joined, started none
    assert cli_main(["topology", "--probe-timeout", "10"]) == 0  # in-process, the same Ray
    text = capsys.readouterr().out
    # A mistake is one line naming the flag and the fix, and the usage status, as every command
    assert cli_main(["topology", "--probe-timeout", "0"]) == 2
    said = capsys.readouterr().err
    assert said == "raymesh topology: --probe-timeout 0: give a number of seconds > 0\n", said
    assert "raymesh topology: 1 host(s)" in text and "network (one-way latency" in text
    # Cores and Ray's logical CPU slots apart (the embedded Ray offers >= 64 slots on any
    # machine), read independently of the probes here.
    [host] = topo.hosts
    assert host.cores == len(os.sched_getaffinity(0)), host.cpu_affinity
    row = next(line for line in text.splitlines() if line.startswith(host.name[:16]))
    assert row.split()[2:4] == [str(host.cores), f"{host.cpus:g}"], row
    if host.cpus > host.cores:
        assert "Size a job by cores, not slots" in text, text


TWO_GPU_HOSTS = textwrap.dedent(
    """
    import json
    from ray.cluster_utils import Cluster

    def gpu_host(name, gpu, gib, link):
        labels = {"raymesh.io/host": name, "raymesh.io/gpu-name": gpu,
                  "raymesh.io/gpu-memory-gib": gib, "raymesh.io/gpu-link": link}
        return {"num_cpus": 1, "num_gpus": 2, "labels": labels, "include_dashboard": False}

    cluster = Cluster(initialize_head=True, head_node_args=gpu_host("a", "FakeA100", "80", "NV12"))
    cluster.add_node(**gpu_host("b", "FakeA10", "24", "PHB"))
    cluster.wait_for_nodes()
    import ray
    ray.init(address=cluster.address)
    from raymesh import topology
    topo = topology.discover(probe_timeout=30)
    shape = topology.JobShape(world_size=4, strategy="hsdp", replicate=2, shard=2)
    plan = topology.plan(topo, shape)
    # Procs that follow the plan: rank r on its host, along the plan's axes.
    from raymesh import Actor, endpoint, host_mesh

    class Where(Actor):
        @endpoint
        def node(self):
            return ray.get_runtime_context().get_node_id()

    procs = host_mesh().spawn_procs(placement=plan, cpus_per_proc=0)
    nodes = procs.spawn("where", Where).node.call().get(timeout=120)
    print("RESULT", json.dumps({"topology": topo.to_dict(), "plan": plan.to_dict(),
                      "sizes": procs.sizes, "by_point": [[dict(p), n] for p, n in nodes.items()],
                      "group0": procs.slice(replicate=0).sizes}))
    procs.stop()
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_discover_on_a_two_node_cluster_sees_simulated_gpus_and_measures_the_link(tmp_path):
    out = run_cluster_script(tmp_path / "two_hosts.py", TWO_GPU_HOSTS, timeout=110)
    topo = topology.Topology.from_dict(out["topology"])
    assert sorted(h.name for h in topo.hosts) == ["a", "b"]
    by_name = {h.name: h for h in topo.hosts}
    a, b = by_name["a"], by_name["b"]
    assert [d.name for d in a.devices] == ["FakeA100"] * 2 and a.links[0][1].kind == "NV12"
    assert [d.memory_bytes for d in b.devices] == [24 << 30] * 2 and b.links[0][1].kind == "PHB"
    assert all(d.source == "ray" for h in topo.hosts for d in h.devices)
    assert any("from Ray's GPU resource" in n for n in topo.notes)
    for i, row in enumerate(topo.network):
        for j, link in enumerate(row):
            assert link.measured and link.latency > 0 and link.bandwidth > 0, (i, j, link)
            assert link.kind == ("LOOP" if i == j else "NET")
    # shard groups stay on one host (over NVLink or PCIe), replicas cross the network
    plan = out["plan"]
    for group in plan["groups"]["shard"]:
        assert len({plan["assignments"][r]["node_id"] for r in group}) == 1, plan["reason"]
    # spawn_procs(placement=...) put rank (r * shard + s) on its planned host
    assert out["sizes"] == {"replicate": 2, "shard": 2} and out["group0"] == {"shard": 2}
    for point, node in out["by_point"]:
        rank = point["replicate"] * 2 + point["shard"]
        assert node == plan["assignments"][rank]["node_id"], out["by_point"]


def _nvml_skip_reason() -> str | None:
    """Why the real NVML cannot be read here, from facts read_gpus() does not decide (whether
    a driver's device file exists, whether the bindings are installed); None: it must work."""
    if not _nvidia_device_files():
        return "no NVIDIA GPU on this machine (no /dev/nvidia0, /dev/nvidia1, ...)"
    if not _pynvml_importable():
        return "nvidia-ml-py is not installed (pip install 'raymesh[gpu]')"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_nvml_skip_reason() is not None, reason=_nvml_skip_reason() or "")
def test_nvml_reads_every_gpu_with_its_memory_and_a_symmetric_link_matrix():
    devices, kinds, note = read_gpus()
    assert note is None, note
    assert len(devices) == len(_nvidia_device_files()), (devices, _nvidia_device_files())
    assert [d.index for d in devices] == list(range(len(devices)))
    for d in devices:
        assert d.name and d.memory_bytes and d.memory_bytes > 0 and d.source == "nvml"
        assert d.pci_bus_id.count(":") == 2
    n = len(devices)
    assert len(kinds) == n and all(len(row) == n for row in kinds)
    for i in range(n):
        assert kinds[i][i] == "X"
        for j in range(n):
            assert kinds[i][j] == kinds[j][i]
    host = topology.Host(
        node_id="here",
        devices=tuple(devices),
        links=tuple(tuple(topology.Link.nominal(k) for k in row) for row in kinds),
    )
    assert sum(len(i) for i in host.islands()) == n


class _ScriptedNVML(types.ModuleType):
    """NVML's answers for a 4-GPU host: GPU0 and GPU1 joined by 2 direct NVLinks, GPU2 and
    GPU3 by 3 NVLinks each to an NVSwitch, the other pairs by PCIe or across sockets."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 6
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_SINGLE, NVML_TOPOLOGY_MULTIPLE = 0, 10, 20
    NVML_TOPOLOGY_HOSTBRIDGE, NVML_TOPOLOGY_NODE, NVML_TOPOLOGY_SYSTEM = 30, 40, 50

    class NVMLError(Exception):
        pass

    BUS = ["00000000:07:00.0", "00000000:0A:00.0", "00000000:87:00.0", "00000000:8A:00.0"]
    SWITCH = "00000000:FF:00.0"
    LINKS = {  # gpu -> [(remote bus, remote type)], one entry per active link
        0: [(BUS[1], 0)] * 2,
        1: [(BUS[0], 0)] * 2,
        2: [(SWITCH, 2)] * 3,
        3: [(SWITCH, 2)] * 3,
    }
    ANCESTOR = {(0, 2): 40, (0, 3): 50, (1, 2): 30, (1, 3): 50}

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut = False

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=self.BUS[h].encode())  # bytes, as older bindings

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA Scripted 80GB"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=80 << 30)

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        return h // 2

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        return [0xF << (4 * (h // 2))] + [0] * (words - 1)

    def _link(self, h: int, link: int) -> tuple[str, int]:
        if link >= len(self.LINKS[h]):
            raise self.NVMLError("NVML_ERROR_INVALID_ARGUMENT")
        return self.LINKS[h][link]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        self._link(h, link)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=self._link(h, link)[0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self._link(h, link)[1]

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.ANCESTOR[(min(a, b), max(a, b))]


def test_nvml_answers_become_the_nvidia_smi_link_matrix(monkeypatch):
    nvml = _ScriptedNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    devices, kinds, note = read_gpus()
    assert note is None and nvml.shut  # NVML is always shut down again
    assert kinds == [
        ["X", "NV2", "NODE", "SYS"],
        ["NV2", "X", "PHB", "SYS"],
        ["NODE", "PHB", "X", "NV3"],  # through the NVSwitch: the fewer switch links of the two
        ["SYS", "SYS", "NV3", "X"],
    ]
    assert [d.pci_bus_id for d in devices] == [
        "0000:07:00.0",
        "0000:0a:00.0",
        "0000:87:00.0",
        "0000:8a:00.0",
    ]
    assert [(d.numa_node, d.cpu_affinity) for d in devices] == [
        (0, "0-3"),
        (0, "0-3"),
        (1, "4-7"),
        (1, "4-7"),
    ]
    assert devices[0].name == "NVIDIA Scripted 80GB" and devices[0].memory_bytes == 80 << 30
    host = topology.Host(
        node_id="scripted",
        devices=tuple(devices),
        links=tuple(tuple(topology.Link.nominal(k) for k in row) for row in kinds),
    )
    assert host.islands() == [[0, 1], [2, 3]]
