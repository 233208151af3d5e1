"""The learner's train job (`train.drive`): its config from `rl.run`'s arguments, and the
learner role on it.

A GRPO step is one train step on its completions (`prompts_per_step x group_size` samples); a
PPO version is `epochs` passes of minibatches, one train step each (`TrainedPPOLearner.shape`),
with PPO's gradient clipping as the job's. The loop owns `steps`, `seed`, the global batch,
the policy's `build` and `params`, the checkpoint, `resume` and the run folder; the user's
`trainer` gives the rest (ranks, strategy, precision, GPUs, failure budget), checked before
any proc of the run starts (fp16 on CPU ranks: before the job's own start).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raymesh import train
from raymesh._common import bad
from raymesh.rl.algorithms import GRPO, PPO
from raymesh.rl.config import SaveConfig
from raymesh.rl.learner import GRPOTask, PPOTask, TrainedLearner, TrainedPPOLearner
from raymesh.train import CheckpointConfig, TrainConfig
from raymesh.train.checkpoint import resolve_checkpoint
from raymesh.train.export import job_config

__all__ = ["learner_config", "start_learner"]


def learner_config(
    trainer: TrainConfig | dict[str, Any] | None,
    task: GRPOTask | PPOTask,
    algorithm: GRPO | PPO,
    *,
    per_step: int,
    steps: int,
    seed: int,
    save: SaveConfig,
) -> TrainConfig:
    """The learner job's config for `steps` policy versions of `per_step` rollouts each
    (ValueError naming the `trainer` field that cannot be used). Its checkpoints and run
    folder are the RL run's (`save`): the run folder `run_dir`, else the checkpoint folder,
    as a train job's."""
    samples, per_version, what = _shape(algorithm, per_step)
    config = _config(
        trainer,
        task,
        steps=steps * per_version,
        samples=samples,
        what=what,
        seed=seed,
        save=save,
    )
    if isinstance(algorithm, PPO):  # PPO clips its gradients: the job does it after backward
        config = dataclasses.replace(config, grad_clip=algorithm.max_grad_norm)
    return config


def start_learner(
    task: GRPOTask | PPOTask,
    algorithm: GRPO | PPO,
    config: TrainConfig,
    *,
    per_step: int,
    warm: train.WarmRanks | None = None,
) -> TrainedLearner | TrainedPPOLearner:
    """Start the learner job (its ranks up, a checkpoint restored), as the role the loop
    calls. Its run folder is the RL run's: its "job" event says "kind": "rl" and the
    algorithm, its rows carry the loop's figures of each version (reward, staleness, ...).
    `warm`: where its ranks come from and go back to (`train.WarmRanks`)."""
    labels = {"kind": "rl", "algorithm": type(algorithm).__name__}
    job = train.drive(task, config, labels=labels, warm=warm)
    if isinstance(algorithm, GRPO):
        return TrainedLearner(job)
    samples = _version_samples(algorithm, per_step)
    return TrainedPPOLearner(job, algorithm, seed=config.seed, samples=samples)


def _shape(algorithm: GRPO | PPO, per_step: int) -> tuple[int, int, str]:
    """(samples a train step takes, train steps a version, what says so)."""
    if isinstance(algorithm, GRPO):
        return per_step * algorithm.group_size, 1, "a GRPO step takes prompts_per_step x group_size"
    size, per_version = TrainedPPOLearner.shape(algorithm, _version_samples(algorithm, per_step))
    what = "a PPO minibatch takes env_runners x rollout_steps x envs_per_runner / minibatches"
    return size, per_version, what


def _version_samples(algorithm: PPO, runners: int) -> int:
    """The environment steps of a PPO version: each runner's segment."""
    return runners * algorithm.rollout_steps * algorithm.envs_per_runner


def _config(
    trainer: TrainConfig | dict[str, Any] | None,
    task: GRPOTask | PPOTask,
    *,
    steps: int,
    samples: int,
    what: str,
    seed: int,
    save: SaveConfig,
) -> TrainConfig:
    """The learner job's config: `trainer`'s, with what the loop owns set (see `run`)."""
    if isinstance(trainer, dict):
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(trainer) - fields)
        if unknown:
            raise bad("trainer", trainer, f"{unknown} are no train.TrainConfig fields")
        # the samples a step takes, so that the config validates for its ranks
        trainer = TrainConfig(**{"global_batch_size": samples, **trainer})
    config = trainer if trainer is not None else TrainConfig()
    if not isinstance(config, TrainConfig):
        raise bad("trainer", trainer, "give a dict of train.TrainConfig fields (workers=...)")
    for name, value, why in (
        ("checkpoint", config.checkpoint, "give rl.run(checkpoint=..., checkpoint_every=...)"),
        ("run_dir", config.run_dir, "give rl.run(run_dir=...)"),
        ("data", config.data, "the loop supplies the learner's samples"),
    ):
        if value is not None:
            raise bad(f"trainer.{name}", value, f"the RL loop sets it: leave it out ({why})")
    if config.global_batch_size not in (1, samples):
        raise bad(
            "trainer.global_batch_size",
            config.global_batch_size,
            f"{what} = {samples} samples: leave it out",
        )
    build, params = None, {}
    # With an init, its job's: serve and export rebuild the model as it was trained.
    if isinstance(task, GRPOTask) and task.init is not None:
        recorded = job_config(resolve_checkpoint(task.init))
        build, params = recorded.build, recorded.params
    elif isinstance(task, GRPOTask):
        params = task.params or {}
    if isinstance(task.policy, str):
        build = task.policy
    return dataclasses.replace(
        config,
        steps=steps,
        seed=seed,
        global_batch_size=samples,
        build=build,
        params=params,
        checkpoint=CheckpointConfig(dir=save.checkpoint, keep=2) if save.checkpoint else None,
        resume="auto" if save.resume else False,
        run_dir=save.run_dir,
    )
