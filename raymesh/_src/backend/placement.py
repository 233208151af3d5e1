"""Where a mesh's procs can go: what the cluster's nodes can ever hold (`check_feasible`), what
they hold free now (`free_slots`), and the placement group that reserves one bundle per proc
on its node (`reserve`). Each refusal is a `PlacementError` saying what was asked, what the
cluster has, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.util.placement_group import placement_group, remove_placement_group

from raymesh._src.backend import runtime

__all__ = ["PlacementError", "check_feasible", "free_slots", "reserve"]


class PlacementError(RuntimeError):
    """The cluster cannot (or not in time) give a mesh the resources it asked for."""


def check_feasible(
    node_ids: Sequence[str], resources: dict[str, float], asked: str
) -> dict[str, int]:
    """Fail at once when the hosts can never hold the procs; returns procs per node."""
    per_node: dict[str, int] = {}
    for n in node_ids:
        per_node[n] = per_node.get(n, 0) + 1
    totals = {n.node_id: n.resources for n in runtime.nodes()}
    for node, count in per_node.items():
        total = totals.get(node)
        if total is None:
            raise PlacementError(f"{asked}: host {node[:12]} is not an alive Ray node")
        for key, amount in resources.items():
            need = amount * count
            have = total.get(key, 0.0)
            if need > have + 1e-9:
                fix = (
                    "this cluster has no GPUs: use a CPU axis name such as 'procs' instead of "
                    "'gpus', or run on a cluster with GPUs"
                    if key == "GPU" and sum(t.get("GPU", 0) for t in totals.values()) == 0
                    else "this host runs no procs (like a head node started with num_cpus=0): "
                    "spawn on host_mesh(), which leaves such hosts out"
                    if have == 0
                    else f"ask for at most {int(have // amount)} procs per host, or add capacity "
                    f"(RAYMESH_NUM_CPUS for the local default, `ray start --num-cpus` on a "
                    f"cluster)"
                )
                raise PlacementError(
                    f"{asked}: needs {need:g} {key} on host {node[:12]} ({count} procs x "
                    f"{amount:g}), which has {have:g} {key} in total. Fix: {fix}."
                )
    return per_node


def reserve(
    node_ids: Sequence[str], resources: dict[str, float], timeout: float, asked: str
) -> Any:
    """A placement group of one bundle of `resources` per proc, the i-th on `node_ids[i]`,
    ready; PlacementError (what was asked, what is free, the fix) when it is not within
    `timeout` seconds (the group is removed then)."""
    pg = placement_group(
        [dict(resources) for _ in node_ids],
        strategy="PACK",
        bundle_label_selector=[{"ray.io/node-id": n} for n in node_ids],
    )
    if not pg.wait(timeout_seconds=timeout):
        remove_placement_group(pg)
        raise PlacementError(
            f"{asked}: the resources were not free within {timeout:.0f}s. "
            f"Asked for {len(node_ids)} procs of {resources}; free now: "
            f"{_fmt_res(runtime.available_resources())}. Fix: stop other meshes, ask for fewer "
            f"procs, or raise the timeout (spawn_procs(..., timeout=...))."
        )
    return pg


def free_slots(resources: dict[str, float]) -> dict[str, int]:
    """How many procs of `resources` each alive node could hold right now (nodes with room
    only), in `runtime.nodes()` order: the caller's node first. A snapshot: another spawn may
    take the room before this caller does."""
    from ray._private import state  # Ray has no public per-node view of free resources

    runtime.ensure_ray()
    free = state.available_resources_per_node()
    out: dict[str, int] = {}
    for node in runtime.nodes():
        have = free.get(node.node_id, {})
        fits = min(
            (int(have.get(k, 0.0) / v + 1e-9) if v > 0 else 1 << 30 for k, v in resources.items()),
            default=0,
        )
        if fits > 0:
            out[node.node_id] = fits
    return out


def _fmt_res(res: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in res]
    return ", ".join(f"{k}={res[k]:g}" for k in keys) or "nothing"
