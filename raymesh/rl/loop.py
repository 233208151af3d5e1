"""`rl.run`: GRPO post-training with a mesh of generators and a learner, on one controller.

The loop, each step s (policy version s):
1. Keep every generator busy with keys (a key is one prompt's group: key k answers prompt
   k mod len(prompts)), up to `max_staleness` steps ahead of the learner. Their rollouts go to
   the bounded `RolloutBuffer`.
2. Take the step's `prompts_per_step` rollouts (smallest keys first, none older than version
   s - max_staleness), and have the learner take one GRPO step on them: version s + 1.
3. Publish version s + 1 to every generator. A generator installs it between two sampling
   calls (calls to one actor run in order), so the rollouts it makes afterwards are made by it.

With max_staleness=0 no key of step s + 1 is handed out before version s + 1 is published: the
loop is synchronous, and each step's batch is a function of the seed alone.

Faults: a generator whose proc dies is replaced by a new proc, which installs the current
version; the keys it held are made again, by the same (seed, version, key, index), so none is
lost, and the buffer takes each key once, so none is counted twice. A rollout found too stale
is dropped and its key made again. Every wait has a timeout (`timeout_s`): TimeoutError, never
a hang.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raymesh._common import bad, check_int, check_seconds, resolve
from raymesh.actor import Future, ProcMesh, Shared, this_host
from raymesh.rl.algorithms import GRPO, Stats
from raymesh.rl.buffer import Rollout, RolloutBuffer
from raymesh.rl.generator import Generator
from raymesh.rl.learner import Learner
from raymesh.rl.sampling import Reward

__all__ = ["RLResult", "run"]

logger = logging.getLogger("raymesh")

_POLL_S = 0.05  # how often the loop looks at the generators' calls while it waits


@dataclass
class RLResult:
    """What `run` did: one statistics row per step (`history`), the final policy version and
    its weights (`state_dict()`), the keys made again after a generator was lost or a rollout
    went stale, and how many generators were replaced."""

    history: list[Stats]
    version: int
    weights: dict[str, torch.Tensor]
    remade: list[int] = field(default_factory=list)
    replaced: int = 0
    checkpoint: str | None = None  # the step folder the final policy was saved in

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


@dataclass
class _Gen:
    procs: ProcMesh
    actor: Any
    keys: list[int] = field(default_factory=list)
    call: Future[list[Rollout]] | None = None


def run(
    *,
    policy: str | Callable[..., Any],
    prompts: Sequence[str | bytes],
    reward: Reward | str,
    algorithm: GRPO | None = None,
    steps: int,
    prompts_per_step: int = 4,
    generators: int = 2,
    max_staleness: int = 0,
    seed: int = 0,
    init: str | None = None,
    checkpoint: str | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[Stats], None] | None = None,
) -> RLResult:
    """Post-train `policy` (a raymesh.train build function of a byte-level model, or its
    "module:function" name; from the checkpoint `init` when given) on `prompts` scored by
    `reward` ((prompt, completion) -> float, or its "module:function" name), for `steps`
    GRPO steps of `prompts_per_step` prompts, with `generators` generator procs sampling at
    most `max_staleness` policy versions behind. `checkpoint`: a folder to save the final
    policy in, as raymesh.train does (served by `raymesh serve --checkpoint`, read by `init=`).
    `progress` gets each step's statistics.
    ValueError naming the argument for a bad one, before any proc starts."""
    algorithm = algorithm if algorithm is not None else GRPO()
    items = [p.encode() if isinstance(p, str) else p for p in prompts]
    if not items or not all(isinstance(p, bytes) for p in items):
        raise bad("prompts", f"{len(items)} prompt(s)", "give a non-empty list of strings")
    check_int("steps", steps, minimum=1)
    check_int("prompts_per_step", prompts_per_step, minimum=1)
    check_int("generators", generators, minimum=1)
    check_int("max_staleness", max_staleness, minimum=0)
    check_seconds("timeout_s", timeout_s)
    resolve(policy, "policy")  # a name that imports nothing fails here, not in every proc
    resolve(reward, "reward")
    # escalate=False: a dead learner surfaces as SupervisionError from its call, not as the
    # process-wide unhandled-fault hook.
    learner_procs = this_host().spawn_procs(
        per_host={"procs": 1}, name="rl-learner", escalate=False
    )
    gens: list[_Gen] = []
    try:
        learner = learner_procs.spawn("learner", Learner, policy, algorithm, seed=seed, init=init)

        def new_generator() -> _Gen:
            procs = this_host().spawn_procs(per_host={"procs": 1}, name="rl-gen", escalate=False)
            actor = procs.spawn("gen", Generator, policy, reward, algorithm, seed=seed, init=init)
            return _Gen(procs, actor)

        gens = [new_generator() for _ in range(generators)]
        loop = _Loop(items, prompts_per_step, max_staleness, timeout_s, new_generator)
        result = loop.run(learner, gens, steps, progress)
        if checkpoint is not None:
            result.checkpoint = learner.save.call_one(checkpoint).get(timeout=timeout_s)
        return result
    finally:
        for mesh in [*(g.procs for g in gens), learner_procs]:
            try:
                mesh.stop().get(timeout=60)
            except Exception as e:  # stopping the rest matters more than this one's error
                logger.warning("raymesh.rl: stopping %s failed: %s", mesh, e)


class _Loop:
    def __init__(
        self,
        prompts: list[bytes],
        per_step: int,
        max_staleness: int,
        timeout_s: float,
        new_generator: Callable[[], _Gen],
    ) -> None:
        self.prompts = prompts
        self.per_step = per_step
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.new_generator = new_generator
        self.buffer = RolloutBuffer(
            capacity=(max_staleness + 1) * per_step, max_staleness=max_staleness
        )
        self.todo: collections.deque[int] = collections.deque()  # keys to make again
        self.next_key = 0
        self.remade: list[int] = []
        self.replaced = 0
        self.published: tuple[int, Shared[dict[str, torch.Tensor]]] | None = None

    def run(
        self,
        learner: Any,
        gens: list[_Gen],
        steps: int,
        progress: Callable[[Stats], None] | None,
    ) -> RLResult:
        self.gens = gens
        self._publish(learner.weights.call_one().get(timeout=self.timeout_s))
        history = []
        for step in range(steps):
            batch = self._collect(step)
            stats = learner.learn.call_one(batch).get(timeout=self.timeout_s)
            history.append(stats)
            if progress is not None:
                progress(stats)
            self._publish(learner.weights.call_one().get(timeout=self.timeout_s))
        assert self.published is not None
        version, shared = self.published
        weights = {k: v.clone() for k, v in shared.get(timeout=self.timeout_s).items()}
        return RLResult(history, version, weights, self.remade, self.replaced)

    def _publish(self, published: tuple[int, Shared[dict[str, torch.Tensor]]]) -> None:
        """Hand version v to every generator: queued behind its current call, so it is
        installed between two calls. The weights travel as a reference: one copy in the
        learner's object store, read by each generator, none through this process."""
        self.published = published
        for g in self.gens:
            g.actor.load.call_one(*published)

    def _collect(self, step: int) -> list[Rollout]:
        """The step's rollouts, keeping the generators busy meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        limit = (step + 1 + self.max_staleness) * self.per_step  # keys handed out so far, at most
        while True:
            self._harvest()
            for key in self.buffer.stale():
                self.remade.append(key)
                self.todo.append(key)
            self._dispatch(limit)
            try:
                return self.buffer.take(self.per_step, version=step, timeout_s=_POLL_S)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rl.run: step {step} got fewer than {self.per_step} rollouts in "
                        f"{self.timeout_s:g}s; the generators are not delivering"
                    ) from None

    def _dispatch(self, limit: int) -> None:
        chunk = max(1, math.ceil(self.per_step / len(self.gens)))
        for g in self.gens:
            if g.call is not None:
                continue
            keys: list[int] = []
            while len(keys) < chunk and (self.todo or self.next_key < limit):
                if self.todo:
                    keys.append(self.todo.popleft())
                else:
                    keys.append(self.next_key)
                    self.next_key += 1
            if keys:
                g.keys = keys
                g.call = g.actor.sample.call_one([(k, self._prompt(k)) for k in keys])

    def _harvest(self) -> None:
        for i, g in enumerate(self.gens):
            if g.call is None or not g.call.done():
                continue
            try:
                rollouts = g.call.get(timeout=self.timeout_s)
            except Exception as e:  # its proc died (SupervisionError) or the call raised
                logger.warning("raymesh.rl: generator %d lost (%s); replacing it", i, e)
                self.remade.extend(g.keys)
                self.todo.extendleft(reversed(g.keys))
                g.procs.stop()
                self.gens[i] = self.new_generator()
                self.replaced += 1
                if self.published is not None:
                    self.gens[i].actor.load.call_one(*self.published)
                continue
            g.call, g.keys = None, []
            for r in rollouts:
                self.buffer.put(r, timeout_s=self.timeout_s)

    def _prompt(self, key: int) -> bytes:
        return self.prompts[key % len(self.prompts)]
