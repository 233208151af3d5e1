"""Creating, addressing and ending procs: placement groups + proc host actors + host agents."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymesh._src.backend import channel, log_barrier, pool, ray_output, runtime
from raymesh._src.backend.host_agent import REFILL_IDLE, REFILL_WAIT_S, host_agent, own_agent
from raymesh._src.backend.placement import PlacementError, check_feasible, reserve
from raymesh._src.backend.proc_host import ProcHost, StartRuntime, inherited_origin
from raymesh._src.shape import Point

_RUNTIME_ENV: dict | None = None
logger = logging.getLogger(__name__)


def node_alive(node_id: str) -> bool:
    return any(n.node_id == node_id for n in runtime.nodes())


def prepare(node_id: str) -> None:
    """Start what spawns on `node_id` will need, without waiting: its host agent (every spawn
    waits for it), then, once the agent is up, its warm procs. In that order because Ray starts
    worker processes a few at a time, in no particular order: an agent behind eight warm procs
    would hold up the first spawn. On a local runtime, whose agent watches procs, this job's
    own agent starts too, in the background: what an actor asks the driver's agent to own
    (`registry`) must live with this driver, not with the runtime nor with that actor.
    Attached to the runtime, its warm procs are this job's: no pool of its own starts."""
    own_agent(node_id)
    if runtime.attached() is not None:
        return
    pool.fill({node_id: pool.size()}, after=host_agent(node_id).info.remote(), untouched_only=True)


def _prepare_this_node() -> None:
    prepare(runtime.current_node_id())


runtime.on_connect(_prepare_this_node)  # ready before a new session's first spawn asks


@dataclass
class RayProc:
    """One proc: its Ray actor handle, where its process runs, its channel's address (None:
    messages go through Ray only), and the files its stdout and stderr write (None: unknown;
    see `log_barrier`)."""

    handle: Any
    pid: int
    node_id: str
    channel: str | None = None
    logs: tuple[str, str] | None = None

    def submit(
        self,
        actor_key: str,
        sender: str,
        seq: int,
        endpoint: str,
        payload: Any,
        message_point: tuple,
        reply: bool,
    ) -> Any:
        # Small messages to a proc on this host take its channel: about a third of Ray's round trip.
        # A payload already in the object store (a list holding its ref) stays on Ray.
        if (
            self.channel
            and type(payload) is not list
            and channel.enabled()
            and self.node_id == runtime.current_node_id()
        ):
            header = (actor_key, sender, seq, endpoint, message_point, reply)
            fetch = self.handle.take_reply.remote
            sent = channel.client().call(self.channel, header, payload, reply, fetch)
            if sent is not None:
                return sent
        # One tuple, not seven arguments: Ray's per-argument cost was ~0.7 ms a round trip here.
        return self.handle.handle.remote(
            (actor_key, sender, seq, endpoint, payload, message_point, reply)
        )

    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        payload: Any,
        spawner: Any = None,
    ) -> Any:
        """`spawner`: opaque here (the proc runtime's `Spawner`)."""
        return self.handle.spawn.remote(actor_key, mesh_name, point, cls, payload, spawner)

    def watch(self, timeout: float, route: str | None = None) -> Any:
        return self.handle.watch.remote(timeout, route)

    def stop_actor(self, actor_key: str) -> Any:
        return self.handle.stop_actor.remote(actor_key)

    def stop_all(self, timeout: float) -> Any:
        """Stop the proc's actors (their __cleanup__ runs) before it is ended."""
        return self.handle.stop_all.remote(timeout)

    def exit_status(self, timeout: float) -> dict[str, Any] | None:
        """How this proc's process ended, as its host agent saw it (None if unknown)."""
        if not node_alive(self.node_id):  # no agent to ask (and creating one would hang)
            return {"cause": f"was lost with its node {self.node_id[:12]}"}
        try:
            return ray.get(
                host_agent(self.node_id).exit_status.remote(self.pid, timeout),
                timeout=timeout + 5,
            )
        except Exception:
            return None


@dataclass
class ProcGroup:
    """The procs of one proc mesh and the placement group that reserves their resources."""

    procs: list[RayProc]
    pg: Any


