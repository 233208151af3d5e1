"""Completions and their rewards, on one process: what a generator does between weight loads.

Reproducible: completion `index` of the rollout `key`, made by policy `version` of a run seeded
`seed`, draws its tokens from a torch.Generator seeded by `sample_seed(seed, version, key,
index)`. So it is the same bytes whichever generator makes it, and a generator that replaces
a dead one remakes exactly what the dead one would have made.

Rewards are the user's, a function or a mesh of reward actors (a reward model): a reward that
raises, hangs past its timeout, or returns a non-number, NaN, or a number no float holds (an int
past float's range, such a Fraction) drops only that completion, with its reason
(`Completions.dropped`), never averaged in. A step in which no completion could be scored
ends the run (`raymesh.rl.RewardError`, raised by the loop).
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from raymesh.actor import ActorMesh, Future

__all__ = [
    "Completions",
    "Reward",
    "RewardError",
    "check_scored",
    "reward_name",
    "sample_group",
    "sample_seed",
    "score",
]

Reward = Callable[[bytes, bytes], float]  # (prompt, completion) -> reward


def sample_seed(seed: int, version: int, key: int, index: int) -> int:
    """The seed of completion `index` of rollout `key` made by policy `version`: stable across
    processes and Python versions (a hash of the four numbers, not Python's hash)."""
    text = f"raymesh.rl:{seed}:{version}:{key}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


@dataclass
class Completions:
    """One prompt's group of completions: `tokens` [G, T] (the completion only, no prompt),
    their log-probabilities under the policy that made them `logp` [G, T] (at the sampling
    temperature), `rewards` [G] (NaN where dropped), {index: reason} for the dropped, the
    prompt's token ids (None: its bytes) and each completion's length [G] up to and with its
    end-of-text token (None: all T tokens count)."""

    prompt: bytes
    tokens: torch.Tensor
    logp: torch.Tensor
    rewards: torch.Tensor
    dropped: dict[int, str] = field(default_factory=dict)
    prompt_ids: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits: torch.Tensor = getattr(out, "logits", out)  # a transformers output, or the tensor
    return logits[:, -1, :].float()


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    seeds: list[int],
    *,
    max_tokens: int,
    temperature: float,
    context: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logp), each [len(seeds), max_tokens]: one completion of `prompt` (a 1-D
    LongTensor) per seed, sampled from softmax(logits / temperature), row i drawing with a
    generator seeded seeds[i]. The rows are decoded together (one forward per token for the
    whole group); `context`: the most tokens the model sees (its block size).

    The draw is the Gumbel-max trick: token t of row i is argmax(logp + g), with g Gumbel
    noise that row i's generator draws up front for all its tokens. That is a sample from the
    softmax, as `torch.multinomial` would draw, and it takes one vectorised step per token for
    the whole group instead of one draw per row."""
    device = next(model.parameters()).device
    ids = prompt.to(device).long().unsqueeze(0).repeat(len(seeds), 1)
    tokens = torch.empty(len(seeds), max_tokens, dtype=torch.long)
    logp = torch.empty(len(seeds), max_tokens)
    gumbel: torch.Tensor | None = None
    for t in range(max_tokens):
        window = ids if context is None else ids[:, -context:]
        logprobs = F.log_softmax(_logits(model, window) / temperature, dim=-1).cpu()
        if gumbel is None:  # [G, T, vocab], once the vocabulary is known
            gumbel = torch.stack([_gumbel(s, (max_tokens, logprobs.shape[-1])) for s in seeds])
        step = (logprobs + gumbel[:, t]).argmax(dim=-1)
        tokens[:, t] = step
        logp[:, t] = logprobs.gather(1, step[:, None])[:, 0]
        ids = torch.cat([ids, step[:, None].to(device)], dim=1)
    return tokens, logp


def _gumbel(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    """Standard Gumbel noise of `shape` from a generator seeded `seed`: -log(-log(u))."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))


