"""Secure aggregation: the server learns the exact sum of the clients' updates and nothing else.

The protocol is Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS 2017), with double masking, over the sparse neighbour graph of Bell et al.
(CCS 2020) so that a client's cost grows with `log n`, not `n`. All primitives come from
libraries: X25519 key agreement, HKDF, ChaCha20 (the mask generator) and AES-GCM (shares in
transit) from `cryptography`; Shamir secret sharing from PyCryptodome; SHA-256 from hashlib.

One round, for the sampled clients:

1. **advertise**: each client makes two key pairs, `c` (to encrypt shares) and `s` (to mask),
   and a fresh self-mask seed `b`, and sends the public halves with a commitment to `b`
   (a SHA-256 hash bound to the round and the client). `s` is derived from a 16-byte seed so
   the seed can be shared. The server refuses a malformed or low-order public key here.
2. **share**: each client Shamir-shares its `s` seed and its `b` seed among its neighbours
   (threshold `t`), each share encrypted for its recipient; the server routes ciphertexts
   along the neighbour graph only, and only from a client that sent one to every neighbour.
3. **mask**: each client sends `y = x + PRG(b) + sum_v +-PRG(s_uv)` modulo 2**64, where `x` is
   its fixed-point update and `s_uv` the X25519 secret it shares with neighbour `v` (`+` when
   `u < v`), for each neighbour `v` whose share it received (so a client whose shares the
   server refused is in nobody's masks). Pairwise masks cancel in the sum; the self-mask does not.
4. **unmask**: the server names who dropped; each survivor returns, from the shares it holds,
   the `s` seed of each dropped neighbour and the `b` seed of each surviving one (a share it
   cannot decrypt is skipped). The server rebuilds each seed from `t` shares and verifies it:
   an `s` seed must give the advertised public key, a `b` seed must match its commitment.
   When a rebuilt seed fails, some share was wrong: the server tries other sets of `t` among
   the shares returned (every set when there are at most `SEARCH` of them, else `SEARCH`
   random ones), so a few wrong shares among spare ones are skipped, never trusted. Then it
   removes the dropped clients' pairwise masks and the survivors' self-masks and holds the
   sum of the survivors' `x`.

Guarantees: with a semi-honest server, any single `y` is uniformly distributed whatever `x`
is; the sum is exact (integer arithmetic modulo 2**64 after fixed-point encoding); a client
dropping after step 2 is recovered as long as `t` of its neighbours return valid shares in
step 4; a seed is used only once it verifies, so a wrong share can make a round fail
(`SecAggError`) but never change its sum. A client never reveals both seeds of the same peer.
What no protocol without proofs can stop: a client that takes part may mask any vector it
likes, or deal shares nobody can read; the first is its own update (see docs/federated.md for
what raymesh bounds), the second makes the round fail when its seeds are needed.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

__all__ = [
    "KEY_BYTES",
    "SEED_BYTES",
    "SHARE_BYTES",
    "FixedPoint",
    "KeyAdvert",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "Share",
    "advert_problem",
    "combine",
    "key_problem",
    "neighbours",
]

Share = tuple[int, bytes]  # (Shamir index, 16-byte share)
Revealed = tuple[str, int, bytes]  # ("s" or "b", Shamir index, 16-byte share)
SEED_BYTES = 16  # PyCryptodome's Shamir shares 16-byte secrets
KEY_BYTES = 32  # a raw X25519 public key; also a commitment's length (SHA-256)
# One encrypted share: nonce, Shamir index, the s and b parts, AES-GCM's tag.
SHARE_BYTES = 12 + 4 + 2 * SEED_BYTES + 16
SEARCH = 64  # the most sets of t shares tried for one seed that fails to verify
_P = 2**255 - 19  # X25519's field: a canonical public key is below it


class SecAggError(RuntimeError):
    """Secure aggregation cannot finish: too few valid shares, or a seed that does not verify."""


@dataclass(frozen=True)
class FixedPoint:
    """Encodes floats as integers modulo 2**64 with `frac_bits` fractional bits.

    A sum of `n` encoded values decodes exactly as long as every partial sum stays within
    +-2**(63 - frac_bits); with the default 24 bits that is 5e11, far beyond any clipped update.
    """

    frac_bits: int = 24

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        limit = float(1 << (62 - self.frac_bits))
        if not np.all(np.abs(x) < limit):
            raise SecAggError(
                f"an update has a value beyond +-{limit:g}, which fixed point cannot hold: "
                "clip the update (clip_update) or lower frac_bits"
            )
        scaled = np.rint(x * (1 << self.frac_bits))
        return scaled.astype(np.int64).view(np.uint64)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return total.view(np.int64).astype(np.float64) / (1 << self.frac_bits)


def neighbours(clients: Iterable[int], degree: int, seed: int) -> dict[int, list[int]]:
    """Each client's neighbours in a public random graph: the Harary graph over a shuffled
    ring (each client linked to `degree // 2` on either side), or every other client when
    there are at most `degree + 1`. The same arguments give the same graph everywhere."""
    ring = sorted(clients)
    n = len(ring)
    if n <= degree + 1:
        return {u: [v for v in ring if v != u] for u in ring}
    random.Random(seed).shuffle(ring)
    half = max(1, degree // 2)
    out: dict[int, set[int]] = {u: set() for u in ring}
    for i, u in enumerate(ring):
        for d in range(1, half + 1):
            v = ring[(i + d) % n]
            out[u].add(v)
            out[v].add(u)
    return {u: sorted(vs) for u, vs in out.items()}


def default_degree(n: int) -> int:
    """Bell et al.'s O(log n) neighbourhood, at least 8 and even."""
    return max(8, 2 * math.ceil(math.log2(max(n, 2))))