def create_procs(
    mesh_name: str,
    points: Sequence[Point],
    node_ids: Sequence[str],
    resources: dict[str, float],
    timeout: float,
    asked: str,
    *,
    start_runtime: StartRuntime,
) -> ProcGroup:
    """Gang-schedule one proc per point, the i-th on node `node_ids[i]`, each with `resources`;
    each proc runs `start_runtime(mesh_name, point)`'s runtime (see `proc_host`).

    Raises PlacementError (saying what was asked and what the cluster has) when the nodes can
    never hold the procs, or when the resources are not free within `timeout` seconds.
    """
    runtime.ensure_ray()
    pool.check()
    per_node = check_feasible(node_ids, resources, asked)
    pg = reserve(node_ids, resources, timeout, asked)
    agents = {n: host_agent(n) for n in set(node_ids)}
    gpu = resources.get("GPU", 0) > 0
    # Warm procs first (see `pool`): a GPU proc must start inside its bundle to get its GPU.
    warm = {} if gpu else {n: deque(pool.take(n, k)) for n, k in per_node.items()}
    # Ray sets OMP_NUM_THREADS to a proc's whole CPUs unless the driver set it; likewise here.
    threads = None if "OMP_NUM_THREADS" in os.environ else max(1, int(resources.get("CPU", 0)))
    origin = inherited_origin()  # spawned by a proc of the local runtime's: its program's

    fresh = functools.partial(_fresh, mesh_name, points, resources, pg, start_runtime, origin)
    handles: list[Any] = []
    readiness: list[list[Any]] = []  # per proc
    shared: set[int] = set()  # indices of the runtime's procs
    for i, point in enumerate(points):
        if warm.get(node_ids[i]):
            w = warm[node_ids[i]].popleft()
            if w.origin is not None:
                shared.add(i)
            adopt = w.handle.adopt.remote(mesh_name, point, start_runtime, threads, w.origin)
            handle, refs = w.handle, [w.info, adopt]
        else:
            handle, refs = fresh(i)
        handles.append(handle)
        readiness.append(refs)
    # Ray starts worker processes a few at a time (about one per core), each importing Python,
    # Ray and raymesh: allow for that on top of the placement timeout.
    start_timeout = timeout + 60 + 5 * max(per_node.values(), default=0)
    try:
        ready = _started(handles, readiness, fresh, shared, start_timeout, mesh_name)
    except Exception as e:
        kill(ProcGroup([RayProc(h, -1, "") for h in handles], pg))
        detail = (
            f"they did not all start within {start_timeout:.0f}s"
            if isinstance(e, ray.exceptions.GetTimeoutError)
            else f"a proc failed to start: {e}"
        )
        raise PlacementError(
            f"{asked}: resources were reserved, but {detail}. Fix: spawn fewer procs per host, "
            "or pass a larger timeout"
        ) from None
    infos = [r for r in ready if r is not None]  # adopt() returns None
    if not gpu:  # top up behind this spawn, once its host has a core to spare (see `pool`)
        for n, k in per_node.items():
            pool.reserve(n)
            pool.fill({n: k}, after=agents[n].wait_idle.remote(*REFILL_IDLE, REFILL_WAIT_S))
    procs = [
        RayProc(h, i["pid"], i["node_id"], i["channel"], _logs(i.get("logs")))
        for h, i in zip(handles, infos)
    ]
    if adopted := [procs[i].pid for i in sorted(shared)]:
        ray_output.forward_output_of(adopted)  # the runtime's procs print here, as our own do
    # Registered before spawn returns, so that a proc killed right away still has its exit seen.
    ray.get(
        [agents[n].watch.remote([p.pid for p in procs if p.node_id == n]) for n in agents],
        timeout=max(timeout, 60),
    )
    return ProcGroup(procs, pg)


def _logs(paths: Any) -> tuple[str, str] | None:
    """A proc's log files as its `info()` gave them (a local runtime's warm proc, started by
    older code, gives none)."""
    return (str(paths[0]), str(paths[1])) if paths else None


def _fresh(
    mesh_name: str,
    points: Sequence[Point],
    resources: dict[str, float],
    pg: Any,
    start_runtime: StartRuntime,
    origin: Any,
    i: int,
) -> tuple[Any, list[Any]]:
    """A new proc in bundle i of `pg`, and the refs that resolve once it is ready."""
    handle = ProcHost.options(
        num_cpus=resources.get("CPU", 0),
        num_gpus=resources.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        runtime_env=_RUNTIME_ENV,
    ).remote(mesh_name, points[i], start_runtime, (), origin)
    return handle, [handle.info.remote()]


