"""Rank placement: which rank runs on which host and device, chosen to make collectives cheap.

Pure arithmetic on a `Topology` (no Ray, no torch): `plan(topology, shape)` returns a
`Placement` (rank -> host and device, the process groups of `JobShape`'s rank layout, the
estimated cost and the naive order's cost) whose `reason` says why, for the log.

Cost model (alpha-beta, per step, for `shape.grad_bytes` of gradients): each group runs a ring
collective whose every step waits for the group's slowest pair of members, so a group of p
ranks moving n bytes costs c * (p - 1) * max over pairs (latency + (n / p) / bandwidth), with
c = 2 for an all-reduce (DDP replicas, HSDP replicas on their 1/shard of the gradients, TP
activations) and c = 3 for FSDP's all-gather (forward), all-gather (backward) and
reduce-scatter. Groups of one kind run at once, so a kind costs its slowest group; kinds add up.
Charging a group for its slowest pair is pessimistic (a ring could route around one slow pair)
and link sharing between groups and compute overlap are left out: the model ranks placements,
it does not predict step times.

Search (`raymesh.topology.search`): exact, by branch and bound, when at most `EXACT_MAX_SLOTS`
devices can take a rank; otherwise islands first (fill NVLink islands, then hosts, so that the
most talkative groups share the tightest links) and orders grown island by island, each refined
by swaps while they lower the cost, within a fixed budget of work. The naive order (hosts in
topology order, devices in index order) is always a candidate, so a plan never costs more, and
the same input always gives the same plan.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from raymesh.topology.job import JobShape
from raymesh.topology.model import GIB, Host, Topology
from raymesh.topology.search import Problem, Slot, exact, heuristic

if TYPE_CHECKING:
    from raymesh._src.host_mesh import RankPlacement

__all__ = ["EXACT_MAX_SLOTS", "Assignment", "JobShape", "Placement", "plan", "used"]

METHODS = ("auto", "exact", "heuristic", "naive")
EXACT_MAX_SLOTS = 8  # up to 8! = 40320 orders: a fraction of a second with branch and bound
_EXACT_HARD_LIMIT = 10  # "exact" on more devices than this is refused rather than left to run


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Where one rank runs."""

    rank: int
    node_id: str  # Ray node id of its host
    host: str  # the host's name, for people
    device: int | None  # device index on that host; None for a CPU proc

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "host": self.host,
            "device": self.device,
        }


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A plan: each rank's place, the process groups, and what they are estimated to cost.

    Guarantees: assignments[r].rank == r; no two ranks share a device (CPU procs of one host
    may share it); cost <= naive_cost; every rank of `groups` is in range(world_size).
    """

    shape: JobShape
    assignments: tuple[Assignment, ...]  # assignments[r]: where rank r runs
    groups: Mapping[str, tuple[tuple[int, ...], ...]]  # kind -> groups of ranks
    cost: float  # estimated seconds per step for shape.grad_bytes (see the cost model)
    naive_cost: float  # the same for the naive order (hosts in order, devices by index)
    method: str  # "exact" or "heuristic"
    reason: str  # why, with the numbers, for the log
    group_costs: Mapping[str, float] = field(default_factory=dict)  # kind -> its slowest group

    @property
    def node_ids(self) -> list[str]:
        """Each rank's node id, in rank order (what a proc mesh is spawned from)."""
        return [a.node_id for a in self.assignments]

    @property
    def devices(self) -> list[int | None]:
        """Each rank's device index on its host, in rank order."""
        return [a.device for a in self.assignments]

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": {k: getattr(self.shape, k) for k in self.shape.__dataclass_fields__},
            "assignments": [a.to_dict() for a in self.assignments],
            "groups": {k: [list(g) for g in v] for k, v in self.groups.items()},
            "cost": self.cost,
            "naive_cost": self.naive_cost,
            "group_costs": dict(self.group_costs),
            "method": self.method,
            "reason": self.reason,
        }


# -- plan ---------------------------------------------------------------------------------------


if TYPE_CHECKING:

    def _spawnable(placement: Placement) -> RankPlacement:
        """Never called: mypy checks here that a plan is what `spawn_procs(placement=...)` reads
        (the core describes it with protocols, since it may not import this package)."""
        return placement