@dataclass(frozen=True)
class KeyAdvert:
    """Step 1's message: a client's two public keys (raw X25519 bytes) and its commitment to
    this round's self-mask seed (`b_commit`, SHA-256)."""

    client: int
    c_public: bytes
    s_public: bytes
    b_commit: bytes


_PROBE: X25519PrivateKey | None = None


def key_problem(raw: Any) -> str | None:
    """Why `raw` is not an acceptable X25519 public key, or None when it is. Refused: anything
    but 32 bytes, a non-canonical encoding, and the low-order points, whose shared secret with
    every key is the same (zero), so that masks built on them would be known to anyone."""
    global _PROBE
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        got = f"{len(raw)} bytes" if isinstance(raw, bytes) else type(raw).__name__
        return f"a public key must be {KEY_BYTES} bytes, not {got}"
    if int.from_bytes(raw, "little") >= _P:
        return "a public key is not canonical (at or above 2**255 - 19)"
    if _PROBE is None:
        _PROBE = X25519PrivateKey.generate()
    try:  # OpenSSL refuses an all-zero shared secret: a low-order point gives it for any key
        _PROBE.exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        return "a public key is a low-order point"
    return None


def advert_problem(advert: Any) -> str | None:
    """Why `advert` is not a valid KeyAdvert, or None when it is."""
    if not isinstance(advert, KeyAdvert):
        return f"a key advert must be a KeyAdvert, not {type(advert).__name__}"
    if isinstance(advert.client, bool) or not isinstance(advert.client, int):
        return f"a key advert names client {advert.client!r}, not an int"
    for name in ("c_public", "s_public"):
        problem = key_problem(getattr(advert, name))
        if problem is not None:
            return f"client {advert.client}: {name}: {problem}"
    if not isinstance(advert.b_commit, bytes) or len(advert.b_commit) != KEY_BYTES:
        return f"client {advert.client}: b_commit must be {KEY_BYTES} bytes"
    return None


def _commit(round_: int, client: int, seed: bytes) -> bytes:
    return hashlib.sha256(b"raymesh secagg b-commit %d %d " % (round_, client) + seed).digest()


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _s_key(seed: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(_kdf(seed, b"raymesh secagg s-key"))


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _prg(seed: bytes, round_: int, size: int) -> np.ndarray:
    """`size` uniform uint64 words from a 32-byte key: ChaCha20's keystream."""
    key = _kdf(seed, b"raymesh secagg mask %d" % round_)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * size)), dtype=np.uint64)


def _pair_mask(own: X25519PrivateKey, peer: bytes, round_: int, size: int) -> np.ndarray:
    return _prg(own.exchange(X25519PublicKey.from_public_bytes(peer)), round_, size)


def _share_aad(round_: int, sender: int, recipient: int) -> bytes:
    return b"raymesh secagg share %d %d %d" % (round_, sender, recipient)


