"""The planner's search: cost tables over usable slots, and the ways to look for a cheap
assignment of ranks to slots. Internal to `raymesh.topology.planner`; pure arithmetic.

- `exact`: branch and bound over every injective rank -> slot map (small problems).
- `heuristic`: swap searches (`local_search`) from several starting orders: the naive order,
  islands-first orders (`islands_first`), and orders grown from one slot per NVLink island
  (`grow`), block by block of the rank layout or group by group of each kind. On large problems
  it searches from the naive order and the most promising few, within a fixed budget of work
  (counted, not timed, so that a plan is the same on any machine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from raymesh.topology.job import JobShape
from raymesh.topology.model import Link, Topology

_MAX_PASSES = 20  # swap passes; each pass tries every pair once
REL_TOL = 1e-9  # costs closer than this (relative) are equal
_MAX_SEEDS = 16  # slots that grown starting orders start from
_SMALL = 1024  # world x slots up to which the heuristic searches from every start
_SEARCHED_STARTS = 4  # past that, it searches from the naive order and the best few starts
_WORK_BUDGET = 5_000_000  # pairs of ranks the swap searches may look at (a few seconds)


@dataclass(frozen=True)
class Slot:
    host: int  # position in topology.hosts
    dev: int | None  # position in host.devices; None: a CPU proc


class Problem:
    """Slots (usable devices, or CPU procs), group structure, and per-kind pair-time tables."""

    def __init__(self, topo: Topology, shape: JobShape, slots: list[Slot]) -> None:
        self.topo, self.shape, self.slots = topo, shape, slots
        self.world = shape.world_size
        n = len(slots)
        self.links = [[self._link(slots[a], slots[b]) for b in range(n)] for a in range(n)]
        groups = shape.groups()
        self.kinds = list(groups)
        self.groups = [groups[k] for k in self.kinds]
        collectives = shape.collectives()
        self.factor: list[float] = []
        self.table: list[list[list[float]]] = []  # per kind: slot x slot -> seconds per step
        for k, gs in zip(self.kinds, self.groups):
            c, nbytes = collectives[k]
            p = len(gs[0])
            self.factor.append(c * (p - 1))
            per_msg = nbytes / p
            self.table.append(
                [[lk.latency + per_msg / lk.bandwidth for lk in row] for row in self.links]
            )
        n_kinds = range(len(self.kinds))
        self.pair_cost = [
            [sum(self.factor[k] * self.table[k][a][b] for k in n_kinds) for b in range(n)]
            for a in range(n)
        ]
        # per slot, every slot from nearest to farthest (ties by index)
        self.nearest = [sorted(range(n), key=lambda b: (row[b], b)) for row in self.pair_cost]
        self.work = 0  # pairs looked at by group_cost: the heuristic's deterministic budget
        # rank -> [(kind index, group index)], to recompute only what a swap touches
        self.member: list[list[tuple[int, int]]] = [[] for _ in range(self.world)]
        for ki, gs in enumerate(self.groups):
            for gi, g in enumerate(gs):
                for r in g:
                    self.member[r].append((ki, gi))

    def _link(self, a: Slot, b: Slot) -> Link:
        if a.host != b.host:
            net = self.topo.network
            ab, ba = net[a.host][b.host], net[b.host][a.host]
            if ab == ba:
                return ab
            # a ring uses both directions: the slower figure of each bounds it
            return Link(
                kind="NET",
                bandwidth=min(ab.bandwidth, ba.bandwidth),
                latency=max(ab.latency, ba.latency),
                measured=ab.measured and ba.measured,
            )
        if a.dev is None or b.dev is None or a.dev == b.dev:
            return self.topo.network[a.host][a.host]  # procs of one host (CPU procs)
        return self.topo.hosts[a.host].links[a.dev][b.dev]

    def group_cost(self, ki: int, group: Sequence[int], assign: Sequence[int]) -> float:
        if len(group) < 2:
            return 0.0
        t = self.table[ki]
        s = [assign[r] for r in group]
        self.work += len(s) * (len(s) - 1) // 2
        worst = max(t[x][y] for i, x in enumerate(s) for y in s[i + 1 :])
        return self.factor[ki] * worst

    def costs(self, assign: Sequence[int]) -> list[list[float]]:
        return [[self.group_cost(ki, g, assign) for g in gs] for ki, gs in enumerate(self.groups)]

    def total(self, assign: Sequence[int]) -> float:
        return sum(max(c, default=0.0) for c in self.costs(assign))


def better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Is the (total, sum of all groups) key `a` strictly better than `b`, beyond rounding?"""
    tol = REL_TOL * max(abs(b[0]), 1e-30)
    if a[0] < b[0] - tol:
        return True
    if a[0] > b[0] + tol:
        return False
    return a[1] < b[1] - REL_TOL * max(abs(b[1]), 1e-30)