def _slots(topo: Topology, shape: JobShape) -> tuple[list[Slot], list[str], str]:
    """Usable slots in naive order, notes on what was left out, and "gpu" or "cpu"."""
    has_gpus = topo.num_devices > 0
    device = shape.device if shape.device != "auto" else ("gpu" if has_gpus else "cpu")
    notes: list[str] = []
    if device == "gpu" and not has_gpus:
        raise ValueError(
            f"JobShape: device='gpu', but the topology has no GPUs on its {len(topo.hosts)} "
            "host(s). Fix: device='cpu' (or 'auto'), or discover a cluster with GPUs"
        )
    if device == "cpu":
        slots = [
            Slot(h, None)
            for h, host in enumerate(topo.hosts)
            for _ in range(min(int(host.cpus), shape.world_size))
        ]
        if len(slots) < shape.world_size:
            raise ValueError(
                f"world_size={shape.world_size}: the topology has {len(slots)} logical CPUs "
                f"across {len(topo.hosts)} host(s), one per CPU proc. Fix: lower world_size to "
                f"at most {len(slots)}, or add hosts/CPUs"
            )
        return slots, notes, device
    slots, small, unknown = [], [], 0
    for h, host in enumerate(topo.hosts):
        for d, dev in enumerate(host.devices):
            if dev.memory_bytes is None:
                unknown += 1
            elif dev.memory_bytes < shape.memory_bytes:
                small.append(f"{host.name}:GPU{dev.index} ({dev.memory_bytes / GIB:.3g} GiB)")
                continue
            slots.append(Slot(h, d))
    if small:
        notes.append(
            f"left out {len(small)} GPU(s) with less than memory_bytes="
            f"{shape.memory_bytes / GIB:.3g} GiB: {', '.join(small[:8])}"
            + (" ..." if len(small) > 8 else "")
        )
    if unknown and shape.memory_bytes:
        notes.append(f"{unknown} GPU(s) of unknown memory were assumed to fit")
    if len(slots) < shape.world_size:
        fix = (
            f"lower world_size to at most {len(slots)}, or add hosts with GPUs"
            if not small
            else f"lower memory_bytes (e.g. shard more: strategy='fsdp'), lower world_size to "
            f"at most {len(slots)}, or add GPUs with more memory"
        )
        raise ValueError(
            f"world_size={shape.world_size}: only {len(slots)} of the topology's "
            f"{topo.num_devices} GPUs can take a rank"
            + (f" ({len(small)} have less than memory_bytes={shape.memory_bytes})" if small else "")
            + f". Fix: {fix}"
        )
    return slots, notes, device


def plan(topology: Topology, shape: JobShape, *, method: str = "auto") -> Placement:
    """Place `shape`'s ranks on `topology`'s devices (or CPU procs) to make its groups cheap.

    method: "exact" finds the best of all orders (branch and bound; refused past 10 usable
    devices); "heuristic" is islands-first and grown orders plus swaps; "auto" is exact up to
    EXACT_MAX_SLOTS usable devices, else heuristic; "naive" is the naive order itself, costed
    (to price another strategy on the places a plan already chose: see `used`).
    Guarantees: the result's cost is never above the naive order's, and is deterministic for
    a given topology and shape. Raises ValueError (naming the field, the value and the fix)
    when the job cannot fit.
    """
    if method not in METHODS:
        raise ValueError(f"plan: method={method!r}; use one of {list(METHODS)}")
    slots, notes, device = _slots(topology, shape)
    prob = Problem(topology, shape, slots)
    naive = list(range(shape.world_size))
    naive_cost = prob.total(naive)
    if method == "auto":
        method = "exact" if len(slots) <= EXACT_MAX_SLOTS else "heuristic"
    if method == "exact" and len(slots) > _EXACT_HARD_LIMIT:
        raise ValueError(
            f"plan: method='exact' over {len(slots)} usable slots would try "
            f"{math.perm(len(slots), shape.world_size):,} orders. Fix: method='heuristic' "
            f"(or 'auto'), or at most {_EXACT_HARD_LIMIT} slots"
        )
    best = naive if method == "naive" else heuristic(prob, naive, naive_cost)
    if method == "exact":
        best = exact(prob, best)  # the heuristic's answer is a tight first bound
    cost = prob.total(best)
    if cost > naive_cost:  # cannot happen (naive is a candidate); kept as the guarantee's guard
        best, cost = naive, naive_cost
    return _placement(prob, best, cost, naive_cost, method, notes, device)


