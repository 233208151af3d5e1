"""What a valid answer to each step of a round looks like, checked before anything uses it.

An answer comes from a proc (which runs the clients' own code) or from an edge device (which
runs anything at all), so every field is checked for type, shape and range: the round named, the
clients answered for (only those the message was for), each key advert
(raymesh.federated.protocol.secagg.advert_problem), each share's recipients (exactly the
neighbours the client was given) and length, each example count (an int in 1..max_examples),
each figure (a finite number under a short name), each update (float32 of the model's size,
finite) or masked vector (uint64 of the model's size + 1), each revealed share's form. A failed
check raises `BadUpdate(reason)`, and the round drops that answer's clients with the reason;
nothing here raises anything else.
`sum_problem` checks what secure aggregation decodes from the answers, before it is applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from raymesh.federated.protocol.messages import (
    Advertise,
    Adverts,
    Fit,
    Fitted,
    Message,
    Shares,
    ShareSeeds,
    Unmask,
    Unmasked,
)
from raymesh.federated.protocol.secagg import PART_BYTES, SHARE_BYTES, advert_problem

__all__ = ["MAX_FIGURES", "BadUpdate", "Checks", "sum_problem"]

MAX_FIGURES = 32  # figures per client (a loss, an accuracy, ...); names up to 64 characters
_EXPECTED = {Advertise: Adverts, ShareSeeds: Shares, Fit: Fitted, Unmask: Unmasked}


class BadUpdate(ValueError):
    """An answer that was refused; its message is the reason."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _mapping(value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise BadUpdate(f"{what} must be a map, not {type(value).__name__}")
    return value


def _described(a: Any) -> str:
    return f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__


