"""The loop of `rl.run` (`raymesh.rl.api` starts its roles and ends it): a mesh of workers
making rollouts (`raymesh.rl.workers`) and a learner that is a raymesh.train job the loop
drives (`raymesh.rl.learner_job`), on one controller: GRPO's generators answering prompts, or
PPO's environment runners (`raymesh.rl.roles` says what each spawns; the loop is the same).

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

For PPO a key is one runner's segment (`rollout_steps` steps of its environments); a step takes
one per runner.

Faults: a generator (or runner) whose proc dies is replaced by a new proc, which installs the
current version; the keys it held are made again, by the same (seed, version, key, index), so
none is lost, and the buffer takes each key once, so none is counted twice. A rollout found
too stale is dropped and its key made again. Every wait has a timeout (`timeout_s`):
TimeoutError, never a hang.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from raymesh.actor import Shared
from raymesh.rl.algorithms import Stats
from raymesh.rl.buffer import Rollout, RolloutBuffer
from raymesh.rl.position import Position
from raymesh.rl.workers import Worker
from raymesh.train import ShardedState

logger = logging.getLogger("raymesh")

# A policy version and its weights, stored once: rank 0's copy, or a sharded learner job's
# shards, which each reader assembles.
Published = tuple[int, Shared[dict[str, torch.Tensor]] | ShardedState]

_POLL_S = 0.5  # the longest the loop waits between looks at the calls (a reply wakes it)


class Loop:
    """The loop's state: the keys handed out and to make again, the buffer, the version
    published, the keys the learner took, and the workers replaced (see the module)."""

    def __init__(
        self,
        request: Callable[[list[int]], Any],
        per_step: int,
        max_staleness: int,
        timeout_s: float,
        new_worker: Callable[[int], Worker],
    ) -> None:
        self.request = request
        self.per_step = per_step
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.new_worker = new_worker
        self.buffer = RolloutBuffer(
            capacity=(max_staleness + 1) * per_step, max_staleness=max_staleness
        )
        self.todo: collections.deque[int] = collections.deque()  # keys to make again
        self.next_key = 0
        self.remade: list[int] = []
        self.replaced = 0
        self.published: Published | None = None
        self.arrived = threading.Event()  # a sampling call's reply (or failure) came in
        self.taken = Position()  # which keys the learner has taken
        self.check: Callable[[list[Rollout], int], None] | None = None  # a step's batch
        self.tell: Callable[..., None] | None = None  # a replaced worker, to the run folder
        self.workers: list[Worker] = []
        self.cycle = 0.0  # when the previous update began (a cycle of the loop)

    def position(self) -> dict[str, Any]:
        """Which keys have been taken (JSON data, saved with a checkpoint)."""
        return self.taken.to_json()

    def restore(self, position: Any) -> None:
        """Continue from a saved `position`: the keys not taken below the highest taken one
        are made again first, then new ones. ValueError naming the field for a position no
        run of these settings wrote: its keys may reach past the lowest not taken by many
        steps' worth, not without bound (the keys to make again are listed)."""
        span_limit = 1024 + 16 * (self.max_staleness + 1) * self.per_step
        self.next_key, missing = self.taken.restore(position, span_limit=span_limit)
        self.todo.extend(missing)

    def run(
        self,
        learner: Any,
        workers: list[Worker],
        start_step: int,
        steps: int,
        sinks: list[Callable[[Stats], None]],
        stop: Callable[[Stats], bool] | None,
        save_every: int,
    ) -> list[Stats]:
        """Steps `start_step` .. `steps` - 1 with `workers` (a lost one is replaced in the
        list), ending early after the first step whose statistics `stop` accepts; each step's
        statistics, in order, handed to every sink as it ends. The learner checkpoints every
        `save_every` steps (0: never), but not after the last step: its save is the caller's."""
        self.workers = workers
        self._publish(learner.weights())
        history: list[Stats] = []
        self.cycle = time.perf_counter()
        for step in range(start_step, steps):
            stats = self._step(learner, step)
            history.append(stats)
            for sink in sinks:
                sink(stats)
            if stop is not None and stop(stats):
                break
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                learner.save(self.position())
        return history

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The version published last and a copy of its weights, read from the learner."""
        assert self.published is not None
        version, shared = self.published
        return version, {k: v.clone() for k, v in shared.get(timeout=self.timeout_s).items()}

    def _step(self, learner: Any, step: int) -> Stats:
        """Step `step`: its rollouts collected and checked, the learner's update on them (the
        version goes up by one), that version published; the update's statistics and the
        step's timings."""
        start = time.perf_counter()
        batch = self._collect(step)
        if self.check is not None:
            self.check(batch, step)  # e.g. RewardError: nothing in it could be scored
        self.taken.took(r.key for r in batch)
        learning = time.perf_counter()
        stats = learner.learn(batch, cycle_s=max(learning - self.cycle, 1e-9))
        self.cycle = learning
        syncing = time.perf_counter()
        self._publish(learner.weights())
        end = time.perf_counter()
        took = max(end - start, 1e-9)
        return {
            **stats,
            "step_s": end - start,
            "learn_s": syncing - learning,
            "sync_s": end - syncing,
            "rollouts_per_s": len(batch) / took,
            # GRPO's samples are completions, PPO's environment steps
            "samples_per_s": stats.get("samples", stats.get("env_steps", 0.0)) / took,
        }

    def _publish(self, published: Published) -> None:
        """Hand version v to every worker: queued behind its current call, so it is
        installed between two calls. The weights travel as a reference: one copy in the
        learner's object store, read by each worker, none through this process."""
        self.published = published
        for w in self.workers:
            w.actor.load.call_one(*published)

    def _collect(self, step: int) -> list[Rollout]:
        """The step's rollouts, keeping the workers busy meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        limit = (step + 1 + self.max_staleness) * self.per_step  # keys handed out so far, at most
        while True:
            self.arrived.clear()  # before looking: a reply that comes after it sets it again
            self._harvest()
            for key in self.buffer.stale():
                self.remade.append(key)
                self.todo.append(key)
            self._dispatch(limit)
            try:
                return self.buffer.take(self.per_step, version=step, timeout_s=0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rl.run: step {step} got fewer than {self.per_step} rollouts in "
                        f"{self.timeout_s:g}s; the generators or environment runners are not "
                        "delivering"
                    ) from None
            # Woken by a reply (or a proc's death); _POLL_S bounds the wait regardless.
            self.arrived.wait(_POLL_S)

    def _dispatch(self, limit: int) -> None:
        """Give each idle worker its share of keys: those to make again first, then new ones
        below `limit`."""
        chunk = max(1, math.ceil(self.per_step / len(self.workers)))
        for w in self.workers:
            if w.call is not None:
                continue
            keys: list[int] = []
            while len(keys) < chunk and (self.todo or self.next_key < limit):
                if self.todo:
                    keys.append(self.todo.popleft())
                else:
                    keys.append(self.next_key)
                    self.next_key += 1
            if keys:
                w.keys = keys
                w.call = w.actor.sample.call_one(self.request(keys))
                w.call.add_done_callback(self.arrived.set)

    def _harvest(self) -> None:
        """Put the rollouts of every call that has ended into the buffer; a worker whose call
        failed is replaced."""
        for i, w in enumerate(self.workers):
            if w.call is None or not w.call.done():
                continue
            try:
                rollouts = w.call.get(timeout=self.timeout_s)
            except Exception as e:  # its proc died (SupervisionError) or the call raised
                self._replace(i, e)
                continue
            w.call, w.keys = None, []
            for r in rollouts:
                self.buffer.put(r, timeout_s=self.timeout_s)

    def _replace(self, index: int, error: Exception) -> None:
        """Replace the worker at `index`, lost to `error`: its keys are made again first, and
        the new one installs the version published last (told to the run folder)."""
        lost = self.workers[index]
        logger.warning(
            "raymesh.rl: worker %d (a generator or environment runner) lost (%s); replacing it",
            index,
            error,
        )
        self.remade.extend(lost.keys)
        self.todo.extendleft(reversed(lost.keys))
        lost.procs.stop()
        new = self.workers[index] = self.new_worker(index)
        self.replaced += 1
        if self.tell is not None:
            cause = (str(error).splitlines() or [type(error).__name__])[0][:300]
            pid = new.procs.pids[0]
            self.tell(index=index, cause=cause, keys=list(lost.keys), pid=pid)
        if self.published is not None:
            new.actor.load.call_one(*self.published)