def used(topology: Topology, placement: Placement) -> Topology:
    """The part of `topology` that `placement` runs on: its hosts, each with just the devices
    it assigned (links kept between them) and as many CPUs as it placed CPU procs there.

    Planning another shape of the same job on it compares strategies on the very places the
    ranks hold (e.g. DDP against HSDP once the procs are spawned)."""
    procs = Counter(a.node_id for a in placement.assignments if a.device is None)
    devices: dict[str, set[int]] = {}
    for a in placement.assignments:
        if a.device is not None:
            devices.setdefault(a.node_id, set()).add(a.device)
    keep = [i for i, h in enumerate(topology.hosts) if h.node_id in procs or h.node_id in devices]

    def trim(host: Host) -> Host:
        mine = devices.get(host.node_id, set())
        pos = [i for i, d in enumerate(host.devices) if d.index in mine]
        return replace(
            host,
            cpus=float(procs.get(host.node_id, 0)),
            devices=tuple(host.devices[i] for i in pos),
            links=tuple(tuple(host.links[i][j] for j in pos) for i in pos),
        )

    return replace(
        topology,
        hosts=tuple(trim(topology.hosts[i]) for i in keep),
        network=tuple(tuple(topology.network[a][b] for b in keep) for a in keep),
    )


# -- the result and its reason ---------------------------------------------------------------


def _placement(
    prob: Problem,
    assign: list[int],
    cost: float,
    naive_cost: float,
    method: str,
    notes: list[str],
    device: str,
) -> Placement:
    topo, shape = prob.topo, prob.shape
    assignments = []
    for r, si in enumerate(assign):
        slot = prob.slots[si]
        host = topo.hosts[slot.host]
        dev = None if slot.dev is None else host.devices[slot.dev].index
        assignments.append(Assignment(rank=r, node_id=host.node_id, host=host.name, device=dev))
    costs = prob.costs(assign)
    group_costs = {k: max(c, default=0.0) for k, c in zip(prob.kinds, costs)}
    parts = [_describe_kind(prob, ki, assign, costs[ki]) for ki in range(len(prob.kinds))]
    n_hosts = len({a.node_id for a in assignments})
    what = "GPUs" if device == "gpu" else "CPU procs"
    unit = (
        f"{shape.grad_bytes / GIB:.3g} GiB"
        if shape.grad_bytes >= GIB
        else (f"{shape.grad_bytes:,} B")
    )
    if cost < naive_cost * (1 - 1e-6):
        versus = (
            f"vs {naive_cost * 1e3:.4g} ms in the naive order ({naive_cost / cost:.2f}x faster)"
            if cost > 0
            else f"vs {naive_cost * 1e3:.4g} ms in the naive order"
        )
    else:
        versus = "the same as the naive order, which is kept"
    search = {
        "exact": f"exact: the best of all {math.perm(len(prob.slots), shape.world_size):,} "
        "orders (branch and bound)",
        "heuristic": "heuristic: islands-first and grown orders refined by swaps",
        "naive": "naive: the hosts in order, each host's places in order, as asked",
    }[method]
    reason = (
        f"{shape.describe()} on {shape.world_size} {what} of {n_hosts} host(s): "
        + "; ".join(parts)
        + f". Estimated {cost * 1e3:.4g} ms of communication per step for {unit} of gradients, "
        + f"{versus}; {search}."
        + "".join(f" Note: {n}." for n in notes)
    )
    return Placement(
        shape=shape,
        assignments=tuple(assignments),
        groups=dict(zip(prob.kinds, prob.groups)),
        cost=cost,
        naive_cost=naive_cost,
        method=method,
        reason=reason,
        group_costs=group_costs,
    )


def _describe_kind(prob: Problem, ki: int, assign: list[int], costs: list[float]) -> str:
    """E.g. 'shard groups of 4: each within one NVLink island (slowest NV4 ~100 GB/s ~2us)'."""
    kind, groups = prob.kinds[ki], prob.groups[ki]
    size = len(groups[0])
    label = f"{len(groups)} {kind} group(s) of {size}"
    if size < 2:
        return f"{label}: no communication"
    spans = []
    for g in groups:
        slots = [prob.slots[assign[r]] for r in g]
        if len({s.host for s in slots}) > 1:
            spans.append(2)
        elif all(
            prob.links[assign[a]][assign[b]].nvlinks for i, a in enumerate(g) for b in g[i + 1 :]
        ):
            spans.append(0)
        else:
            spans.append(1)
    where = ("within one NVLink island", "within one host", "across hosts")
    if len(set(spans)) == 1:
        span = f"each {where[spans[0]]}"
    else:
        span = ", ".join(f"{spans.count(v)} {where[v]}" for v in sorted(set(spans)))
    worst_g = groups[max(range(len(groups)), key=lambda i: costs[i])]
    table = prob.table[ki]
    a, b = max(
        ((x, y) for i, x in enumerate(worst_g) for y in worst_g[i + 1 :]),
        key=lambda p: table[assign[p[0]]][assign[p[1]]],
    )
    slowest = prob.links[assign[a]][assign[b]].describe()
    return f"{label}, {span} (slowest link {slowest}, {max(costs) * 1e3:.4g} ms)"
