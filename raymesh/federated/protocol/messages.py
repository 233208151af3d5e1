"""The messages of one federated round, and the client side that answers them.

The controller sends the same typed messages to a proc hosting many simulated clients (as an
actor call) and to an edge device (as JSON over HTTP, `encode` / `decode`). A `Participant`
answers them for the clients it holds, so a simulated client and an edge client run the same
code. This module needs only NumPy, torch and the crypto libraries (no Ray, no raymesh).

A round is `Advertise` -> `Share` -> `Fit` -> `Unmask` with secure aggregation, and `Fit` alone
without it. Each message and each answer names the round; an answer to another round is refused
(raymesh.federated.protocol.checks says what else a valid answer is).

A `Participant` never lets one client's failure fail the others it answers for: a client whose
code raises, whose count is out of range, or whose secure-aggregation step fails is listed in
the answer's `failed` with the reason, and a share it cannot decrypt is skipped.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .client import Layout, train_locally
from .privacy import clip_update
from .secagg import FixedPoint, KeyAdvert, Revealed, SecAggClient

__all__ = [
    "Advertise",
    "Adverts",
    "Done",
    "Fit",
    "Fitted",
    "Participant",
    "ShareSeeds",
    "Shares",
    "Unmask",
    "Unmasked",
    "decode",
    "encode",
]

FIXED = FixedPoint()


@dataclass(frozen=True)
class Advertise:
    """Step 1 for `clients`: make this round's keys."""

    round: int
    clients: tuple[int, ...]


@dataclass(frozen=True)
class ShareSeeds:
    """Step 2: `peers[c]` are client c's neighbours' adverts; share seeds among them."""

    round: int
    threshold: int
    peers: dict[int, dict[int, KeyAdvert]]


@dataclass(frozen=True)
class Fit:
    """Step 3: train `clients` from `weights` (flat float32 in `layout`'s order) and answer
    with their updates. `secure`: masked and summed, with the shares in `inbox`; `clip`: the
    DP bound on each update's L2 norm (updates then count equally, not by examples);
    `budget_s`: a client not started within this many seconds is dropped as timed out;
    `max_examples`: a client reporting more examples than this is dropped."""

    round: int
    clients: tuple[int, ...]
    weights: np.ndarray
    layout: Layout
    config: dict[str, Any]
    secure: bool
    clip: float | None
    budget_s: float
    inbox: dict[int, dict[int, bytes]] = field(default_factory=dict)
    max_examples: int = 1_000_000


@dataclass(frozen=True)
class Unmask:
    """Step 4: `dropped` clients sent no masked update; reveal the shares that remove masks."""

    round: int
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class Done:
    """The run is over: an edge client may exit."""

    reason: str


@dataclass(frozen=True)
class Adverts:
    round: int
    adverts: tuple[KeyAdvert, ...]


@dataclass(frozen=True)
class Shares:
    """`outgoing[c]`: client c's encrypted shares, recipient -> ciphertext (one for each of
    its neighbours); `failed[c]`: why client c could not share."""

    round: int
    outgoing: dict[int, dict[int, bytes]]
    failed: dict[int, str]


@dataclass(frozen=True)
class Fitted:
    """`examples[c]`: client c's example count; `figures[c]`: what its train_fn reported.
    Secure: `masked` is the sum of the contributing clients' masked vectors (the update
    scaled by its weight, then the weight, in fixed point). Otherwise `deltas[c]` is c's
    update (clipped under DP)."""

    round: int
    examples: dict[int, int]
    figures: dict[int, dict[str, float]]
    failed: dict[int, str]
    masked: np.ndarray | None = None
    deltas: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Unmasked:
    """`answers[c]`: what client c reveals, owner -> (which seed, Shamir index, share)."""

    round: int
    answers: dict[int, dict[int, Revealed]]


Message = Advertise | ShareSeeds | Fit | Unmask | Done


