"""Reward functions the generator procs import by name (`tests.rl.rewards:...`)."""

from __future__ import annotations


def spaces(prompt: bytes, completion: bytes) -> float:
    """A made-up reward: the share of spaces in the completion."""
    return completion.count(b" ") / max(1, len(completion))


def unruly(prompt: bytes, completion: bytes) -> object:
    """Bad in every way a reward can be, by the completion's first byte."""
    kind = completion[0] % 4
    if kind == 0:
        raise RuntimeError("no score for this one")
    if kind == 1:
        return float("nan")
    if kind == 2:
        return "high"
    return 1.0
