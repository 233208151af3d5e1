"""The run's workers: GRPO's generators or PPO's environment runners (`raymesh.rl.roles` says
which), each an actor on a proc of its own (`Worker`), spawned by a `WorkerSpawner`, stopped
together at the run's end (`stop_workers`).

A worker's proc is spawned with `escalate=False`: its death is the loop's to handle (it
replaces the worker and makes its keys again), never the controller's end.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from raymesh.actor import Future, ProcMesh, SupervisionError, this_host
from raymesh.rl.buffer import Rollout
from raymesh.rl.roles import Roles, check_context

__all__ = ["Worker", "WorkerSpawner", "measure_prompts", "stop_workers"]

logger = logging.getLogger("raymesh")


@dataclass
class Worker:
    """One worker: its proc, its actor, and its sampling call in flight (`call`, None when
    idle) with the keys it was given."""

    procs: ProcMesh
    actor: Any
    keys: list[int] = field(default_factory=list)
    call: Future[list[Rollout]] | None = None


class WorkerSpawner:
    """Spawns `roles`' worker for an index, on a new proc. Incarnations are counted over the
    whole run, so a replacement is never given one its predecessor had (PPO's runners seed
    their environments by it)."""

    def __init__(self, roles: Roles) -> None:
        self._roles = roles
        self._incarnations = itertools.count()

    def __call__(self, index: int) -> Worker:
        name = self._roles.name
        procs = this_host().spawn_procs(per_host={"procs": 1}, name=f"rl-{name}", escalate=False)
        cls, args, kwargs = self._roles.worker(index, next(self._incarnations))
        return Worker(procs, procs.spawn(name, cls, *args, **kwargs))


def measure_prompts(worker: Worker, roles: Roles, timeout_s: float) -> None:
    """Check GRPO's prompts against the policy's context, as `worker` tokenizes them
    (`check_context`). ValueError, before the learner's procs start (it would fail at every
    step): for a prompt that does not fit, or when the worker's constructor refused what it
    was given (the policy, its init, the reward)."""
    measure = worker.actor.measure.call_one(list(roles.prompts))
    try:
        context, lengths = measure.get(timeout=timeout_s)
    except SupervisionError as e:
        if e.failure.kind != "init_error":
            raise
        # Bad input, said as such rather than as a proc's failure.
        raise ValueError(f"the {roles.title} could not start: {e.failure.cause}") from e
    check_context(roles.prompts, lengths, context, roles.max_tokens)


def stop_workers(workers: list[Worker]) -> None:
    """Stop every worker's proc, waiting up to 60 s for each; a failure to stop one is logged
    and the rest are stopped still."""
    for w in workers:
        try:
            w.procs.stop().get(timeout=60)
        except Exception as e:  # stopping the rest matters more than this one's error
            logger.warning("raymesh.rl: stopping %s failed: %s", w.procs, e)
