"""Policies the env runner procs import by name (`tests.rl.policies:...`)."""

from __future__ import annotations

from typing import Any


def actor_critic_or_die(observations: Any, actions: Any, *, flag: str, after: int) -> Any:
    """raymesh's default ActorCritic, but the `after`-th forward under no_grad (a runner
    sampling; the learner trains with gradients) SIGKILLs its own process, mid-segment, once
    anywhere (`flag` is a file that says it happened)."""
    import os
    import signal

    import torch

    from raymesh.rl.environments import ActorCritic

    model = ActorCritic(int(observations.shape[0]), int(actions.n))
    calls = 0

    def die_once(module: Any, args: Any) -> None:
        nonlocal calls
        if torch.is_grad_enabled():
            return
        calls += 1
        if calls < after:
            return
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(die_once)
    return model