def local_search(prob: Problem, assign: list[int], work_limit: int) -> list[int]:
    """Swap two ranks' slots, or a rank's slot with an unused one, while that lowers the cost,
    until no swap does or `prob.work` passes `work_limit`.

    The key is (total, sum of every group's cost): the sum breaks the total's plateaus (a swap
    that speeds up a group which is not the slowest changes only the sum).
    """
    assign = list(assign)
    costs = prob.costs(assign)

    def key() -> tuple[float, float]:
        return (
            sum(max(c, default=0.0) for c in costs),
            sum(sum(c) for c in costs),
        )

    def refresh(ranks: Sequence[int]) -> list[tuple[int, int, float]]:
        old = []
        for ki, gi in {m for r in ranks for m in prob.member[r]}:
            old.append((ki, gi, costs[ki][gi]))
            costs[ki][gi] = prob.group_cost(ki, prob.groups[ki][gi], assign)
        return old

    def undo(old: list[tuple[int, int, float]]) -> None:
        for ki, gi, c in old:
            costs[ki][gi] = c

    best = key()
    n_slots = len(prob.slots)
    for _ in range(_MAX_PASSES):
        improved = False
        for r1 in range(prob.world):
            if prob.work > work_limit:
                return assign
            # swap with another rank (when they are not in exactly the same groups: a no-op)
            for r2 in range(r1 + 1, prob.world):
                if prob.member[r1] == prob.member[r2] or assign[r1] == assign[r2]:
                    continue
                assign[r1], assign[r2] = assign[r2], assign[r1]
                old = refresh((r1, r2))
                k = key()
                if better(k, best):
                    best, improved = k, True
                else:
                    assign[r1], assign[r2] = assign[r2], assign[r1]
                    undo(old)
            # move to an unused slot
            used = set(assign)
            for s in range(n_slots):
                if s in used:
                    continue
                prev = assign[r1]
                assign[r1] = s
                old = refresh((r1,))
                k = key()
                if better(k, best):
                    best, improved = k, True
                    used.discard(prev)
                    used.add(s)
                else:
                    assign[r1] = prev
                    undo(old)
        if not improved:
            break
    return assign


def islands_first(prob: Problem, chain_hosts: bool) -> list[int]:
    """Slot indexes, hosts (chained along their fastest links, or in topology order) one after
    another, and within a host its NVLink islands largest first: so that contiguous ranks (the
    innermost, most talkative groups) share the tightest links."""
    topo = prob.topo
    by_host: dict[int, list[int]] = {}
    for i, s in enumerate(prob.slots):
        by_host.setdefault(s.host, []).append(i)
    hosts = list(by_host)
    if chain_hosts and len(hosts) > 2:
        # start at the host with the most slots, then always the nearest unvisited host
        order = [max(hosts, key=lambda h: (len(by_host[h]), -h))]
        left = [h for h in hosts if h != order[0]]
        while left:
            here = by_host[order[-1]][0]
            nxt = min(
                left, key=lambda h: (prob.pair_cost[here][by_host[h][0]], -len(by_host[h]), h)
            )
            order.append(nxt)
            left.remove(nxt)
        hosts = order
    out = []
    for h in hosts:
        host = topo.hosts[h]
        rank_in_host = {}
        for k, island in enumerate(host.islands()):
            for pos in island:
                rank_in_host[pos] = k
        out.extend(
            sorted(by_host[h], key=lambda i: (rank_in_host.get(prob.slots[i].dev or 0, 0), i))
        )
    return out


def grow(prob: Problem, seed: int, kind: int | None) -> list[int]:
    """An assignment grown from slot `seed`, block by block.

    kind None: ranks in order, blocks nested as the rank layout (a TP group, a replica's ranks,
    the world). kind k: the groups of kind k one after another, each a block, so that those
    groups come out tight even when they are not contiguous ranks (e.g. HSDP's replicas, or
    shard groups when TP groups had better cross hosts).

    Distance is what a pair would cost if it were the slowest pair of a group of every kind.
    Each next slot is the one nearest the blocks being filled (the sum over blocks of its worst
    link to their members); for a block it would start, a slot is judged by how near its
    nearest free neighbours are (the block it could complete), so a block does not open where
    it cannot close tightly.
    """
    if kind is None:
        _, sh, tp = prob.shape.dims
        levels = sorted({tp, tp * sh, prob.world} - {1})
        ranks = list(range(prob.world))
    else:
        groups = prob.groups[kind]
        levels = sorted({len(groups[0]), prob.world} - {1})
        ranks = [r for g in groups for r in g]
    n_slots = len(prob.slots)
    dist, near = prob.pair_cost, prob.nearest
    order = [seed]
    used = [False] * n_slots
    used[seed] = True
    # per level: each slot's worst link to the members of that level's block being filled
    worst = [list(dist[seed]) for _ in levels]

    def completion(s: int, size: int) -> float:
        """The worst link from `s` to the size - 1 nearest free slots."""
        need, far = size - 1, 0.0
        for b in near[s]:
            if need == 0:
                break
            if b != s and not used[b]:
                need, far = need - 1, dist[s][b]
        return far if need == 0 else math.inf

    while len(order) < prob.world:
        n = len(order)
        opening = [n % size == 0 for size in levels]

        def key(s: int, opening: list[bool] = opening) -> tuple[float, int]:
            return (
                sum(
                    completion(s, size) if new else worst[lv][s]
                    for lv, (size, new) in enumerate(zip(levels, opening))
                ),
                s,
            )

        nxt = min((s for s in range(n_slots) if not used[s]), key=key)
        order.append(nxt)
        used[nxt] = True
        row = dist[nxt]
        for lv, new in enumerate(opening):
            w = worst[lv]
            worst[lv] = list(row) if new else [max(a, b) for a, b in zip(w, row)]
    assign = [0] * prob.world
    for r, slot in zip(ranks, order):
        assign[r] = slot
    return assign