def _started(
    handles: list[Any],
    readiness: list[list[Any]],
    fresh: Callable[[int], tuple[Any, list[Any]]],
    shared: set[int],
    timeout: float,
    mesh_name: str,
) -> list[Any]:
    """What the procs' readiness refs resolve to, in order, once all are ready. A proc whose
    worker process died before it ran is started again once, `fresh` in its bundle (updating
    `handles`, `readiness` and `shared` in place): a Ray worker can die as it starts (its
    registration with a loaded raylet failing), which is no fault of the spawn. A second
    death, or `timeout` seconds, raise."""
    deadline = time.monotonic() + timeout
    retried: set[int] = set()
    while True:
        try:
            flat = [r for refs in readiness for r in refs]
            return list(ray.get(flat, timeout=max(0.1, deadline - time.monotonic())))
        except ray.exceptions.RayActorError:
            dead = [i for i, refs in enumerate(readiness) if _died(refs)]
            if not dead or retried.intersection(dead):
                raise
            logger.warning(
                "raymesh: %d proc(s) of mesh %r died before they ran; starting them again",
                len(dead),
                mesh_name,
            )
            for i in dead:
                handles[i], readiness[i] = fresh(i)
                shared.discard(i)
                retried.add(i)


def _died(refs: list[Any]) -> bool:
    """Whether one of a proc's resolved readiness refs says its actor's process died (not
    that its constructor raised, which would raise again)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.ActorDiedError as e:
            if not e.actor_init_failed:
                return True
        except Exception:  # another failure (adopt() raised) is not a death
            pass
    return False


def end(group: ProcGroup, grace: float) -> None:
    """End every proc of the group gracefully (as Monarch stops procs: each exits as Python
    exits, running its finalizers), waiting at most `grace` seconds; then `kill` what is left."""
    if not ray.is_initialized():
        return
    for p in group.procs:
        try:
            p.handle.exit.remote()
        except Exception:  # gone already
            pass
    try:
        wait_exited(group.procs, grace)
    except Exception:  # an agent that did not answer: the kill below ends them anyway
        pass
    kill(group)


def kill(group: ProcGroup) -> None:
    """End every proc of the group and release its placement group. Does not wait."""
    if not ray.is_initialized():  # Ray already ended them (and must not be restarted here)
        return
    for p in group.procs:
        try:
            ray.kill(p.handle, no_restart=True)
        except Exception:
            pass
    try:
        remove_placement_group(group.pg)
    except Exception:
        pass


def flush_output(procs: Sequence[RayProc], timeout: float) -> dict[int, str]:
    """The flush barrier (see `log_barrier.flush`): wait until the output of `procs`, which
    have all exited, has been printed here, at most `timeout` seconds; the index of each proc
    whose output may be incomplete, and why."""
    return log_barrier.flush(procs, timeout)


def wait_exited(procs: Sequence[RayProc], timeout: float) -> list[int]:
    """Wait until the procs' processes are gone; return the pids still running."""
    by_node: dict[str, list[int]] = {}
    alive = {n.node_id for n in runtime.nodes()}
    for p in procs:
        if p.pid > 0 and p.node_id in alive:  # a lost node's processes went with it
            by_node.setdefault(p.node_id, []).append(p.pid)
    refs = [host_agent(n).wait_exited.remote(pids, timeout) for n, pids in by_node.items()]
    running: list[int] = []
    for r in ray.get(refs, timeout=timeout + 10):
        running.extend(r)
    return running


def kill_pid(node_id: str, pid: int, timeout: float = 10.0) -> None:
    """SIGKILL a proc's process through its host's agent (works for any node; a no-op for a
    node that is gone, with its processes)."""
    if not node_alive(node_id):
        return
    ray.get(host_agent(node_id).kill.remote(pid), timeout=timeout)


def self_proc() -> RayProc | None:
    """This process's own proc, when it is one (inside an actor); None in the controller."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE:
        return None
    try:
        handle = ctx.current_actor
    except Exception:
        return None
    return RayProc(handle, os.getpid(), ctx.get_node_id())
