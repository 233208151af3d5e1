"""Reward functions the generator procs import by name (`tests.rl.rewards:...`)."""

from __future__ import annotations

from raymesh.actor import Actor, concurrent_endpoint


def es(prompt: bytes, completion: bytes) -> float:
    """Easy to learn: the share of the letter e."""
    return completion.count(b"e") / max(1, len(completion))


def ascii_share(prompt: bytes, completion: bytes) -> float:
    """The share of ASCII bytes: about half of a random policy's, so every group has a spread."""
    return sum(b < 128 for b in completion) / max(1, len(completion))


def es_or_die(prompt: bytes, completion: bytes, *, flag: str) -> float:
    """`es`, but the first call anywhere SIGKILLs its own process, mid-rollout (once: `flag`
    is a file that says it happened)."""
    import os
    import signal

    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return es(prompt, completion)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


class RewardModel(Actor):
    """A reward actor (as a reward model would be): `es` as an endpoint. With `faults` (a
    folder), the first call anywhere raises and the second hangs for a minute (once each: a
    file in `faults` says it happened). Concurrent, so a hung call holds up no other."""

    def __init__(self, faults: str | None = None) -> None:
        self.faults = faults

    @concurrent_endpoint
    async def score(self, prompt: bytes, completion: bytes) -> float:
        import asyncio
        import os

        for fault in ("raised", "hung") if self.faults is not None else ():
            try:
                os.close(os.open(os.path.join(self.faults, fault), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            if fault == "raised":
                raise ValueError("this reward model cannot score that")
            await asyncio.sleep(60)
        return es(prompt, completion)


def build(ctx):  # type: ignore[no-untyped-def]
    """A small byte-level policy that learns in a few steps."""
    import torch

    from raymesh.examples.tinygpt import TinyGPT, lm_loss
    from raymesh.train import Task

    model = TinyGPT(block_size=32, n_layer=1, n_head=2, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Task(model=model, optimizer=optimizer, dataset=[0], loss_fn=lm_loss)
