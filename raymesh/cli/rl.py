"""`raymesh rl JOB.toml [--steps N] [--resume]`: GRPO post-training, or PPO on an environment,
from an RL job file (raymesh.rl.jobfile), with a line per step: GRPO's mean reward,
staleness, loss, clip fraction, samples used and dropped; PPO's mean episode return,
staleness, losses, clip fraction and environment steps. A run whose reward scores nothing in
a step ends with one line and exit status 1."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from raymesh.cli import errors

__all__ = ["add_parser", "progress_line", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("rl", help="RL from a TOML file: GRPO post-training, or PPO")
    p.add_argument("job", help="TOML RL job file (policy, init, reward, prompts, [grpo]; or [ppo])")
    p.add_argument("--steps", type=int, help="override steps")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the job's newest valid checkpoint (e.g. after the controller died)",
    )


def run(args: argparse.Namespace) -> int:
    return errors.run("rl", lambda: _run(args))


def progress_line(stats: dict[str, float], steps: int) -> str:
    """`raymesh rl`'s line for a step: reward, staleness, loss, clip fraction, samples used and
    dropped (their reward failed), time; a step where most completions were dropped says so,
    as its samples are then few and its reward mean says little. PPO's (no samples): the
    mean episode return, losses and environment steps."""
    if "env_steps" in stats:
        return (
            f"step {int(stats['version'])}/{steps} return {stats['episode_return_mean']:.1f} "
            f"staleness {stats['staleness_mean']:.2f} policy_loss {stats['policy_loss']:.4f} "
            f"value_loss {stats['value_loss']:.4f} clip {stats['clip_fraction']:.3f} "
            f"env_steps {int(stats['env_steps'])} took {stats['step_s']:.2f}s"
        )
    samples, dropped = int(stats["samples"]), int(stats.get("dropped", 0))
    line = (
        f"step {int(stats['version'])}/{steps} reward {stats['reward_mean']:.4f} "
        f"staleness {stats['staleness_mean']:.2f} loss {stats['loss']:.4f} "
        f"clip {stats['clip_fraction']:.3f} samples {samples} dropped {dropped} "
        f"took {stats['step_s']:.2f}s (sync {stats['sync_s'] * 1000:.0f} ms)"
    )
    if dropped > samples:
        line += (
            f" MOST DROPPED: {dropped} of {samples + dropped} completions had no reward "
            "(the reasons are in the log)"
        )
    return line


def _run(args: argparse.Namespace) -> int:
    from raymesh import rl

    job = rl.load_rl_job(args.job, steps=args.steps, resume=args.resume or None)

    def line(stats: dict[str, float]) -> None:
        sys.stderr.write(progress_line(stats, job.steps) + "\n")
        sys.stderr.flush()

    try:
        result = rl.run(job, progress=line)
    except rl.RewardError as e:  # the run's own failure: one line, not a traceback
        return errors.say("rl", e, errors.FAILED)
    if result.resumed_from:
        print(f"resumed from version {result.resumed_from}")
    if result.replaced:
        print(f"replaced {result.replaced} worker(s); remade keys {result.remade}")
    if result.checkpoint is not None:
        print(f"saved {result.checkpoint}")
    return 0