def score(
    reward: Reward | ActorMesh[Any],
    prompt: bytes,
    completions: list[bytes],
    *,
    timeout_s: float = 60.0,
) -> tuple[torch.Tensor, dict]:
    """(rewards [G], {index: reason}) of each completion under `reward`: a function
    (prompt, completion) -> float, or a mesh of reward actors with an endpoint
    `score(prompt, completion) -> float`, each completion sent to one of them (`choose`: the
    least busy), all at once, then gathered within `timeout_s`. A completion whose reward
    raises (or whose actor raises, dies or does not answer in time), or is not a finite real
    number, is NaN with its reason: it alone is dropped."""
    if isinstance(reward, ActorMesh):
        futures = [reward.score.choose(prompt, c) for c in completions]
        deadline = time.monotonic() + timeout_s
        answers = [functools.partial(_answer, f, deadline, timeout_s) for f in futures]
    else:
        answers = [functools.partial(reward, prompt, c) for c in completions]
    values, dropped = [], {}
    for i, answer in enumerate(answers):
        try:
            values.append(_number(answer()))
        except Exception as e:  # the user's reward: its failure drops this sample only
            values.append(math.nan)
            dropped[i] = str(e) if isinstance(e, (_NoAnswer, _NotANumber)) else _raised(e)
    return torch.tensor(values, dtype=torch.float64), dropped


class _NoAnswer(Exception):
    """A reward actor that did not answer in time."""


class _NotANumber(Exception):
    """A reward's answer that is not a finite real number (the message says what it was)."""


def _number(value: Any) -> float:
    """`value` as a finite float, or _NotANumber saying why not. Converting is the user's
    code too (a Real's __float__, an int past float's range, a Fraction of such ints), so it
    runs here, inside the caller's try: a conversion that raises drops one completion, not the
    generator's whole call. A one-number tensor (a reward model's 0-d output) is its number;
    a NumPy scalar is a Real already."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _NotANumber(
            f"the reward returned {type(value).__name__} {_short(value)}, not a number"
        )
    try:
        number = float(value)
    except Exception as e:  # OverflowError for 10**400, or whatever a Real's __float__ raises
        raise _NotANumber(
            f"the reward returned {type(value).__name__} {_short(value)}, which is no float "
            f"({type(e).__name__}: {e})"
        ) from None
    if not math.isfinite(number):
        raise _NotANumber(f"the reward returned {_short(value)}, not a finite number")
    return number


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a reason is logged per completion."""
    try:
        text = repr(value)
    except Exception as e:  # a user's __repr__ may raise too
        text = f"<unprintable: {type(e).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _answer(future: Future[Any], deadline: float, timeout_s: float) -> Any:
    try:
        return future.get(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _NoAnswer(f"the reward actor did not answer within {timeout_s:g}s") from None


class RewardError(RuntimeError):
    """No completion of a step could be scored: every one's reward raised, returned no finite
    number, or (a reward actor) died or did not answer in time. The run ends rather than
    train on nothing. `reward` names the reward, `step` the step (from 1), `reason` the first
    completion's reason."""

    def __init__(self, reward: str, step: int, dropped: int, reason: str) -> None:
        super().__init__(
            f"rl.run: no completion of step {step} could be scored by the reward {reward} "
            f"(all {dropped} dropped); the first: {reason}. A reward is called as "
            "reward(prompt: bytes, completion: bytes) and must return a finite real number"
        )
        self.reward, self.step, self.reason = reward, step, reason


def reward_name(reward: Any) -> str:
    """How an error names `reward`: its "module:function" name, or the mesh's repr."""
    if isinstance(reward, str):
        return reward
    if isinstance(reward, ActorMesh):
        return repr(reward)
    inner = getattr(reward, "func", reward)  # a functools.partial names its function
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"{getattr(inner, '__module__', '?')}:{name}"


def check_scored(rollouts: list[Any], step: int, reward: str) -> None:
    """RewardError when not one completion of the step's `rollouts` (of `Completions`) has a
    reward; `step` counts from 0 here, from 1 in the error."""
    first: tuple[int, int, str] | None = None
    dropped = 0
    for r in rollouts:
        data: Completions = r.data
        if bool((~torch.isnan(data.rewards)).any()):
            return
        dropped += len(data.rewards)
        for index, reason in data.dropped.items():
            if first is None or (r.key, index) < first[:2]:
                first = (r.key, index, reason)
    if first is None:  # NaN rewards with no reason: not what score() makes
        first = (rollouts[0].key if rollouts else -1, 0, "the reward is NaN")
    key, index, reason = first
    raise RewardError(reward, step + 1, dropped, f"key {key} completion {index}: {reason}")


def _raised(e: Exception) -> str:
    return f"the reward raised {type(e).__name__}: {e}"