class SecAggClient:
    """One client's side of one round. Methods are the protocol's steps, called in order."""

    def __init__(self, client: int, round_: int) -> None:
        self.client, self.round = client, round_
        self._c = X25519PrivateKey.generate()
        self._s_seed, self._b_seed = os.urandom(SEED_BYTES), os.urandom(SEED_BYTES)
        self._s = _s_key(self._s_seed)
        self._adverts: dict[int, KeyAdvert] = {}
        self._boxes: dict[int, AESGCM] = {}  # peer -> its share key (share and unmask use it)
        self._held: dict[int, bytes] = {}  # sender -> the encrypted share it sent us
        self._revealed: dict[int, str] = {}  # peer -> which of its seeds we gave the server
        self.skipped: dict[int, str] = {}  # sender -> why its share was not revealed

    def advertise(self) -> KeyAdvert:
        return KeyAdvert(
            self.client,
            _raw(self._c.public_key()),
            _raw(self._s.public_key()),
            _commit(self.round, self.client, self._b_seed),
        )

    def _box(self, peer: int) -> AESGCM:
        if peer not in self._boxes:
            public = X25519PublicKey.from_public_bytes(self._adverts[peer].c_public)
            self._boxes[peer] = AESGCM(_kdf(self._c.exchange(public), b"raymesh secagg share-key"))
        return self._boxes[peer]

    def share(self, adverts: Mapping[int, KeyAdvert], threshold: int) -> dict[int, bytes]:
        """Step 2: `adverts` are this client's neighbours'. Returns recipient -> ciphertext.
        Raises SecAggError for a neighbour's invalid advert or a threshold above the count."""
        for v, advert in adverts.items():
            problem = advert_problem(advert)
            if problem is not None or advert.client != v:
                raise SecAggError(f"client {self.client}: neighbour {v}'s advert: {problem}")
        self._adverts = {v: a for v, a in adverts.items() if v != self.client}
        peers = sorted(self._adverts)
        if threshold > len(peers):
            raise SecAggError(
                f"threshold {threshold} exceeds client {self.client}'s {len(peers)} neighbours"
            )
        s_shares = Shamir.split(threshold, len(peers), self._s_seed)
        b_shares = Shamir.split(threshold, len(peers), self._b_seed)
        out = {}
        for v, (idx, s_part), (_, b_part) in zip(peers, s_shares, b_shares, strict=True):
            nonce = os.urandom(12)
            plain = idx.to_bytes(4, "big") + s_part + b_part
            out[v] = nonce + self._box(v).encrypt(
                nonce, plain, _share_aad(self.round, self.client, v)
            )
        return out

    def receive(self, shares: Mapping[int, bytes]) -> None:
        """Keeps the ciphertexts other clients addressed to this one (sender -> ciphertext):
        only from neighbours, and only bytes. A sender kept here is one this client masks with
        (the server routed its shares, so it masks with this client too)."""
        for sender, blob in shares.items():
            if sender in self._adverts and isinstance(blob, bytes):
                self._held[sender] = blob

    def mask(self, update: np.ndarray) -> np.ndarray:
        """Step 3: `update` is the fixed-point (uint64) encoding; returns what the server sees.
        Pairwise masks only with the neighbours whose shares arrived (`receive`)."""
        y = update.astype(np.uint64, copy=True)
        y += _prg(self._b_seed, self.round, y.size)
        for v, advert in self._adverts.items():
            if v not in self._held:
                continue
            m = _pair_mask(self._s, advert.s_public, self.round, y.size)
            if self.client < v:
                y += m
            else:
                y -= m
        return y

    def unmask(self, dropped: Iterable[int]) -> dict[int, Revealed]:
        """Step 4: for each neighbour whose share we hold, ('s', idx, share) if it dropped or
        ('b', idx, share) if it survived. A share that does not decrypt, and a request for a
        peer's second seed, are skipped (`skipped` says why), never answered."""
        gone = set(dropped)
        out = {}
        for sender, blob in self._held.items():
            which = "s" if sender in gone else "b"
            if self._revealed.setdefault(sender, which) != which:
                self.skipped[sender] = f"asked for both seeds of client {sender}: refused"
                continue
            try:
                plain = self._box(sender).decrypt(
                    blob[:12], blob[12:], _share_aad(self.round, sender, self.client)
                )
            except (InvalidTag, ValueError) as e:  # forged, misrouted, or cut short
                self.skipped[sender] = f"the share from client {sender} does not decrypt ({e!r})"
                continue
            if len(plain) != 4 + 2 * SEED_BYTES:
                self.skipped[sender] = f"the share from client {sender} is {len(plain)} bytes"
                continue
            idx = int.from_bytes(plain[:4], "big")
            part = plain[4 : 4 + SEED_BYTES] if which == "s" else plain[4 + SEED_BYTES :]
            out[sender] = (which, idx, part)
        return out


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
        order), 16 bytes. Others are left out, the reason in `ignored[holder]`."""
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
        if not isinstance(share, bytes) or len(share) != SEED_BYTES:
            return f"a share must be {SEED_BYTES} bytes"
        return ""

    def needed(
        self, answers: Mapping[int, Mapping[int, Revealed]]
    ) -> dict[tuple[str, int], list[Share]]:
        """Step 4's Shamir jobs: for each survivor ('b', u) and each dropped client ('s', v),
        the first `threshold` usable shares (`shares`). Raises SecAggError when a seed has
        fewer: too many clients dropped or answered wrongly."""
        parts = self.shares(answers)
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
            return hmac.compare_digest(_raw(_s_key(seed).public_key()), advert.s_public)
        return hmac.compare_digest(_commit(self.round, owner, seed), advert.b_commit)

    def rebuild(self, key: tuple[str, int], shares: list[Share], candidate: Any = None) -> bytes:
        """Client key[1]'s seed: `candidate` (rebuilt elsewhere) if it verifies, else the first
        set of `threshold` of `shares` whose secret verifies (every set when there are at
        most SEARCH, else SEARCH sets drawn at random, the first `threshold` first). Raises
        SecAggError when none does: the round cannot be unmasked without trusting a share."""
        if candidate is not None and self.verify(key, candidate):
            return candidate
        t, n = self.threshold, len(shares)
        if n < t:
            raise SecAggError(f"round {self.round}: {n} of {t} shares of client {key[1]}")
        picks: Iterable[tuple[int, ...]]
        if math.comb(n, t) <= SEARCH:
            picks = itertools.combinations(range(n), t)
        else:
            rng = random.Random(f"{self.round} {key}")
            picks = [tuple(range(t))] + [tuple(rng.sample(range(n), t)) for _ in range(SEARCH - 1)]
        for pick in picks:
            seed = combine(shares[i] for i in pick)
            if self.verify(key, seed):
                return seed
        raise SecAggError(
            f"round {self.round}: no set of {t} of the {n} shares of client {key[1]}'s "
            f"{key[0]} seed verifies: its shares are wrong, so its mask cannot be removed"
        )

    def finish(
        self,
        answers: Mapping[int, Mapping[int, Revealed]],
        seeds: Mapping[tuple[str, int], Any] | None = None,
    ) -> np.ndarray:
        """Step 4: `answers` are the survivors' `unmask` results; `seeds` candidates for the
        seeds of `needed(answers)` rebuilt elsewhere (with `combine`), used once verified.
        Returns the exact sum of the survivors' fixed-point updates, or raises SecAggError."""
        self.needed(answers)  # too few shares: fail before any work
        parts = self.shares(answers)
        candidates = seeds or {}
        got = {key: self.rebuild(key, parts[key], candidates.get(key)) for key in self._wanted()}
        total = np.zeros(self.size, dtype=np.uint64)
        for y in self._masked.values():
            total += y
        for u in self.survivors:
            total -= _prg(got[("b", u)], self.round, self.size)
        for v in self.dropped:
            s_key = _s_key(got[("s", v)])
            for u in self._graph[v]:
                if u in self._contributors:  # y_u holds +-PRG(s_uv); remove it (u's sign is -v's)
                    m = _pair_mask(s_key, self._adverts[u].s_public, self.round, self.size)
                    if u < v:
                        total -= m
                    else:
                        total += m
        return total


def combine(shares: Iterable[Share]) -> bytes:
    """A secret from `threshold` of its Shamir shares (unverified: see SecAggServer.rebuild)."""
    return Shamir.combine(list(shares))
