"""Reward functions the generator procs import by name (`tests.rl.rewards:...`)."""

from __future__ import annotations


def es(prompt: bytes, completion: bytes) -> float:
    """Easy to learn: the share of the letter e."""
    return completion.count(b"e") / max(1, len(completion))


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


def build(ctx):  # type: ignore[no-untyped-def]
    """A small byte-level policy that learns in a few steps."""
    import torch

    from raymesh.examples.tinygpt import TinyGPT, lm_loss
    from raymesh.train import Task

    model = TinyGPT(block_size=32, n_layer=1, n_head=2, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Task(model=model, optimizer=optimizer, dataset=[0], loss_fn=lm_loss)
