"""Checkpoint discovery: the newest valid checkpoint of a job, and whether to resume from it."""

from __future__ import annotations

import logging

from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import CheckpointConfig, TrainConfig

logger = logging.getLogger("raymesh")

__all__ = ["find_resume", "latest_checkpoint"]


def latest_checkpoint(checkpoint: CheckpointConfig | None) -> str | None:
    """The newest committed, verified checkpoint folder of a job's checkpoint section, if
    checkpoints are on."""
    if checkpoint is None:
        return None
    found = Checkpointer(checkpoint.dir).latest()
    return str(found) if found else None


def find_resume(config: TrainConfig) -> str | None:
    """The checkpoint to start from: the newest valid one of this job, if resuming is on and
    one exists. Raises ValueError when `resume=True` finds none, or when the newest one is of
    another job (another seed or global batch size: its data order differs)."""
    if config.checkpoint is None or config.resume is False:
        return None
    path = Checkpointer(config.checkpoint.dir).latest()
    if path is None:
        if config.resume is True:
            raise ValueError(
                f"resume=True but {config.checkpoint.dir!r} holds no valid checkpoint; use "
                "resume='auto' to start fresh when there is none"
            )
        return None
    manifest = Manifest.from_json((path / "manifest.json").read_text())
    for key in ("seed", "global_batch_size"):
        if manifest.config.get(key) != getattr(config, key):
            raise ValueError(
                f"checkpoint {str(path)!r} is of another job ({key}="
                f"{manifest.config.get(key)!r}, this job has {getattr(config, key)!r}); use "
                "another checkpoint.dir, or resume=False to start fresh"
            )
    if manifest.data_position >= config.steps:
        logger.warning(
            "raymesh.train: %s is already at step %d (steps=%d): nothing to train; raise "
            "steps to train further",
            path,
            manifest.data_position,
            config.steps,
        )
    logger.info("raymesh.train: resuming from %s (step %d)", path, manifest.data_position)
    return str(path)
