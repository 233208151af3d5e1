"""A worker's copy of the policy: what the generators and the environment runners share.

The learner publishes version v; the loop hands it to every worker as `load(v, state)`, queued
behind the worker's current call, so the worker installs it between two sampling calls and
stamps what it makes afterwards with v.
"""

from __future__ import annotations

import torch

from raymesh.actor import Actor, endpoint
from raymesh.train import ShardedState

__all__ = ["PolicyCopy"]


class PolicyCopy(Actor):
    """Holds `self.model` (set by the subclass) and the `version` installed: -1 until the first
    `load` (the build's own weights)."""

    model: torch.nn.Module
    version: int = -1

    @endpoint
    def load(self, version: int, state: dict[str, torch.Tensor] | ShardedState) -> int:
        """Install policy `version`: its state dict, whole, or only what trains (a LoRA
        policy's adapters; the frozen rest is as built), or a sharded learner's shards, read
        and assembled here. A key the model does not have is a ValueError, and nothing is
        installed. Returns the version."""
        if isinstance(state, ShardedState):  # copied into the model's tensors as it is read
            state.load_into(self.model, timeout=120)
        else:
            unknown = sorted(set(state) - set(self.model.state_dict()))
            if unknown:
                raise ValueError(f"version {version} holds keys this policy lacks: {unknown[:5]}")
            self.model.load_state_dict(state, strict=False)
        self.version = version
        return version
