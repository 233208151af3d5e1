"""Unit tests for `raymesh.topology.planner` and the topology model: pure, no Ray.

The brute-force reference below recomputes the cost model from its docstring, independently of
the planner's own arithmetic, and tries every injective rank -> device map.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from raymesh.topology import Host, JobShape, Link, Placement, Topology, plan
from raymesh.topology.model import GIB, Device
from raymesh.topology.planner import used

SLOW = Link(kind="NET", bandwidth=1e9, latency=100e-6)  # a congested or long-haul link


# -- synthetic topologies ----------------------------------------------------------------------


def one_box(gpus: int = 8) -> Topology:
    """One host whose GPUs are all joined by NVLink (an NVSwitch box)."""
    return Topology.of([Host.gpu_box("box", gpus=gpus, nvlinks=18)])


def two_islands(per_island: int = 4, interleaved: bool = True) -> Topology:
    """One host, two NVLink islands joined by PCIe through the host bridge. Interleaved: the
    islands are the even and the odd devices, so the naive order straddles them."""
    n = 2 * per_island
    islands = (
        [list(range(0, n, 2)), list(range(1, n, 2))]
        if interleaved
        else [list(range(per_island)), list(range(per_island, n))]
    )
    return Topology.of([Host.gpu_box("pcie", gpus=n, islands=islands, nvlinks=4, between="PHB")])


def hosts_with_one_slow_link(hosts: int = 4, gpus: int = 2) -> Topology:
    """`hosts` NVLink hosts on a nominal network, except h0 <-> h1, which is slow."""
    boxes = [Host.gpu_box(f"h{i}", gpus=gpus) for i in range(hosts)]
    return Topology.of(boxes, links={("h0", "h1"): SLOW})


def mixed(big: int = 4, small: int = 4) -> Topology:
    """One host with `big` 80 GiB GPUs and `small` 24 GiB ones, on separate NVLink islands."""
    n = big + small
    return Topology.of(
        [
            Host.gpu_box(
                "mixed",
                gpus=n,
                islands=[list(range(big)), list(range(big, n))],
                nvlinks=8,
                between="SYS",
                memory_bytes=[80 * GIB] * big + [24 * GIB] * small,
            )
        ]
    )


def cpu_hosts(hosts: int = 2, cpus: int = 4) -> Topology:
    return Topology.of([Host(node_id=f"c{i}", cpus=float(cpus)) for i in range(hosts)])


# -- an independent brute-force reference ------------------------------------------------------


def _link(topo: Topology, a: tuple[int, int | None], b: tuple[int, int | None]) -> Link:
    if a[0] != b[0]:
        x, y = topo.network[a[0]][b[0]], topo.network[b[0]][a[0]]
        return Link(
            kind="NET", bandwidth=min(x.bandwidth, y.bandwidth), latency=max(x.latency, y.latency)
        )
    if a[1] is None or b[1] is None:
        return topo.network[a[0]][a[0]]
    return topo.hosts[a[0]].links[a[1]][b[1]]


def reference_cost(topo: Topology, shape: JobShape, places: list[tuple[int, int | None]]) -> float:
    """The module docstring's model: sum over kinds of the slowest group's
    c * (p - 1) * max over pairs (latency + (n / p) / bandwidth)."""
    _, shard, tp = shape.dims
    grad = shape.grad_bytes / tp
    volume = {
        "tp": (2, shape.tp_bytes or shape.grad_bytes),
        "shard": (3, grad),
        "replicate": (2, grad / shard if shape.strategy == "hsdp" else grad),
    }
    total = 0.0
    for kind, groups in shape.groups().items():
        c, n = volume[kind]
        worst = 0.0
        for g in groups:
            p = len(g)
            for i, a in enumerate(g):
                for b in g[i + 1 :]:
                    link = _link(topo, places[a], places[b])
                    worst = max(worst, c * (p - 1) * (link.latency + n / p / link.bandwidth))
        total += worst
    return total


def _places(topo: Topology, placement: Placement) -> list[tuple[int, int | None]]:
    pos = {h.node_id: i for i, h in enumerate(topo.hosts)}
    out = []
    for a in placement.assignments:
        h = pos[a.node_id]
        dev = None
        if a.device is not None:
            dev = [d.index for d in topo.hosts[h].devices].index(a.device)
        out.append((h, dev))
    return out


def brute_force(topo: Topology, shape: JobShape) -> float:
    slots = [
        (h, d)
        for h, host in enumerate(topo.hosts)
        for d, dev in enumerate(host.devices)
        if dev.memory_bytes is None or dev.memory_bytes >= shape.memory_bytes
    ]
    return min(
        reference_cost(topo, shape, list(p))
        for p in itertools.permutations(slots, shape.world_size)
    )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)


def _devices_of(placement: Placement, group: tuple[int, ...]) -> set[tuple[str, int | None]]:
    return {(placement.assignments[r].node_id, placement.assignments[r].device) for r in group}


# -- the four synthetic topologies -------------------------------------------------------------


def test_one_nvlink_box_keeps_the_naive_order_and_says_why():
    p = plan(one_box(), JobShape(world_size=8, strategy="fsdp"))
    assert p.groups == {"shard": ((0, 1, 2, 3, 4, 5, 6, 7),)}
    assert p.devices == list(range(8)) and set(p.node_ids) == {"box"}
    assert _close(p.cost, p.naive_cost)
    assert "within one NVLink island" in p.reason and "NV18" in p.reason
    assert "the same as the naive order" in p.reason


def test_two_islands_joined_by_pcie_keep_each_shard_group_inside_an_island():
    topo = two_islands(interleaved=True)
    p = plan(topo, JobShape(world_size=8, strategy="hsdp", replicate=2, shard=4))
    evens, odds = {("pcie", d) for d in (0, 2, 4, 6)}, {("pcie", d) for d in (1, 3, 5, 7)}
    for group in p.groups["shard"]:
        assert _devices_of(p, group) in (evens, odds), p.reason
    assert p.cost < p.naive_cost / 2  # the naive order puts PCIe inside both shard groups
    assert "faster" in p.reason and "each within one NVLink island" in p.reason


def test_two_islands_in_index_order_are_already_optimal():
    p = plan(two_islands(interleaved=False), JobShape(world_size=8, strategy="fsdp", tp=4))
    assert _close(p.cost, p.naive_cost)
    for group in p.groups["tp"]:
        assert {d // 4 for _, d in _devices_of(p, group)} in ({0}, {1})  # type: ignore[operator]


def test_four_hosts_keep_the_slow_link_out_of_every_group():
    topo = hosts_with_one_slow_link(hosts=4, gpus=2)
    p = plan(topo, JobShape(world_size=8, strategy="hsdp", replicate=2, shard=4))
    for groups in p.groups.values():
        for g in groups:
            hosts = {p.assignments[r].node_id for r in g}
            assert not {"h0", "h1"} <= hosts, (g, p.reason)
    assert p.cost < p.naive_cost  # the naive order shards across h0 and h1
    assert "NET ~1 GB/s" not in p.reason


def test_four_eight_gpu_hosts_with_a_slow_link_shard_across_fast_pairs_only():
    topo = hosts_with_one_slow_link(hosts=4, gpus=8)
    p = plan(topo, JobShape(world_size=32, strategy="hsdp", replicate=2, shard=16))
    assert p.method == "heuristic"
    for g in p.groups["shard"]:
        hosts = {p.assignments[r].node_id for r in g}
        assert len(hosts) == 2 and hosts != {"h0", "h1"}, p.reason
    assert p.cost < p.naive_cost


def test_mixed_gpus_leave_out_devices_without_enough_memory():
    topo = mixed(big=4, small=4)
    p = plan(topo, JobShape(world_size=4, strategy="ddp", memory_bytes=40 * GIB))
    assert sorted(p.devices) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert "left out 4 GPU(s) with less than memory_bytes=40 GiB" in p.reason
    with pytest.raises(ValueError, match=r"world_size=6: only 4 of the topology's 8 GPUs") as e:
        plan(topo, JobShape(world_size=6, strategy="ddp", memory_bytes=40 * GIB))
    assert "memory_bytes=" in str(e.value) and "Fix: lower memory_bytes" in str(e.value)


def test_mixed_gpus_without_a_memory_need_prefer_the_tighter_island():
    # The 80 GiB island has 8 NVLinks between its GPUs, as has the 24 GiB one; put 2 ranks on
    # a host where one island is NV8 and the other NV2: the plan takes the NV8 pair.
    host = Host.gpu_box("h", gpus=4, islands=[[0, 1], [2, 3]], nvlinks=8, between="SYS")
    links = [list(row) for row in host.links]
    links[2][3] = links[3][2] = Link.nominal("NV2")
    host = Host(node_id="h", devices=host.devices, links=tuple(tuple(r) for r in links), cpus=8.0)
    p = plan(Topology.of([host]), JobShape(world_size=2, strategy="ddp"))
    assert sorted(p.devices) == [0, 1]  # type: ignore[type-var]


def test_cpu_only_hosts_place_procs_host_by_host():
    topo = cpu_hosts(hosts=2, cpus=4)
    p = plan(topo, JobShape(world_size=8, strategy="hsdp", replicate=2, shard=4))
    assert p.devices == [None] * 8
    for g in p.groups["shard"]:
        assert len({p.assignments[r].node_id for r in g}) == 1
    assert "CPU procs" in p.reason


# -- exactness and the naive bound ---------------------------------------------------------------


SMALL_CASES = [
    (one_box(4), JobShape(world_size=4, strategy="ddp")),
    (one_box(4), JobShape(world_size=4, strategy="fsdp", tp=2)),
    (two_islands(3), JobShape(world_size=6, strategy="hsdp", replicate=2, shard=3)),
    (two_islands(3), JobShape(world_size=6, strategy="ddp", tp=3)),
    (two_islands(3), JobShape(world_size=4, strategy="fsdp")),
    (hosts_with_one_slow_link(3, 2), JobShape(world_size=6, strategy="hsdp", replicate=3, shard=2)),
    (hosts_with_one_slow_link(3, 2), JobShape(world_size=4, strategy="hsdp", replicate=2, shard=2)),
    (hosts_with_one_slow_link(3, 2), JobShape(world_size=6, strategy="fsdp", tp=2)),
    (mixed(3, 3), JobShape(world_size=3, strategy="fsdp", memory_bytes=40 * GIB)),
    (mixed(3, 3), JobShape(world_size=4, strategy="hsdp", replicate=2, shard=2)),
]


@pytest.mark.parametrize(
    ("topo", "shape"),
    SMALL_CASES,
    ids=[
        f"{t.hosts[0].node_id}-{len(t.hosts)}x{t.num_devices}-{s.describe()}"
        for t, s in SMALL_CASES
    ],
)
def test_heuristic_and_exact_equal_brute_force_on_small_cases(topo, shape):
    best = brute_force(topo, shape)
    for method in ("heuristic", "exact"):
        p = plan(topo, shape, method=method)
        assert _close(p.cost, best), (method, p.cost, best, p.reason)
        assert _close(reference_cost(topo, shape, _places(topo, p)), p.cost)


def _random_topology(rng: random.Random, max_gpus: int) -> Topology:
    n_hosts = rng.randint(1, 4)
    hosts = []
    for h in range(n_hosts):
        g = rng.randint(1, max(1, max_gpus // n_hosts))
        order = list(range(g))
        rng.shuffle(order)
        cut = rng.randint(0, g)
        islands = [order[:cut], order[cut:]] if 0 < cut < g else [order]
        hosts.append(
            Host.gpu_box(
                f"h{h}",
                gpus=g,
                islands=islands,
                nvlinks=rng.choice([2, 4, 12]),
                between=rng.choice(["PIX", "PXB", "PHB", "NODE", "SYS"]),
                memory_bytes=[rng.choice([24, 80]) * GIB for _ in range(g)],
            )
        )
    links = {
        (f"h{a}", f"h{b}"): Link(
            kind="NET", bandwidth=rng.choice([1e9, 12.5e9, 25e9]), latency=rng.choice([5e-6, 5e-5])
        )
        for a in range(n_hosts)
        for b in range(a + 1, n_hosts)
    }
    return Topology.of(hosts, links=links)


def _random_shape(rng: random.Random, devices: int) -> JobShape:
    world = rng.randint(1, devices)
    tp = rng.choice([t for t in (1, 2, 4) if world % t == 0])
    strategy = rng.choice(["ddp", "fsdp", "hsdp"])
    if strategy != "hsdp":
        return JobShape(world_size=world, strategy=strategy, tp=tp)
    dp = world // tp
    replicate = rng.choice([d for d in range(1, dp + 1) if dp % d == 0])
    return JobShape(
        world_size=world, strategy="hsdp", replicate=replicate, shard=dp // replicate, tp=tp
    )


def test_heuristic_equals_brute_force_on_random_small_topologies():
    rng = random.Random(1234)
    for _ in range(100):
        topo = _random_topology(rng, max_gpus=7)
        shape = _random_shape(rng, topo.num_devices)
        p = plan(topo, shape, method="heuristic")
        assert _close(p.cost, brute_force(topo, shape)), (shape, topo.to_dict(), p.reason)


def test_plans_are_never_worse_than_the_naive_order_on_random_topologies():
    rng = random.Random(99)
    for _ in range(40):
        topo = _random_topology(rng, max_gpus=24)
        shape = _random_shape(rng, topo.num_devices)
        p = plan(topo, shape)
        assert p.cost <= p.naive_cost * (1 + 1e-12), p.reason
        assert _close(reference_cost(topo, shape, _places(topo, p)), p.cost)
        naive = [(h, d) for h, host in enumerate(topo.hosts) for d in range(len(host.devices))][
            : shape.world_size
        ]
        assert _close(reference_cost(topo, shape, naive), p.naive_cost)
        # a placement: every rank once, in order, on a device of its own
        assert [a.rank for a in p.assignments] == list(range(shape.world_size))
        assert len(set(zip(p.node_ids, p.devices))) == shape.world_size
        assert sorted(r for g in next(iter(p.groups.values())) for r in g) == list(
            range(shape.world_size)
        )


def test_plan_is_deterministic():
    topo = hosts_with_one_slow_link(hosts=4, gpus=4)
    shape = JobShape(world_size=16, strategy="hsdp", replicate=4, shard=4)
    assert plan(topo, shape) == plan(topo, shape)


# -- the shape's groups ------------------------------------------------------------------------


def test_hsdp_with_tp_groups_follow_the_rank_layout():
    shape = JobShape(world_size=8, strategy="hsdp", replicate=2, shard=2, tp=2)
    groups = shape.groups()
    assert groups["tp"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert groups["shard"] == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert groups["replicate"] == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert JobShape(world_size=4, strategy="ddp").groups() == {"replicate": ((0, 1, 2, 3),)}


# -- errors name the field, the value and the fix -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 8, "strategy": "hsdp", "replicate": 2, "shard": 3},
            r"replicate\(2\) \* shard\(3\) \* tp\(1\) = 6 != world_size\(8\)\. Fix: choose "
            r"replicate \* shard = world_size / tp = 8",
        ),
        ({"world_size": 8, "strategy": "hsdp"}, r"strategy='hsdp' needs replicate and shard"),
        ({"world_size": 8, "replicate": 2}, r"replicate=2, shard=None are for strategy='hsdp'"),
        ({"world_size": 6, "tp": 4}, r"world_size\(6\) % tp\(4\) != 0\. Fix"),
        ({"world_size": 4, "strategy": "zero3"}, r"strategy='zero3'; use one of"),
        ({"world_size": 0}, r"world_size=0; it must be an integer >= 1"),
        ({"world_size": 4, "memory_bytes": -1}, r"memory_bytes=-1"),
        ({"world_size": 4, "memory_bytes": True}, r"memory_bytes=True"),
        ({"world_size": 4, "device": "tpu"}, r"device='tpu'"),
    ],
)
def test_bad_shapes_raise_value_errors_that_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JobShape(**kwargs)


def test_jobs_that_cannot_fit_raise_value_errors_that_name_the_fix():
    with pytest.raises(ValueError, match=r"world_size=16: only 8 of the topology's 8 GPUs.*Fix"):
        plan(one_box(), JobShape(world_size=16))
    with pytest.raises(ValueError, match=r"device='gpu', but the topology has no GPUs.*Fix"):
        plan(cpu_hosts(), JobShape(world_size=2, device="gpu"))
    with pytest.raises(ValueError, match=r"world_size=9: the topology has 8 logical CPUs"):
        plan(cpu_hosts(2, 4), JobShape(world_size=9))
    with pytest.raises(ValueError, match=r"method='exact' over 16 usable slots.*Fix"):
        plan(hosts_with_one_slow_link(4, 4), JobShape(world_size=4), method="exact")
    with pytest.raises(ValueError, match=r"method='fast'"):
        plan(one_box(), JobShape(world_size=4), method="fast")


def test_bad_topologies_raise_value_errors():
    with pytest.raises(ValueError, match=r"kind='QPI' is not a link kind"):
        Link.nominal("QPI")
    with pytest.raises(ValueError, match=r"links must be a 2x2 matrix"):
        Host(node_id="h", devices=(Device(index=0, name="g", memory_bytes=1),) * 2, links=())
    box = Host.gpu_box("a", gpus=2)
    with pytest.raises(ValueError, match=r"node ids repeat"):
        Topology.of([box, box])
    with pytest.raises(ValueError, match=r"network\[0\]\[1\]\.kind='NV4'; it must be 'NET'"):
        Topology.of([box, Host.gpu_box("b", gpus=2)], default=Link.nominal("NV4"))
    with pytest.raises(ValueError, match=r"islands=\[\[0\]\] must cover each of the 2"):
        Host.gpu_box("a", gpus=2, islands=[[0]])


# -- plain data --------------------------------------------------------------------------------


def test_topology_and_placement_round_trip_through_json():
    topo = hosts_with_one_slow_link(hosts=3, gpus=2).with_notes("synthetic")
    assert Topology.from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    p = plan(topo, JobShape(world_size=4, strategy="fsdp"))
    data = json.loads(json.dumps(p.to_dict()))
    assert data["assignments"][0]["rank"] == 0 and data["cost"] == p.cost
    assert data["groups"]["shard"] == [[0, 1, 2, 3]]


def test_islands_are_nvlink_components_largest_first():
    host = Host.gpu_box("h", gpus=6, islands=[[5], [0, 2, 4], [1, 3]], nvlinks=2, between="PXB")
    assert host.islands() == [[0, 2, 4], [1, 3], [5]]
    assert Link.nominal("NV4").bandwidth == 4 * Link.nominal("NV1").bandwidth


def test_used_keeps_only_the_places_a_plan_holds_and_replanning_there_stays_there():
    topo = hosts_with_one_slow_link(hosts=4, gpus=2)
    ddp = plan(topo, JobShape(world_size=4, strategy="ddp"))
    there = used(topo, ddp)
    assert {h.node_id for h in there.hosts} == set(ddp.node_ids)
    assert sum(len(h.devices) for h in there.hosts) == 4
    hsdp = plan(there, JobShape(world_size=4, strategy="hsdp", replicate=2, shard=2))
    assert sorted(zip(hsdp.node_ids, hsdp.devices)) == sorted(zip(ddp.node_ids, ddp.devices))
    # "naive" prices the order that keeps each host's ranks together, host by host
    naive = plan(there, hsdp.shape, method="naive")
    assert naive.method == "naive" and naive.cost == naive.naive_cost >= hsdp.cost
    assert naive.node_ids == sorted(naive.node_ids, key=[h.node_id for h in there.hosts].index)
    cpus = used(
        cpu_hosts(hosts=3, cpus=4),
        plan(cpu_hosts(hosts=3, cpus=4), JobShape(world_size=6, strategy="ddp", device="cpu")),
    )
    assert sorted(h.cpus for h in cpus.hosts) == [2.0, 4.0]