class Checks:
    """`checks(msg, clients, reply)` raises BadUpdate unless `reply` is a valid answer to
    `msg` sent for `clients`. `size`: the model's float count; `max_examples`: the largest
    example count a client may report (its weight in the mean)."""

    def __init__(self, size: int, max_examples: int) -> None:
        self.size, self.max_examples = size, max_examples

    def __call__(self, msg: Message, clients: Sequence[int], reply: Any) -> None:
        try:
            self._check(msg, set(clients), reply)
        except BadUpdate:
            raise
        except Exception as e:  # a check tripped on a value of a form it did not foresee
            raise BadUpdate(f"malformed answer ({type(e).__name__}: {str(e)[:200]})") from None

    def _check(self, msg: Message, mine: set[int], reply: Any) -> None:
        expected = _EXPECTED[type(msg)]
        if type(reply) is not expected:
            raise BadUpdate(f"answered {type(msg).__name__} with {type(reply).__name__}")
        assert isinstance(msg, Advertise | ShareSeeds | Fit | Unmask)
        assert isinstance(reply, Adverts | Shares | Fitted | Unmasked)
        if reply.round != msg.round:
            raise BadUpdate(f"an answer for round {str(reply.round)[:20]}, not {msg.round}")
        if isinstance(reply, Adverts):
            self._adverts(mine, reply)
        elif isinstance(reply, Shares):
            assert isinstance(msg, ShareSeeds)
            self._shares(msg, mine, reply)
        elif isinstance(reply, Fitted):
            assert isinstance(msg, Fit)
            self._fitted(msg, mine, reply)
        else:
            self._unmasked(mine, reply)

    @staticmethod
    def _clients(keys: Any, mine: set[int], what: str) -> None:
        for c in keys:
            if not _is_int(c) or c not in mine:
                raise BadUpdate(f"{what} for client {str(c)[:20]}, which it does not answer for")

    def _failed(self, failed: Any, mine: set[int]) -> None:
        self._clients(_mapping(failed, "failed"), mine, "a failure")
        if not all(isinstance(v, str) for v in failed.values()):
            raise BadUpdate("a failure's reason is not a string")

    def _adverts(self, mine: set[int], reply: Adverts) -> None:
        if not isinstance(reply.adverts, tuple | list):
            raise BadUpdate("adverts must be a list")
        seen: set[int] = set()
        for a in reply.adverts:
            problem = advert_problem(a)
            if problem is not None:
                raise BadUpdate(f"a key advert is not valid: {problem}")
            self._clients([a.client], mine, "a key advert")
            if a.client in seen:
                raise BadUpdate(f"two key adverts for client {a.client}")
            seen.add(a.client)

    def _shares(self, msg: ShareSeeds, mine: set[int], reply: Shares) -> None:
        outgoing = _mapping(reply.outgoing, "outgoing")
        self._clients(outgoing, mine, "shares")
        self._failed(reply.failed, mine)
        for c, boxes in outgoing.items():
            if c in reply.failed:
                raise BadUpdate(f"client {c} both shared and failed")
            peers = set(msg.peers.get(c, {}))
            got = set(_mapping(boxes, f"client {c}'s shares"))
            if got != peers:  # only along the graph, and to every neighbour or none
                raise BadUpdate(
                    f"client {c} sent shares to {sorted(map(str, got))[:8]}, not to its "
                    f"neighbours {sorted(peers)[:8]}"
                )
            for v, blob in boxes.items():
                if not isinstance(blob, bytes) or len(blob) != SHARE_BYTES:
                    raise BadUpdate(f"client {c}'s share for {v} is not {SHARE_BYTES} bytes")

    def _fitted(self, msg: Fit, mine: set[int], reply: Fitted) -> None:
        examples = _mapping(reply.examples, "examples")
        self._clients(examples, mine, "an update")
        self._failed(reply.failed, mine)
        for c, n in examples.items():
            if not _is_int(n) or not 1 <= n <= self.max_examples:
                raise BadUpdate(
                    f"client {c}: num_examples={str(n)[:30]} is not an int in "
                    f"1..{self.max_examples} (the run's max_examples)"
                )
            if c in reply.failed:
                raise BadUpdate(f"client {c} both answered and failed")
        figures = _mapping(reply.figures, "figures")
        if not set(figures) <= set(examples):
            raise BadUpdate("figures for a client that sent no update")
        for c, figs in figures.items():
            figs = _mapping(figs, f"client {c}'s figures")
            if len(figs) > MAX_FIGURES:
                raise BadUpdate(f"client {c}: {len(figs)} figures, at most {MAX_FIGURES}")
            for k, v in figs.items():
                if not isinstance(k, str) or len(k) > 64:
                    raise BadUpdate(f"client {c}: a figure's name is not a string of <= 64")
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                    raise BadUpdate(
                        f"client {c}: figure {k!r} is {str(v)[:30]}, not a finite number"
                    )
        if msg.secure:
            m = reply.masked
            if examples and (
                not isinstance(m, np.ndarray) or m.dtype != np.uint64 or m.shape != (self.size + 1,)
            ):
                raise BadUpdate(f"masked update is {_described(m)}, not uint64[{self.size + 1}]")
            return
        deltas = _mapping(reply.deltas, "deltas")
        if set(deltas) != set(examples):
            raise BadUpdate("the updates do not match the example counts")
        for c, d in deltas.items():
            if not isinstance(d, np.ndarray) or d.dtype != np.float32 or d.shape != (self.size,):
                raise BadUpdate(f"client {c}: update is {_described(d)}, not float32[{self.size}]")
            if not np.all(np.isfinite(d)):
                raise BadUpdate(f"client {c}: the update holds NaN or Inf values")

    def _unmasked(self, mine: set[int], reply: Unmasked) -> None:
        answers = _mapping(reply.answers, "answers")
        self._clients(answers, mine, "revealed shares")
        for c, revealed in answers.items():
            for owner, entry in _mapping(revealed, f"client {c}'s shares").items():
                if (
                    not _is_int(owner)
                    or not isinstance(entry, tuple)
                    or len(entry) != 3
                    or entry[0] not in ("s", "b")
                    or not _is_int(entry[1])
                    or not isinstance(entry[2], bytes)
                    or len(entry[2]) != PART_BYTES
                ):
                    raise BadUpdate(
                        f"client {c}: a revealed share is not (which, index, {PART_BYTES} bytes)"
                    )


def sum_problem(total: np.ndarray, counts: Sequence[int], clip: float | None) -> str:
    """Why a decoded secure sum (the weighted updates, then the weights) must not be applied,
    or "". `counts`: the example counts the clients in it reported; `clip`: DP's clip norm
    (each update then weighs 1), None without DP. Each check catches a client that masked
    another vector than it reported, or shares that rebuilt a wrong seed."""
    if not np.all(np.isfinite(total)):
        return "the decoded sum is not finite: the round is not applied"
    reported = float(len(counts)) if clip is not None else float(sum(counts))
    if total[-1] != reported:
        what = "clients" if clip is not None else "examples reported"
        return (
            f"the decoded weight {total[-1]:g} is not the {reported:g} {what}: a client "
            "masked another vector than it reported; the round is not applied"
        )
    if clip is not None:
        # n clipped updates sum to at most n * clip, give or take fixed point's rounding.
        bound = len(counts) * (clip + np.sqrt(total.size) * 2.0**-24)
        norm = float(np.linalg.norm(total[:-1]))
        if norm > bound:
            return (
                f"the decoded sum's norm {norm:.4g} exceeds {len(counts)} clipped updates' "
                f"{bound:.4g}: a client did not clip; the round is not applied"
            )
    return ""
