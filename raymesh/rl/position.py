"""Where a run is in its samples (`Position`): which rollout keys the learner has taken. Saved
with each checkpoint (the manifest's `extra["rl"]`), read back by a resumed run.

The keys are taken mostly in order, so a position is small: every key below `below`, and the
few above it (`above`) that a step took while a smaller one was still being made. A resumed
run makes the keys not taken below the highest taken one first, then new ones.

A checkpoint's manifest is a file anyone with write access to the folder may have edited, so
`Position.restore` checks what it reads before acting on it: the types, that keys are
distinct, and how far past `below` they reach (at most `span_limit` keys), so a hostile
manifest cannot make the controller allocate without bound. ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from raymesh._common import bad, brief, is_int

__all__ = ["Position"]

_MAX_KEY = 2**63 - 1  # no run gets past int64's keys


class Position:
    """The keys taken: all below `below`, and those in `above` (each > `below`)."""

    def __init__(self) -> None:
        self.below = 0
        self.above: set[int] = set()

    def took(self, keys: Iterable[int]) -> None:
        """The learner took `keys`."""
        self.above.update(keys)
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1

    def to_json(self) -> dict[str, Any]:
        """JSON data, saved with a checkpoint (`restore` reads it back)."""
        return {"taken_below": self.below, "taken": sorted(self.above)}

    def restore(self, data: Any, *, span_limit: int) -> tuple[int, list[int]]:
        """Continue from saved `data` (what `to_json` wrote; {} is a fresh start): returns the
        next new key and the keys to make again first (those not taken below it), in order.
        ValueError naming the field when `data` is not a position `to_json` could have
        written, or when its keys reach more than `span_limit` past `taken_below`; nothing is
        changed then."""
        if not isinstance(data, dict):
            raise bad("extra.rl", brief(data), "a position is a table {taken_below, taken}")
        below = data.get("taken_below", 0)
        if not is_int(below) or not 0 <= below <= _MAX_KEY:
            raise bad("extra.rl.taken_below", brief(below), f"give an integer 0..{_MAX_KEY}")
        taken = data.get("taken", [])
        if not isinstance(taken, list) or len(taken) > span_limit:
            raise bad(
                "extra.rl.taken",
                brief(taken),
                f"give a list of at most {span_limit} keys (the keys taken past taken_below)",
            )
        for key in taken:
            if not is_int(key) or not below < key <= below + span_limit:
                raise bad(
                    "extra.rl.taken",
                    brief(taken),
                    f"holds {brief(key)}: give keys above taken_below={below} and at most "
                    f"{span_limit} past it",
                )
        above = set(taken)
        if len(above) < len(taken):
            raise bad("extra.rl.taken", brief(taken), "give each key once")
        self.below, self.above = below, above
        next_key = max([below, *(k + 1 for k in above)])
        return next_key, [k for k in range(below, next_key) if k not in above]
