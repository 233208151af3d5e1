"""A worker's copy of the policy: what the generators and the environment runners share.

The learner publishes version v; the loop hands it to every worker as `load(v, state)`, queued
behind the worker's current call, so the worker installs it between two sampling calls and
stamps what it makes afterwards with v.
"""

from __future__ import annotations

import torch

from raymesh.actor import Actor, endpoint

__all__ = ["PolicyCopy"]


class PolicyCopy(Actor):
    """Holds `self.model` (set by the subclass) and the `version` installed: -1 until the first
    `load` (the build's own weights)."""

    model: torch.nn.Module
    version: int = -1

    @endpoint
    def load(self, version: int, state: dict[str, torch.Tensor]) -> int:
        """Install policy `version` (its full state dict, strictly); returns it."""
        self.model.load_state_dict(state, strict=True)
        self.version = version
        return version
