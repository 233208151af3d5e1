"""`rl.run`: a mesh of workers making rollouts and a learner that is a raymesh.train job the
loop drives (`raymesh.rl.learner_job`), on one controller: GRPO's generators answering
prompts, or PPO's environment runners (`raymesh.rl.roles` says what each spawns; the loop is
the same).

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
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raymesh import train
from raymesh.actor import ActorMesh, Future, ProcMesh, Shared, SupervisionError, this_host
from raymesh.rl.algorithms import PPO, Stats
from raymesh.rl.buffer import Rollout, RolloutBuffer
from raymesh.rl.config import RLConfig
from raymesh.rl.learner_job import learner_config, start_learner
from raymesh.rl.position import Position
from raymesh.rl.roles import check_context, env_roles, text_roles
from raymesh.train import FailureRecord, ShardedState

__all__ = ["RLResult", "run"]

logger = logging.getLogger("raymesh")

# A policy version and its weights, stored once: rank 0's copy, or a sharded learner job's
# shards, which each reader assembles.
Published = tuple[int, Shared[dict[str, torch.Tensor]] | ShardedState]

_POLL_S = 0.5  # the longest the loop waits between looks at the calls (a reply wakes it)


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
    # the learner ranks lost and replaced (GRPO's learner job's `Result.failures`)
    learner_failures: list[FailureRecord] = field(default_factory=list)
    resumed_from: int = 0  # the version the run continued from (0: a fresh start)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


@dataclass
class _Gen:
    procs: ProcMesh
    actor: Any
    keys: list[int] = field(default_factory=list)
    call: Future[list[Rollout]] | None = None


def run(
    config: RLConfig | None = None,
    /,
    *,
    progress: Callable[[Stats], None] | None = None,
    stop: Callable[[Stats], bool] | None = None,
    **fields: Any,
) -> RLResult:
    """Run `config` (an `rl.RLConfig`), or the RLConfig of `fields` (its fields as keyword
    arguments: `rl.run(policy=..., steps=...)`; with a config, they replace its own): train
    `policy` with `algorithm`, for at most `steps` policy updates; the run ends early after the
    first step whose statistics `stop` accepts. `progress` gets each step's.

    GRPO (the default): post-train `policy` (a raymesh.train build function, or its
    "module:function" name, of a byte-level model or of a transformers causal LM with its
    tokenizer, LoRA or not, e.g. "raymesh.train.hf:build"; with `params` as its ctx.params;
    from the checkpoint `init` when given) on `prompts`
    scored by `reward` ((prompt, completion) -> float, or its "module:function" name, run where
    the samples are; or a mesh of reward actors, e.g. a reward model, whose endpoint
    `score(prompt, completion) -> float` is called for each completion, on the least busy
    actor, a completion dropped when its actor raises, dies or takes over `reward_timeout_s`;
    a step with none scored ends the run: `rl.RewardError`, naming the reward and why), with
    `prompts_per_step` prompts a step and `generators` generator procs sampling at most
    `max_staleness` policy versions behind. `checkpoint`: a folder to save the final policy
    in, as raymesh.train does (served by `raymesh serve --checkpoint`, read by `init=`), and
    every `checkpoint_every` steps as well (0: only at the end), each with the loop's position
    in the samples. `resume`: continue from the newest checkpoint there that verifies (policy,
    optimizer, version, position; e.g. after the controller died), or start fresh when there is
    none; `steps` counts from the start, so a finished run resumed does nothing more. With
    `max_staleness=0` a resumed run ends with the weights of the run that was not interrupted.

    trainer: the learner's train job, driven a step at a time by this loop
    (`train.drive`): a dict of `train.TrainConfig`'s fields (`workers`, `strategy`,
    `precision`, `gpus`, `cpus_per_worker`, `max_failures`, ...; an unknown one is refused by
    name), or a `TrainConfig`. A learner rank lost mid-step is replaced and the step trained
    again, so a synchronous run still ends with the fault-free run's weights. None: one rank.
    The loop sets what it owns: `steps`, `seed`, `global_batch_size` (GRPO: prompts_per_step
    x group_size; PPO: a minibatch; a TrainConfig's must be that, or 1), `build` and `params`
    (the policy's), the checkpoint (`checkpoint=`), `resume`, the run folder (`run_dir=`),
    and PPO's `grad_clip`.

    PPO (`rl.PPO(env=...)`): train `policy` (None: raymesh.rl.environments.ActorCritic) on
    the gymnasium environment `algorithm.env`, stepped by `env_runners` runner procs, one
    segment each a step; a version is `epochs` passes of minibatches, each a train step of the
    learner job. `checkpoint`, `checkpoint_every` and `resume` as GRPO's (the environments of
    a resumed run start afresh).

    Every step's statistics carry its timing: `step_s` (the whole step), `learn_s` (the
    learner's update), `sync_s` (fetching the new version's reference from the learner; its
    installation on the workers overlaps their next sampling) and `rollouts_per_s`.
    The run folder is the learner job's, written as any train job's (`run_dir`, else the
    `checkpoint` folder; `raymesh dashboard` shows it live): its "job" event says "kind": "rl"
    and the algorithm, a row per train step in `metrics.jsonl` (GRPO: one a version; PPO: a
    version's last) carries the loop's figures of the version (reward or episode return,
    staleness, samples, ...; the timings are in the statistics only), and its end says how
    the run ended (a loop's failure, such as `rl.RewardError`, as Failed, naming it).

    ValueError naming the field for a bad one, before any proc starts; TypeError for a
    keyword that is no RLConfig field."""
    names = [f.name for f in dataclasses.fields(RLConfig)]
    if unknown := sorted(set(fields) - set(names)):
        raise TypeError(f"rl.run: {unknown} are no rl.RLConfig fields; the fields are {names}")
    if config is None:
        config = RLConfig(**fields)
    elif not isinstance(config, RLConfig):
        raise TypeError(f"rl.run: give an rl.RLConfig, not {type(config).__name__}")
    elif fields:
        config = dataclasses.replace(config, **fields)
    algorithm, rollout = config.algorithm, config.rollout
    if isinstance(algorithm, PPO):
        roles = env_roles(config.task, runners=rollout.env_runners, seed=config.seed)
    else:
        roles = text_roles(config.task, rollout, seed=config.seed)
    learner_job = learner_config(
        config.trainer,
        roles.learner,
        algorithm,
        per_step=roles.per_step,
        steps=config.steps,
        seed=config.seed,
        save=config.save,
    )
    steps, max_staleness, timeout_s = config.steps, rollout.max_staleness, rollout.timeout_s
    checkpoint = config.checkpoint
    gens: list[_Gen] = []
    job: train.DrivenJob | None = None
    try:
        incarnations = itertools.count()

        def new_worker(index: int) -> _Gen:
            procs = this_host().spawn_procs(
                per_host={"procs": 1}, name=f"rl-{roles.name}", escalate=False
            )
            cls, args, kwargs = roles.worker(index, next(incarnations))
            return _Gen(procs, procs.spawn(roles.name, cls, *args, **kwargs))

        gens = [new_worker(i) for i in range(roles.workers)]
        if roles.prompts:  # before the learner's procs start: it would fail at every step
            measure = gens[0].actor.measure.call_one(list(roles.prompts))
            try:
                context, lengths = measure.get(timeout=timeout_s)
            except SupervisionError as e:
                if e.failure.kind != "init_error":
                    raise
                # Its constructor refused what it was given (the policy, its init, the
                # reward): bad input, said as such before the learner's procs start.
                raise ValueError(f"the {roles.title} could not start: {e.failure.cause}") from e
            check_context(roles.prompts, lengths, context, roles.max_tokens)
        learner = start_learner(roles.learner, algorithm, learner_job, per_step=roles.per_step)
        job = learner.job
        start, position = learner.resumed()
        if start:
            logger.info("raymesh.rl: resuming from %s (version %d)", checkpoint, start)
        loop = _Loop(roles.request, roles.per_step, max_staleness, timeout_s, new_worker)
        loop.check = roles.check
        loop.tell = functools.partial(job.tell, "replaced", role=roles.title)
        # The run folder's roles beside the learner's ranks (the job's own "mesh" events).
        job.tell("role", role=roles.title, count=len(gens), pids=[g.procs.pids[0] for g in gens])
        if isinstance(config.reward, ActorMesh):
            job.tell("role", role="reward actors", count=len(config.reward))
        job.tell("role", role="learner", count=job.world_size)
        try:
            loop.restore(position)
        except ValueError as e:  # the manifest's position, checked before a step
            raise ValueError(f"{checkpoint}: {e}") from None
        sinks = [progress] if progress is not None else []

        def save() -> str:
            return str(learner.save(loop.position()))

        every = config.checkpoint_every  # (0 without a checkpoint folder: SaveConfig)
        result = loop.run(learner, gens, start, steps, sinks, stop, every, save)
        result.resumed_from = start
        ended = job.close(extra={"rl": loop.position()})  # the final checkpoint
        result.checkpoint, result.learner_failures = ended.checkpoint, ended.failures
        return result
    except BaseException as e:
        if job is not None:  # its run folder says why the run ended
            try:
                job.stop(e)
            except Exception as told:  # the loop's error is the one to raise
                logger.warning("raymesh.rl: ending the learner job failed: %s", told)
        raise
    finally:
        for g in gens:
            try:
                g.procs.stop().get(timeout=60)
            except Exception as e:  # stopping the rest matters more than this one's error
                logger.warning("raymesh.rl: stopping %s failed: %s", g.procs, e)
        if job is not None:
            job.stop()  # nothing once closed


class _Loop:
    def __init__(
        self,
        request: Callable[[list[int]], Any],
        per_step: int,
        max_staleness: int,
        timeout_s: float,
        new_generator: Callable[[int], _Gen],
    ) -> None:
        self.request = request
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
        self.published: Published | None = None
        self.arrived = threading.Event()  # a sampling call's reply (or failure) came in
        self.taken = Position()  # which keys the learner has taken
        self.check: Callable[[list[Rollout], int], None] | None = None  # a step's batch
        self.tell: Callable[..., None] | None = None  # a replaced worker, to the run folder

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
        gens: list[_Gen],
        start_step: int,
        steps: int,
        sinks: list[Callable[[Stats], None]],
        stop: Callable[[Stats], bool] | None,
        save_every: int,
        save: Callable[[], str],
    ) -> RLResult:
        self.gens = gens
        self._publish(learner.weights())
        history = []
        cycle = time.perf_counter()  # when the previous update began (a cycle of the loop)
        for step in range(start_step, steps):
            start = time.perf_counter()
            batch = self._collect(step)
            if self.check is not None:
                self.check(batch, step)  # e.g. RewardError: nothing in it could be scored
            self.taken.took(r.key for r in batch)
            learning = time.perf_counter()
            stats = learner.learn(batch, cycle_s=max(learning - cycle, 1e-9))
            cycle = learning
            syncing = time.perf_counter()
            self._publish(learner.weights())
            end = time.perf_counter()
            took = max(end - start, 1e-9)
            stats = {
                **stats,
                "step_s": end - start,
                "learn_s": syncing - learning,
                "sync_s": end - syncing,
                "rollouts_per_s": len(batch) / took,
                # GRPO's samples are completions, PPO's environment steps
                "samples_per_s": stats.get("samples", stats.get("env_steps", 0.0)) / took,
            }
            history.append(stats)
            for sink in sinks:
                sink(stats)
            if stop is not None and stop(stats):
                break
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                save()  # the last step's save is the caller's
        assert self.published is not None
        version, shared = self.published
        weights = {k: v.clone() for k, v in shared.get(timeout=self.timeout_s).items()}
        return RLResult(history, version, weights, self.remade, self.replaced)

    def _publish(self, published: Published) -> None:
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
                        f"{self.timeout_s:g}s; the generators are not delivering"
                    ) from None
            # Woken by a reply (or a proc's death); _POLL_S bounds the wait regardless.
            self.arrived.wait(_POLL_S)

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
                g.call = g.actor.sample.call_one(self.request(keys))
                g.call.add_done_callback(self.arrived.set)

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
                self.gens[i] = self.new_generator(i)
                self.replaced += 1
                if self.tell is not None:
                    cause = (str(e).splitlines() or [type(e).__name__])[0][:300]
                    pid = self.gens[i].procs.pids[0]
                    self.tell(index=i, cause=cause, keys=list(g.keys), pid=pid)
                if self.published is not None:
                    self.gens[i].actor.load.call_one(*self.published)
                continue
            g.call, g.keys = None, []
            for r in rollouts:
                self.buffer.put(r, timeout_s=self.timeout_s)