class Participant:
    """Answers the round's messages for the clients `client_for(cid)` builds. Keeps only the
    current round's secure-aggregation state; a message for an older round is an error."""

    def __init__(self, client_for: Callable[[int], Any]) -> None:
        self._client_for = client_for
        self._round = -1
        self._secagg: dict[int, SecAggClient] = {}
        self._contributed: tuple[int, ...] = ()

    def handle(self, msg: Message) -> Any:
        if isinstance(msg, Done):
            return None
        if msg.round < self._round:
            raise ValueError(f"a message for round {msg.round}, after round {self._round}")
        if msg.round > self._round:
            self._round, self._secagg, self._contributed = msg.round, {}, ()
        if isinstance(msg, Advertise):
            self._secagg = {c: SecAggClient(c, msg.round) for c in msg.clients}
            return Adverts(msg.round, tuple(s.advertise() for s in self._secagg.values()))
        if isinstance(msg, ShareSeeds):
            return self._share(msg)
        if isinstance(msg, Fit):
            return self._fit(msg)
        # unmask skips a share it cannot decrypt (SecAggClient.skipped), so one bad peer
        # cannot fail the answer of every client on this proc.
        answers = {c: self._secagg[c].unmask(msg.dropped) for c in self._contributed}
        return Unmasked(msg.round, answers)

    def _share(self, msg: ShareSeeds) -> Shares:
        outgoing, failed = {}, {}
        for c, peers in msg.peers.items():
            try:
                outgoing[c] = self._secagg[c].share(peers, msg.threshold)
            except Exception as e:  # this client cannot share: it drops, the others go on
                failed[c] = _reason(e)
        return Shares(msg.round, outgoing, failed)

    def _fit(self, msg: Fit) -> Fitted:
        started = time.monotonic()
        examples: dict[int, int] = {}
        figures: dict[int, dict[str, float]] = {}
        failed: dict[int, str] = {}
        deltas: dict[int, np.ndarray] = {}
        masked = np.zeros(msg.layout.size + 1, np.uint64) if msg.secure else None
        for c in msg.clients:
            if time.monotonic() - started > msg.budget_s:
                failed[c] = f"timed out: not started within the round's {msg.budget_s:g} s"
                continue
            if msg.secure and c not in self._secagg:
                failed[c] = "it did not advertise keys this round"
                continue
            try:
                config = {**msg.config, "round": msg.round, "client": c}
                delta, n, figs = train_locally(self._client_for(c), msg.layout, msg.weights, config)
                if n > msg.max_examples:
                    raise ValueError(
                        f"num_examples={n} is over the run's max_examples={msg.max_examples}"
                    )
                weight = float(n)
                if msg.clip is not None:
                    delta = clip_update({"u": delta}, msg.clip)["u"].astype(np.float32)
                    weight = 1.0
                if msg.secure:
                    secagg = self._secagg[c]
                    secagg.receive(msg.inbox.get(c, {}))
                    vec = np.append(delta.astype(np.float64) * weight, weight)
                    assert masked is not None
                    masked += secagg.mask(FIXED.encode(vec))
                else:
                    deltas[c] = delta
            except Exception as e:  # this client's code failed: drop it, keep the others
                failed[c] = _reason(e)
                continue
            examples[c], figures[c] = n, figs
        self._contributed = tuple(examples) if msg.secure else ()
        return Fitted(msg.round, examples, figures, failed, masked, deltas)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


# --- JSON for the edge client --------------------------------------------------------------

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Advertise,
        ShareSeeds,
        Fit,
        Unmask,
        Done,
        Adverts,
        Shares,
        Fitted,
        Unmasked,
        KeyAdvert,
        Layout,
    )
}
_DTYPES = {"float32", "float64", "uint64", "int64"}


def encode(obj: Any) -> Any:
    """A message as JSON-ready data: dataclasses by name, bytes and arrays in base64, maps as
    pairs (their keys are ints)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            "$": type(obj).__name__,
            **{f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)},
        }
    if isinstance(obj, bytes):
        return {"$b": base64.b64encode(obj).decode()}
    if isinstance(obj, np.ndarray):
        return {
            "$a": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
            "dtype": str(obj.dtype),
            "shape": list(obj.shape),
        }
    if isinstance(obj, Mapping):
        return {"$d": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [encode(v) for v in obj]
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    return obj


MAX_DEPTH = 32  # a message nests about 10 deep; more is refused before it costs anything


def decode(data: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """The inverse of `encode`. Builds only this module's message types and arrays of plain
    numeric dtypes. Anything else, nesting deeper than `max_depth`, and a value of the wrong
    form all raise ValueError (never another exception): what it returns still needs its
    fields checked (raymesh.federated.protocol.checks)."""
    try:
        return _decode(data, max_depth)
    except ValueError:
        raise
    except (TypeError, KeyError, AttributeError, RecursionError, OverflowError) as e:
        raise ValueError(f"malformed message: {type(e).__name__}: {str(e)[:200]}") from None


def _decode(data: Any, depth: int) -> Any:
    if depth < 0:
        raise ValueError(f"the message nests deeper than {MAX_DEPTH} levels")
    if isinstance(data, list):
        return tuple(_decode(v, depth - 1) for v in data)
    if not isinstance(data, dict):
        return data
    if "$" in data:
        cls = _TYPES.get(data["$"])
        if cls is None:
            raise ValueError(f"unknown message type {str(data['$'])[:60]!r}")
        fields = {k: _decode(v, depth - 1) for k, v in data.items() if k != "$"}
        if cls is Fit:
            fields["config"] = dict(fields["config"])
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"malformed {data['$']}: {e}") from e
    if "$b" in data:
        return base64.b64decode(data["$b"], validate=True)
    if "$a" in data:
        if data.get("dtype") not in _DTYPES:
            got = str(data.get("dtype"))[:20]
            raise ValueError(f"array dtype {got!r}: send one of {sorted(_DTYPES)}")
        raw = base64.b64decode(data["$a"], validate=True)
        return np.frombuffer(raw, dtype=data["dtype"]).reshape(data["shape"]).copy()
    if "$d" in data:
        return {_decode(k, depth - 1): _decode(v, depth - 1) for k, v in data["$d"]}
    return {k: _decode(v, depth - 1) for k, v in data.items()}
