"""`CheckpointError`: what every part of a checkpoint's writing and reading raises."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or is corrupt, partial or not a raymesh checkpoint."""
