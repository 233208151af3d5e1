"""What the edge server accepts as a request body, and the parse that runs off its event loop.

An honest answer's size follows from the run's model: the largest, a secure round's masked
update, is `size + 1` uint64 numbers in base64 (32/3 characters each); a plain update is
`size` float32 numbers (16/3 each); everything else an answer holds (its key adverts, a share
or a revealed seed for each neighbour, at most 32 figures, a failure's reason) is small and
bounded. `Limits.for_model` turns that into the body's byte limit and its JSON item budget
(arrays travel as one base64 string each, so an honest answer holds a few thousand JSON values
whatever the model's size; a body of millions of numbers is no answer). `load` checks a body
against its limits as it parses it; the edge server runs it in a worker thread. Nothing in it
holds memory per JSON value beyond what `json.loads` builds, and that is bounded by the item
budget, counted before `json.loads` runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raymesh._common import HTTPError
from raymesh.federated.protocol.messages import MAX_DEPTH

__all__ = ["Limits", "load"]

BYTES_PER_NUMBER = 11  # base64 of one uint64, the widest number an answer holds: 32/3 characters
ALLOWANCE_BYTES = 64 << 10  # an answer's JSON around its arrays: adverts, figures, a reason
BYTES_PER_PEER = 256  # a share (88 base64 characters) or a revealed seed, with its JSON
ITEMS = 4096  # JSON values in an answer beyond its neighbours' (figures: at most 32 of 2)
ITEMS_PER_PEER = 16  # a share is 4 values, a revealed seed 7


@dataclass(frozen=True)
class Limits:
    """A body's limits: `max_bytes` (413 beyond, counted while it streams in), `max_items`
    JSON values (413 beyond, counted before parsing), `max_depth` levels of nesting (400)."""

    max_bytes: int
    max_items: int
    max_depth: int = MAX_DEPTH

    @classmethod
    def for_model(cls, size: int, *, peers: int = 0, max_bytes: int | None = None) -> Limits:
        """What an honest answer can be for a model of `size` floats, from a client with at
        most `peers` secure-aggregation neighbours; `max_bytes` (EdgeConfig.max_body_bytes)
        overrides the byte limit."""
        if max_bytes is None:
            max_bytes = BYTES_PER_NUMBER * (size + 1) + BYTES_PER_PEER * peers + ALLOWANCE_BYTES
        return cls(max_bytes=max_bytes, max_items=ITEMS + ITEMS_PER_PEER * peers)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether `value` (parsed JSON) nests deeper than `max_depth`. Iterative, with one
    iterator per open level: O(depth) memory however wide the value (a list of a tuple per
    value would cost more than the value itself)."""
    stack = [iter((value,))]
    while stack:
        for v in stack[-1]:
            if len(stack) - 1 > max_depth:
                return True
            if isinstance(v, dict):
                stack.append(iter(v.values()))
                break
            if isinstance(v, list):
                stack.append(iter(v))
                break
        else:
            stack.pop()
    return False


def load(raw: bytes, limits: Limits) -> Any:
    """`raw` as JSON within `limits`: 413 with more values than `max_items`, 400 unless it is
    JSON without NaN/Infinity nesting at most `max_depth` deep."""
    # Each value after the first follows a ',' or an opening bracket, so this bounds the
    # values (from above: a string may hold these characters too) at C speed, before
    # json.loads builds an object for each of them.
    bound = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if bound > limits.max_items:
        raise HTTPError(
            413,
            None,
            f"the body holds up to {bound} JSON values; an answer for this run's model holds "
            f"at most {limits.max_items}",
        )
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise HTTPError(400, None, f"the body is not valid JSON: {str(e)[:200]}") from None
    if _deeper_than(body, limits.max_depth):
        raise HTTPError(400, None, f"the body nests deeper than {limits.max_depth} levels")
    return body
