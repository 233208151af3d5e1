"""Reward functions the generator procs import by name (`tests.rl.rewards:...`)."""

from __future__ import annotations

from typing import Any

from raymesh.actor import Actor, concurrent_endpoint


def es(prompt: bytes, completion: bytes) -> float:
    """Easy to learn: the share of the letter e."""
    return completion.count(b"e") / max(1, len(completion))


def ascii_share(prompt: bytes, completion: bytes) -> float:
    """The share of ASCII bytes: about half of a random policy's, so every group has a spread."""
    return sum(b < 128 for b in completion) / max(1, len(completion))


_calls = 0  # this process's calls of es_or_die


def es_or_die(prompt: bytes, completion: bytes, *, flag: str, after: int = 1) -> float:
    """`es`, but this process's `after`-th call SIGKILLs it, mid-rollout, once anywhere (`flag`
    is a file that says it happened)."""
    import os
    import signal

    global _calls
    _calls += 1
    if _calls < after:
        return es(prompt, completion)
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return es(prompt, completion)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def counts_a_str(prompt: bytes, completion: bytes) -> float:
    """A new user's mistake: str methods on the bytes a reward is given (TypeError, always)."""
    return completion.count("e")  # type: ignore[arg-type]


def says_high(prompt: bytes, completion: bytes) -> str:
    """Another: a reward that returns a word, not a number."""
    return "high"


FAULTS = ("raised", "hung", "huge", "fraction")  # what a faulty RewardModel does, in order


class RewardModel(Actor):
    """A reward actor (as a reward model would be): `es` as an endpoint. With `faults` (a
    folder), the first calls anywhere go wrong, once each, in the order of FAULTS (a file in
    `faults` says each happened): one raises, one hangs for a minute, one returns 10**400 and
    one a Fraction that no float holds. With `kill_after`, the actor's own `kill_after`-th
    call SIGKILLs its proc, once anywhere (the file "actor-killed"). Concurrent, so a hung call
    holds up no other."""

    def __init__(self, faults: str | None = None, kill_after: int = 0) -> None:
        self.faults = faults
        self.kill_after = kill_after
        self.calls = 0

    def _once(self, name: str) -> bool:
        import os

        assert self.faults is not None
        try:
            os.close(os.open(os.path.join(self.faults, name), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    @concurrent_endpoint
    async def score(self, prompt: bytes, completion: bytes) -> Any:
        import asyncio
        import fractions
        import os
        import signal

        self.calls += 1
        if self.kill_after and self.calls >= self.kill_after and self._once("actor-killed"):
            os.kill(os.getpid(), signal.SIGKILL)
        for fault in FAULTS if self.faults is not None else ():
            if not self._once(fault):
                continue
            if fault == "raised":
                raise ValueError("this reward model cannot score that")
            if fault == "hung":
                await asyncio.sleep(60)
            return 10**400 if fault == "huge" else fractions.Fraction(10**400, 3)
        return es(prompt, completion)


def build(ctx):  # type: ignore[no-untyped-def]
    """A small byte-level policy that learns in a few steps."""
    import torch

    from raymesh.examples.tinygpt import TinyGPT, lm_loss
    from raymesh.train import Task

    model = TinyGPT(block_size=32, n_layer=1, n_head=2, n_embd=32)
    # ctx.params["lr"]: 0 makes a learner that does nothing, for showing a test fails with one
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.params.get("lr", 1e-2))
    return Task(model=model, optimizer=optimizer, dataset=[0], loss_fn=lm_loss)


def slow_lines(prompt: bytes, completion: bytes) -> float:
    """examples/grpo.toml's reward (raymesh.examples.rewards:python_lines), slow for half its
    prompts ("class ", "for i in ", "return ", "with open(": keys 2, 3 mod 4), so that a
    generator busy with those falls behind the other and a step takes keys out of order."""
    import time

    from raymesh.examples.rewards import python_lines

    if prompt in (b"class ", b"for i in ", b"return ", b"with open("):
        time.sleep(0.1)
    return python_lines(prompt, completion)