def seeds(prob: Problem) -> list[int]:
    """Slots that grown orders start from: one per NVLink island (per host for CPU procs),
    every host's largest island first, so a capped list still covers many hosts."""
    firsts: list[tuple[int, int, int]] = []  # (island's rank on its host, host, slot)
    seen: set[tuple[int, int]] = set()
    island_of: dict[int, dict[int, int]] = {}
    for i, s in enumerate(prob.slots):
        if s.host not in island_of:
            isl = prob.topo.hosts[s.host].islands()
            island_of[s.host] = {d: k for k, members in enumerate(isl) for d in members}
        k = 0 if s.dev is None else island_of[s.host][s.dev]
        if (s.host, k) not in seen:
            seen.add((s.host, k))
            firsts.append((k, s.host, i))
    return [i for _, _, i in sorted(firsts)][:_MAX_SEEDS]


def heuristic(prob: Problem, naive: list[int], naive_cost: float) -> list[int]:
    """Swap searches from the naive order and the most promising islands-first and grown
    orders (all of them on small problems), within a fixed budget of work."""
    kinds = [None, *(k for k, gs in enumerate(prob.groups) if len(gs[0]) > 1)]
    starts = [
        *(islands_first(prob, chain)[: prob.world] for chain in (True, False)),
        *(grow(prob, seed, kind) for seed in seeds(prob) for kind in kinds),
    ]
    unique = {tuple(s): prob.total(s) for s in starts}
    ranked = sorted(unique, key=lambda s: unique[s])  # stable: ties keep the order above
    if prob.world * len(prob.slots) > _SMALL:
        ranked = ranked[:_SEARCHED_STARTS]
    work_limit = prob.work + _WORK_BUDGET
    best, best_cost = naive, naive_cost
    for start in [tuple(naive), *(s for s in ranked if s != tuple(naive))]:
        found = local_search(prob, list(start), work_limit)
        cost = prob.total(found)
        if cost < best_cost - REL_TOL * best_cost:
            best, best_cost = found, cost
    return best


def exact(prob: Problem, start: list[int]) -> list[int]:
    """The cheapest injective map of ranks onto slots, by branch and bound over every one.

    Ranks are placed in order; a group's cost so far (its slowest pair among placed members)
    only grows as more members are placed, so the sum over kinds of the slowest group so far is
    a lower bound, and a branch whose bound is not strictly below the best found is cut. Starts
    from `start` (a known order), which is returned unless something is strictly cheaper.
    """
    world, n_slots = prob.world, len(prob.slots)
    best_cost = prob.total(start)
    best = list(start)
    # for rank r: [(kind, group, members placed before r)]
    earlier = [
        [(ki, gi, [m for m in prob.groups[ki][gi] if m < r]) for ki, gi in prob.member[r]]
        for r in range(world)
    ]
    n_groups = [len(gs) for gs in prob.groups]
    partial = [[0.0] * n for n in n_groups]  # slowest pair time so far, per group
    assign = [-1] * world
    used = [False] * n_slots
    limit = best_cost * (1 - REL_TOL)

    def visit(r: int, kind_max: list[float]) -> None:
        nonlocal best_cost, limit
        if r == world:
            cost = sum(f * m for f, m in zip(prob.factor, kind_max))
            if cost < limit:
                best_cost, limit = cost, cost * (1 - REL_TOL)
                best[:] = assign
            return
        for s in range(n_slots):
            if used[s]:
                continue
            new_max = list(kind_max)
            saved = []
            for ki, gi, members in earlier[r]:
                t = prob.table[ki][s]
                worst = partial[ki][gi]
                for m in members:
                    worst = max(worst, t[assign[m]])
                saved.append((ki, gi, partial[ki][gi]))
                partial[ki][gi] = worst
                new_max[ki] = max(new_max[ki], worst)
            if sum(f * m for f, m in zip(prob.factor, new_max)) < limit:
                used[s], assign[r] = True, s
                visit(r + 1, new_max)
                used[s], assign[r] = False, -1
            for ki, gi, old in saved:
                partial[ki][gi] = old

    visit(0, [0.0] * len(prob.kinds))
    return best
