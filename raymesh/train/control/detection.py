"""Failure detection: which ranks a failed chunk lost, told from the ranks' answers alone.

`settle` waits for one answer per rank (a value, the error it raised, or a TimeoutError for a
rank that did not answer), giving the others only `HEAL_GRACE_S` once one has failed.
`find_lost` is pure: from those outcomes and each rank's `RankStatus` it names the ranks to
replace and the step that was in flight, so every rule is unit-tested with hand-made values:

- a rank whose proc died, or whose step raised, is lost ("died", "error");
- when a rank is lost, the ranks that neither failed nor finished (the failed chunk, or one
  queued behind it) are stuck in a collective with it ("stuck": replaced too, not counted as
  failures);
- when nobody died or raised, the ranks that timed out are stuck, and the ones behind the others
  (not yet in the phase where the others wait) are the hung ones ("hung").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from raymesh.actor import ActorError, SupervisionError
from raymesh.train.protocol import ChunkResult, LostRank, RankStatus

__all__ = ["HEAL_GRACE_S", "describe", "failed", "find_lost", "settle", "settle_behind"]

# After one rank of a chunk has failed, how long the others may take to report before they count
# as stuck (survivors normally fail within milliseconds, when their peer's sockets close).
HEAL_GRACE_S = 5.0

_ERRORS = (ActorError, SupervisionError, TimeoutError)


def failed(outcome: Any) -> bool:
    """Whether a rank's outcome is a failure: an error, or a chunk that stopped early."""
    return isinstance(outcome, BaseException) or (
        isinstance(outcome, ChunkResult) and not outcome.ok
    )


def settle(futures: Sequence[Any], timeout: float, grace: float = HEAL_GRACE_S) -> list[Any]:
    """Each future's value, or the exception it raised, or TimeoutError for those not done by
    `timeout`. Once one has failed, the others get only `grace` more: a survivor's collective
    fails as soon as its peer is gone, and one that does not is stuck, to be replaced rather
    than waited for."""
    deadline = time.monotonic() + timeout
    while True:
        pending = [f for f in futures if not f.done()]
        if not pending:
            break
        if any(failed(_peek(f)) for f in futures if f not in pending):
            deadline = min(deadline, time.monotonic() + grace)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:  # block on one of them, briefly, so failures elsewhere are noticed
            pending[0].get(timeout=min(0.1, remaining))
        except _ERRORS:
            pass
    return [_peek(f) if f.done() else TimeoutError("no reply") for f in futures]


def settle_behind(futures: Sequence[Any], failed_chunk: Sequence[Any], timeout: float) -> list[Any]:
    """Each rank's outcome of a chunk queued behind `failed_chunk` (its `settle`d outcomes):
    waited for (as `settle` does) on the ranks that answered the failed chunk, TimeoutError at
    once on the others, which never reached this one."""
    answered = [not isinstance(r, TimeoutError) for r in failed_chunk]
    got = iter(settle([f for f, a in zip(futures, answered) if a], timeout))
    return [next(got) if a else TimeoutError("no reply") for a in answered]


def _peek(future: Any) -> Any:
    try:
        return future.get(timeout=0)
    except _ERRORS as e:
        return e


def find_lost(
    results: Sequence[Any],
    statuses: Sequence[Any],
    start: int,
    later: Sequence[Sequence[Any]] = (),
) -> tuple[list[LostRank], int]:
    """The ranks to replace, and the step that was in flight, from a failed chunk that began
    at 0-based step `start`: `results[i]` is rank i's outcome (`settle`), `statuses[i]` its
    `RankStatus` or the error asking for it raised, `later` the outcomes of the chunks queued
    behind it."""
    done = [r.done for rs in (results, *later) for r in rs if isinstance(r, ChunkResult)]
    # The step in flight: one past what the ranks that reported had completed (in any chunk:
    # a lost rank's reply to an earlier chunk can be lost with it, while the others went on);
    # if none reported (all stuck), the step the stuck ranks are in.
    status = [s for s in statuses if isinstance(s, RankStatus)]
    started = max(done) + 1 if done else min([s.step for s in status] or [start + 1])
    lost: list[LostRank] = []
    for i, r in enumerate(results):
        if isinstance(r, SupervisionError):
            lost.append(LostRank(i, "died", r.failure.cause))
        elif isinstance(r, ActorError):
            lost.append(LostRank(i, "error", f"{r.remote_type}: {r.remote_message}"))
        elif isinstance(r, ChunkResult) and r.cause == "own":
            lost.append(LostRank(i, "error", r.error or ""))
    # A rank can report a peer's failure and then die itself (its node going down after it):
    # its monitor, which answers even for a hung trainer, tells.
    for i, st in enumerate(statuses):
        if isinstance(st, SupervisionError) and all(i != x.rank for x in lost):
            lost.append(LostRank(i, "died", st.failure.cause))
    if lost:  # ranks that neither failed nor finished after a peer failed are stuck too:
        # in the failed chunk or in one queued behind it (a rank's reply to the chunk before
        # the one it died in can be lost with it; a survivor blocked in the next one takes no
        # further call, its setup for the new world would queue behind the blocked chunk)
        gone = {x.rank for x in lost}
        for i in range(len(results)):
            if i not in gone and any(isinstance(rs[i], TimeoutError) for rs in (results, *later)):
                lost.append(LostRank(i, "stuck", "stuck in a collective after a peer failed"))
        return lost, started
    # Nobody died or raised: the ranks that timed out are stuck. Those behind the others (not
    # yet in backward, where the waiting ranks sit) are the hung ones.
    where = [(s.step, s.phase_index) if isinstance(s, RankStatus) else (-1, -1) for s in statuses]
    stuck = [w for i, w in enumerate(where) if isinstance(results[i], TimeoutError)]
    slowest = min(stuck, default=None)  # None: every rank failed on a peer, none lost
    for i, w in enumerate(where):
        if isinstance(results[i], TimeoutError) and w == slowest:
            lost.append(LostRank(i, "hung", f"no progress past step {w[0]} for the step timeout"))
    return lost, started


def describe(results: Sequence[Any]) -> str:
    """One line: each rank that failed of itself and how (the root cause), then the ranks that
    only saw a peer go (their collective's error text says nothing more)."""
    own, peers = [], []
    for i, r in enumerate(results):
        if isinstance(r, SupervisionError):
            own.append(f"rank {i} died: {r.failure.cause}")
        elif isinstance(r, ActorError):
            own.append(f"rank {i} raised {r.remote_type}: {_first_line(r.remote_message)}")
        elif isinstance(r, TimeoutError):
            own.append(f"rank {i} did not answer in time")
        elif isinstance(r, BaseException):
            own.append(f"rank {i}: {type(r).__name__}: {_first_line(str(r))}")
        elif isinstance(r, ChunkResult) and r.error is not None:
            if r.cause == "peer":
                peers.append(str(i))
            else:
                own.append(f"rank {i}: {_first_line(r.error)}")
    if peers:
        many = len(peers) > 1
        own.append(f"rank{'s' * many} {', '.join(peers)} saw {'their' if many else 'its'} peer go")
    return "; ".join(own)


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
