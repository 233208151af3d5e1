"""The server's side of secure aggregation (`SecAggServer`): routes shares along the neighbour
graph, sums masked updates, rebuilds and verifies the seeds it needs, and removes the masks.
Rebuilding is NumPy over a prime field (raymesh.federated.protocol.shamir): every seed of a
round in one pass, a millisecond or two for a hundred clients, so it runs where the shares
arrive, in the controller, with no round trip to the procs.
The protocol, its steps and its guarantees are in the docstring of the client's side,
raymesh.federated.protocol.secagg; this side is never copied to an edge device.
"""

from __future__ import annotations

import hmac
import itertools
import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from raymesh.federated.protocol.secagg import (
    PART_BYTES,
    SEED_BYTES,
    KeyAdvert,
    Revealed,
    SecAggError,
    Share,
    commitment,
    pair_mask,
    prg,
    raw_key,
    s_key,
)
from raymesh.federated.protocol.shamir import combine_many, share_problem

__all__ = ["SEARCH", "SecAggServer"]

SEARCH = 64  # the most sets of t shares tried for one seed that fails to verify


class SecAggServer:
    """The server's side of one round: routes shares, sums masked updates, rebuilds and
    verifies seeds, removes masks."""

    def __init__(self, round_: int, size: int, *, threshold: int) -> None:
        self.round, self.size, self.threshold = round_, size, threshold
        self._adverts: dict[int, KeyAdvert] = {}
        self._graph: dict[int, list[int]] = {}
        self._masked: dict[tuple[int, ...], np.ndarray] = {}
        self._contributors: set[int] = set()
        self._sharers: set[int] = set()
        self.ignored: dict[int, str] = {}  # holder -> why some of its step-4 answers went unused

    def advertised(
        self, adverts: Iterable[KeyAdvert], graph: Mapping[int, list[int]]
    ) -> dict[int, dict[int, KeyAdvert]]:
        """Records step 1; returns, per client, its neighbours' adverts to pass on. Adverts
        must have been checked (`advert_problem`); a client advertising twice is an error."""
        self._adverts = {}
        for a in adverts:
            if a.client in self._adverts:
                raise SecAggError(f"client {a.client} advertised twice")
            self._adverts[a.client] = a
        self._graph = {
            u: sorted(v for v in graph.get(u, ()) if v in self._adverts and v != u)
            for u in self._adverts
        }
        return {u: {v: self._adverts[v] for v in vs} for u, vs in self._graph.items()}

    def route(self, outgoing: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Step 2: sender -> {recipient: ciphertext} becomes recipient -> {sender: ciphertext}.
        Only senders that advertised, and only along the graph: a ciphertext for any other
        recipient is not passed on."""
        self._sharers = {u for u in outgoing if u in self._graph}
        inbox: dict[int, dict[int, bytes]] = {}
        for sender in self._sharers:
            allowed = set(self._graph[sender])
            for recipient, blob in outgoing[sender].items():
                if recipient in allowed:
                    inbox.setdefault(recipient, {})[sender] = blob
        return inbox

    def add(self, clients: Iterable[int], masked: np.ndarray) -> None:
        """Step 3: the sum of some clients' masked updates (one client's, or a proc's partial
        sum over the clients it hosts: masks cancel in any sum)."""
        group = tuple(sorted(clients))
        for client in group:
            if client not in self._sharers:
                raise SecAggError(f"client {client} sent a masked update but shared no seeds")
            if client in self._contributors:
                raise SecAggError(f"client {client} sent a second masked update")
        if (
            not isinstance(masked, np.ndarray)
            or masked.dtype != np.uint64
            or masked.shape != (self.size,)
        ):
            raise SecAggError(f"clients {list(group)}: masked update must be uint64[{self.size}]")
        self._masked[group] = masked
        self._contributors.update(group)

    @property
    def survivors(self) -> list[int]:
        return sorted(self._contributors)

    @property
    def dropped(self) -> list[int]:
        return sorted(self._sharers - self._contributors)

    def _wanted(self) -> list[tuple[str, int]]:
        return [("b", u) for u in self.survivors] + [("s", v) for v in self.dropped]

    def shares(
        self, answers: Mapping[int, Mapping[int, Revealed]]
    ) -> dict[tuple[str, int], list[Share]]:
        """The usable shares of step 4's `answers` (holder -> owner -> (which, idx, share)):
        from a survivor, about a neighbour that shared with it, of the seed the server asked
        for, at the index that holder's share has (the owner numbers its neighbours in
        order), PART_BYTES of field elements (`shamir.share_problem`). Others are left out,
        the reason in `ignored[holder]`."""
        parts: dict[tuple[str, int], list[Share]] = {}
        gone = set(self.dropped)
        for holder, revealed in answers.items():
            if holder not in self._contributors:
                continue
            bad = []
            for owner, entry in revealed.items():
                problem = self._share_problem(holder, owner, entry, gone)
                if problem:
                    bad.append(f"client {owner}'s share: {problem}")
                    continue
                _, idx, share = entry
                parts.setdefault((entry[0], owner), []).append((idx, share))
            if bad:
                self.ignored[holder] = "; ".join(bad)[:300]
        return parts

    def _share_problem(self, holder: int, owner: Any, entry: Any, gone: set[int]) -> str:
        if owner not in self._sharers or holder not in self._graph.get(owner, ()):
            return "it holds none (not a neighbour that shared)"
        if not isinstance(entry, tuple) or len(entry) != 3:
            return "not a (which, index, share) triple"
        which, idx, share = entry
        if which != ("s" if owner in gone else "b"):
            return f"{which!r} is not the seed asked for"
        if idx != self._graph[owner].index(holder) + 1 or isinstance(idx, bool):
            return f"index {idx!r} is not this holder's"
        return share_problem(idx, share, PART_BYTES) or ""

    def needed(
        self, answers: Mapping[int, Mapping[int, Revealed]]
    ) -> dict[tuple[str, int], list[Share]]:
        """Step 4's Shamir jobs: for each survivor ('b', u) and each dropped client ('s', v),
        the first `threshold` usable shares (`shares`). Raises SecAggError when a seed has
        fewer: too many clients dropped or answered wrongly."""
        return self._needed(self.shares(answers))

    def _needed(
        self, parts: dict[tuple[str, int], list[Share]]
    ) -> dict[tuple[str, int], list[Share]]:
        for which, owner in self._wanted():
            got = len(parts.get((which, owner), []))
            if got < self.threshold:
                raise SecAggError(
                    f"round {self.round}: {got} valid shares of client {owner}'s seed came "
                    f"back, {self.threshold} are needed to remove its mask; too many clients "
                    "dropped or answered wrongly"
                )
        return {key: parts[key][: self.threshold] for key in self._wanted()}

    def verify(self, key: tuple[str, int], seed: Any) -> bool:
        """Whether `seed` is client key[1]'s: its `s` seed gives the advertised public key, its
        `b` seed the advertised commitment."""
        which, owner = key
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES or owner not in self._adverts:
            return False
        advert = self._adverts[owner]
        if which == "s":
            return hmac.compare_digest(raw_key(s_key(seed).public_key()), advert.s_public)
        return hmac.compare_digest(commitment(self.round, owner, seed), advert.b_commit)

    def rebuild(self, key: tuple[str, int], shares: list[Share]) -> bytes:
        """Client key[1]'s seed: the secret of the first set of `threshold` of `shares` that
        verifies (every set when there are at most SEARCH, else SEARCH sets drawn at random,
        the first `threshold` first; all sets rebuilt in one pass). Raises SecAggError when
        none does: the round cannot be unmasked without trusting a share."""
        t, n = self.threshold, len(shares)
        if n < t:
            raise SecAggError(f"round {self.round}: {n} of {t} shares of client {key[1]}")
        picks: Iterable[tuple[int, ...]]
        if math.comb(n, t) <= SEARCH:
            picks = itertools.combinations(range(n), t)
        else:
            rng = random.Random(f"{self.round} {key}")
            picks = [tuple(range(t))] + [tuple(rng.sample(range(n), t)) for _ in range(SEARCH - 1)]
        for seed in combine_many([[shares[i] for i in pick] for pick in picks]):
            if seed is not None and self.verify(key, seed):
                return seed
        raise SecAggError(
            f"round {self.round}: no set of {t} of the {n} shares of client {key[1]}'s "
            f"{key[0]} seed verifies: its shares are wrong, so its mask cannot be removed"
        )

    def finish(self, answers: Mapping[int, Mapping[int, Revealed]]) -> np.ndarray:
        """Step 4: `answers` are the survivors' `unmask` results. Rebuilds every seed needed
        from its first `threshold` shares in one pass, verifies each, and searches other sets
        (`rebuild`) only for a seed that fails. Returns the exact sum of the survivors'
        fixed-point updates, or raises SecAggError."""
        parts = self.shares(answers)
        jobs = self._needed(parts)  # too few shares: fail before any work
        firsts = dict(zip(jobs, combine_many(list(jobs.values())), strict=True))
        got = {
            key: seed
            if seed is not None and self.verify(key, seed)
            else self.rebuild(key, parts[key])
            for key, seed in firsts.items()
        }
        total = np.zeros(self.size, dtype=np.uint64)
        for y in self._masked.values():
            total += y
        for u in self.survivors:
            total -= prg(got[("b", u)], self.round, self.size)
        for v in self.dropped:
            v_key = s_key(got[("s", v)])
            for u in self._graph[v]:
                if u in self._contributors:  # y_u holds +-PRG(s_uv); remove it (u's sign is -v's)
                    m = pair_mask(v_key, self._adverts[u].s_public, self.round, self.size)
                    if u < v:
                        total -= m
                    else:
                        total += m
        return total
