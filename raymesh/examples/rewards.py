"""Rewards for `raymesh rl` (examples/grpo.toml): functions of the text alone."""

from __future__ import annotations

import warnings

__all__ = ["python_lines"]


def python_lines(prompt: bytes, completion: bytes) -> float:
    """The share of the completion's lines that compile as Python on their own and hold a
    word outside a comment (a bare number, a bracket or a comment compiles too, and a policy
    learns to write only those: RL optimises the reward it is given, not the one meant);
    the first line continues the prompt, the last, unfinished one is left out; 0 with none."""
    lines = (prompt + completion).decode("utf-8", "replace").split("\n")[:-1]
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        return 0.0
    ok = 0
    with warnings.catch_warnings():  # what compile() warns of a sampled line ("\d", `"a"()`)
        warnings.simplefilter("ignore", SyntaxWarning)  # is not the run's news: keep it quiet
        warnings.simplefilter("ignore", DeprecationWarning)
        for line in lines:
            if line.startswith("#") or not any(c.isalpha() for c in line):
                continue
            try:
                compile(line, "<completion>", "exec")
                ok += 1
            except (SyntaxError, ValueError):
                pass
    return ok / len(lines)
