"""`rl.run`: an RL run's lifetime around its loop (`raymesh.rl.loop`): the config checked and
the roles decided before any proc starts (`raymesh.rl.roles`, `raymesh.rl.learner_job`); the
workers started, GRPO's prompts checked against the policy's context on one of them, then the
learner job; the loop driven from the version the job resumed at; the job closed with its
final checkpoint, and the run's `RLResult`.

Whatever ends the run, every proc it started is stopped. A failure once the learner job runs
is told to its run folder first (its Failed event names it), and is the error `run` raises.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from raymesh import train
from raymesh.actor import ActorMesh
from raymesh.rl.algorithms import PPO, Stats
from raymesh.rl.config import RLConfig
from raymesh.rl.learner import TrainedLearner, TrainedPPOLearner
from raymesh.rl.learner_job import learner_config, start_learner
from raymesh.rl.loop import Loop
from raymesh.rl.result import RLResult
from raymesh.rl.roles import env_roles, text_roles
from raymesh.rl.workers import Worker, WorkerSpawner, measure_prompts, stop_workers
from raymesh.train import DrivenJob

__all__ = ["run"]

logger = logging.getLogger("raymesh")

_Learner = TrainedLearner | TrainedPPOLearner


def run(
    config: RLConfig | None = None,
    /,
    *,
    progress: Callable[[Stats], None] | None = None,
    stop: Callable[[Stats], bool] | None = None,
    warm: train.WarmRanks | None = None,
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

    warm: a `train.WarmRanks` the learner job takes its ranks from and gives them back to,
    as `train.fit`'s: runs one after another in one program (a sweep) start their learners
    in procs that are already up.

    ValueError naming the field for a bad one, before any proc starts; TypeError for a
    keyword that is no RLConfig field."""
    state = _RunState(_config_of(config, fields), warm)  # its roles decided: no proc started
    try:
        return state.drive(state.start(), progress, stop)
    except BaseException as e:
        state.fail(e)
        raise
    finally:
        state.stop()


def _config_of(config: RLConfig | None, fields: dict[str, Any]) -> RLConfig:
    """`run`'s config: `config` with `fields` replacing its own, or the RLConfig of `fields`.
    TypeError for a keyword that is no RLConfig field, or a `config` that is no RLConfig."""
    names = [f.name for f in dataclasses.fields(RLConfig)]
    if unknown := sorted(set(fields) - set(names)):
        raise TypeError(f"rl.run: {unknown} are no rl.RLConfig fields; the fields are {names}")
    if config is None:
        return RLConfig(**fields)
    if not isinstance(config, RLConfig):
        raise TypeError(f"rl.run: give an rl.RLConfig, not {type(config).__name__}")
    return dataclasses.replace(config, **fields) if fields else config


class _RunState:
    """One run's roles and what it started of them: its workers (a list the loop replaces a
    lost one in) and the learner's job. Made before any proc starts: the roles' checks
    (ValueError naming the field) and the learner job's config are decided then."""

    def __init__(self, config: RLConfig, warm: train.WarmRanks | None = None) -> None:
        self.config, self.warm = config, warm
        if isinstance(config.algorithm, PPO):
            self.roles = env_roles(config.task, runners=config.env_runners, seed=config.seed)
        else:
            self.roles = text_roles(config.task, config.rollout, seed=config.seed)
        self.learner_job = learner_config(
            config.trainer,
            self.roles.learner,
            config.algorithm,
            per_step=self.roles.per_step,
            steps=config.steps,
            seed=config.seed,
            save=config.save,
        )
        self.spawn = WorkerSpawner(self.roles)
        self.workers: list[Worker] = []
        self.job: DrivenJob | None = None

    def start(self) -> _Learner:
        """Start the workers, check GRPO's prompts on the first (`measure_prompts`: before
        the learner's procs start, as it would fail at every step), then the learner's job
        (restored from its checkpoint when resuming)."""
        roles = self.roles
        for i in range(roles.workers):  # one at a time: if one fails, `stop` stops those up
            self.workers.append(self.spawn(i))
        if roles.prompts:
            measure_prompts(self.workers[0], roles, self.config.timeout_s)
        learner = start_learner(
            roles.learner,
            self.config.algorithm,
            self.learner_job,
            per_step=roles.per_step,
            warm=self.warm,
        )
        self.job = learner.job
        return learner

    def drive(
        self,
        learner: _Learner,
        progress: Callable[[Stats], None] | None,
        stop: Callable[[Stats], bool] | None,
    ) -> RLResult:
        """Run the loop from the version `learner` resumed at to `steps` (or the first step
        `stop` accepts), then close the job, which saves the final checkpoint: the result."""
        config = self.config
        start, position = learner.resumed()
        if start:
            logger.info("raymesh.rl: resuming from %s (version %d)", config.checkpoint, start)
        loop = self._loop(learner.job, position)
        sinks = [progress] if progress is not None else []
        every = config.checkpoint_every  # (0 without a checkpoint folder: SaveConfig)
        history = loop.run(learner, self.workers, start, config.steps, sinks, stop, every)
        version, weights = loop.weights()
        ended = learner.job.close(extra={"rl": loop.position()})  # the final checkpoint
        return RLResult(
            history,
            version,
            weights,
            loop.remade,
            loop.replaced,
            checkpoint=ended.checkpoint,
            learner_failures=ended.failures,
            resumed_from=start,
        )

    def _loop(self, job: DrivenJob, position: Any) -> Loop:
        """The loop over the roles, from the saved `position` (ValueError naming the
        checkpoint for one no run of these settings wrote), once the roles are told to the
        run folder."""
        roles, config = self.roles, self.config
        loop = Loop(
            roles.request, roles.per_step, config.max_staleness, config.timeout_s, self.spawn
        )
        loop.check = roles.check
        loop.tell = functools.partial(job.tell, "replaced", role=roles.title)
        # The run folder's roles beside the learner's ranks (the job's own "mesh" events).
        pids = [w.procs.pids[0] for w in self.workers]
        job.tell("role", role=roles.title, count=len(self.workers), pids=pids)
        if isinstance(config.reward, ActorMesh):
            job.tell("role", role="reward actors", count=len(config.reward))
        job.tell("role", role="learner", count=job.world_size)
        try:
            loop.restore(position)
        except ValueError as e:  # the manifest's position, checked before a step
            raise ValueError(f"{config.checkpoint}: {e}") from None
        return loop

    def fail(self, error: BaseException) -> None:
        """Tell the run folder that `error` ended the run (nothing before the job started).
        A failure to tell is logged: `error` is the one `run` raises."""
        if self.job is None:
            return
        try:
            self.job.stop(error)
        except Exception as told:
            logger.warning("raymesh.rl: ending the learner job failed: %s", told)

    def stop(self) -> None:
        """Stop every proc the run started, however it ended."""
        stop_workers(self.workers)
        if self.job is not None:
            self.job.stop()  # nothing once closed
