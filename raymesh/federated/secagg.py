"""Secure aggregation: the server learns the exact sum of the clients' updates and nothing else.

The protocol is Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS 2017), with double masking, over the sparse neighbour graph of Bell et al.
(CCS 2020) so that a client's cost grows with `log n`, not `n`. All primitives come from
libraries: X25519 key agreement, HKDF, ChaCha20 (the mask generator) and AES-GCM (shares in
transit) from `cryptography`; Shamir secret sharing from PyCryptodome.

One round, for the sampled clients:

1. **advertise**: each client makes two key pairs, `c` (to encrypt shares) and `s` (to mask),
   and sends the public halves. `s` is derived from a 16-byte seed so the seed can be shared.
2. **share**: each client Shamir-shares its `s` seed and a fresh self-mask seed `b` among its
   neighbours (threshold `t`), each share encrypted for its recipient; the server only routes
   ciphertexts.
3. **mask**: each client sends `y = x + PRG(b) + sum_v +-PRG(s_uv)` modulo 2**64, where `x` is
   its fixed-point update and `s_uv` the X25519 secret it shares with neighbour `v` (`+` when
   `u < v`). Pairwise masks cancel in the sum; the self-mask does not.
4. **unmask**: the server names who dropped; each survivor returns, from the shares it holds,
   the `s` seed of each dropped neighbour and the `b` seed of each surviving one. The server
   rebuilds them (needing `t` shares each), removes the dropped clients' pairwise masks and the
   survivors' self-masks, and holds the sum of the survivors' `x`.

Guarantees: with a semi-honest server, any single `y` is uniformly distributed whatever `x`
is; the sum is exact (integer arithmetic modulo 2**64 after fixed-point encoding); a client
dropping after step 2 is recovered as long as `t` of its neighbours answer step 4. A client
never reveals both seeds of the same peer. Tampered or misrouted shares fail AES-GCM and raise
`SecAggError`.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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
    "FixedPoint",
    "KeyAdvert",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "Share",
    "combine",
    "neighbours",
]

Share = tuple[int, bytes]  # (Shamir index, 16-byte share)
_SEED = 16  # bytes: PyCryptodome's Shamir shares 16-byte secrets


class SecAggError(RuntimeError):
    """Secure aggregation cannot finish: too few shares, or a share that fails to verify."""


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
    """Step 1's message: a client's two public keys (raw X25519 bytes)."""

    client: int
    c_public: bytes
    s_public: bytes


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
        self._s_seed, self._b_seed = os.urandom(_SEED), os.urandom(_SEED)
        self._s = _s_key(self._s_seed)
        self._adverts: dict[int, KeyAdvert] = {}
        self._boxes: dict[int, AESGCM] = {}  # peer -> its share key (share and unmask use it)
        self._held: dict[int, bytes] = {}  # sender -> the encrypted share it sent us
        self._revealed: dict[int, str] = {}  # peer -> which of its seeds we gave the server

    def advertise(self) -> KeyAdvert:
        return KeyAdvert(self.client, _raw(self._c.public_key()), _raw(self._s.public_key()))

    def _box(self, peer: int) -> AESGCM:
        if peer not in self._boxes:
            public = X25519PublicKey.from_public_bytes(self._adverts[peer].c_public)
            self._boxes[peer] = AESGCM(_kdf(self._c.exchange(public), b"raymesh secagg share-key"))
        return self._boxes[peer]

    def share(self, adverts: Mapping[int, KeyAdvert], threshold: int) -> dict[int, bytes]:
        """Step 2: `adverts` are this client's neighbours'. Returns recipient -> ciphertext."""
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
        """Keeps the ciphertexts other clients addressed to this one (sender -> ciphertext)."""
        self._held.update(shares)

    def mask(self, update: np.ndarray) -> np.ndarray:
        """Step 3: `update` is the fixed-point (uint64) encoding; returns what the server sees."""
        y = update.astype(np.uint64, copy=True)
        y += _prg(self._b_seed, self.round, y.size)
        for v, advert in self._adverts.items():
            m = _pair_mask(self._s, advert.s_public, self.round, y.size)
            if self.client < v:
                y += m
            else:
                y -= m
        return y

    def unmask(self, dropped: Iterable[int]) -> dict[int, tuple[str, int, bytes]]:
        """Step 4: for each neighbour whose share we hold, ('s', idx, share) if it dropped or
        ('b', idx, share) if it survived. Refuses to reveal a peer's second seed."""
        gone = set(dropped)
        out = {}
        for sender, blob in self._held.items():
            which = "s" if sender in gone else "b"
            if self._revealed.setdefault(sender, which) != which:
                raise SecAggError(
                    f"client {self.client} was asked for both seeds of client {sender}"
                )
            try:
                plain = self._box(sender).decrypt(
                    blob[:12], blob[12:], _share_aad(self.round, sender, self.client)
                )
            except (InvalidTag, KeyError) as e:
                raise SecAggError(
                    f"client {self.client}: the share from client {sender} does not verify"
                ) from e
            idx = int.from_bytes(plain[:4], "big")
            out[sender] = (which, idx, plain[4 : 4 + _SEED] if which == "s" else plain[4 + _SEED :])
        return out


class SecAggServer:
    """The server's side of one round: routes shares, sums masked updates, removes masks."""

    def __init__(self, round_: int, size: int, *, threshold: int) -> None:
        self.round, self.size, self.threshold = round_, size, threshold
        self._adverts: dict[int, KeyAdvert] = {}
        self._graph: dict[int, list[int]] = {}
        self._masked: dict[tuple[int, ...], np.ndarray] = {}
        self._contributors: set[int] = set()
        self._sharers: set[int] = set()

    def advertised(
        self, adverts: Iterable[KeyAdvert], graph: Mapping[int, list[int]]
    ) -> dict[int, dict[int, KeyAdvert]]:
        """Records step 1; returns, per client, its neighbours' adverts to pass on."""
        self._adverts = {a.client: a for a in adverts}
        self._graph = {u: [v for v in graph[u] if v in self._adverts] for u in self._adverts}
        return {u: {v: self._adverts[v] for v in vs} for u, vs in self._graph.items()}

    def route(self, outgoing: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Step 2: sender -> {recipient: ciphertext} becomes recipient -> {sender: ciphertext}."""
        self._sharers = set(outgoing)
        inbox: dict[int, dict[int, bytes]] = {}
        for sender, boxes in outgoing.items():
            for recipient, blob in boxes.items():
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
        if masked.dtype != np.uint64 or masked.shape != (self.size,):
            raise SecAggError(f"clients {list(group)}: masked update must be uint64[{self.size}]")
        self._masked[group] = masked
        self._contributors.update(group)

    @property
    def survivors(self) -> list[int]:
        return sorted(self._contributors)

    @property
    def dropped(self) -> list[int]:
        return sorted(self._sharers - self._contributors)

    def needed(
        self, answers: Mapping[int, Mapping[int, tuple[str, int, bytes]]]
    ) -> dict[tuple[str, int], list[Share]]:
        """Step 4's Shamir jobs: for each survivor ('b', u) and each dropped client ('s', v),
        `threshold` of the shares the survivors' `unmask` answers returned. Raises
        SecAggError when a secret has too few."""
        parts: dict[tuple[str, int], list[Share]] = {}
        for holder, revealed in answers.items():
            if holder not in self._contributors:
                continue
            for owner, (which, idx, share) in revealed.items():
                parts.setdefault((which, owner), []).append((idx, share))
        wanted = [("b", u) for u in self.survivors] + [("s", v) for v in self.dropped]
        for which, owner in wanted:
            got = len(parts.get((which, owner), []))
            if got < self.threshold:
                raise SecAggError(
                    f"round {self.round}: {got} of client {owner}'s shares came back, "
                    f"{self.threshold} are needed to remove its mask; too many clients dropped"
                )
        return {key: parts[key][: self.threshold] for key in wanted}

    def finish(
        self,
        answers: Mapping[int, Mapping[int, tuple[str, int, bytes]]],
        seeds: Mapping[tuple[str, int], bytes] | None = None,
    ) -> np.ndarray:
        """Step 4: `answers` are the survivors' `unmask` results; `seeds` the secrets of
        `needed(answers)` when they were rebuilt elsewhere (with `combine`). Returns the exact
        sum of the survivors' fixed-point updates."""
        if seeds is None:
            seeds = {key: combine(shares) for key, shares in self.needed(answers).items()}
        total = np.zeros(self.size, dtype=np.uint64)
        for y in self._masked.values():
            total += y
        for u in self.survivors:
            total -= _prg(seeds[("b", u)], self.round, self.size)
        for v in self.dropped:
            s_key = _s_key(seeds[("s", v)])
            for u in self._graph[v]:
                if u in self._contributors:  # y_u holds +-PRG(s_uv); remove it (u's sign is -v's)
                    m = _pair_mask(s_key, self._adverts[u].s_public, self.round, self.size)
                    if u < v:
                        total -= m
                    else:
                        total += m
        return total


def combine(shares: Iterable[Share]) -> bytes:
    """A secret from `threshold` of its Shamir shares."""
    return Shamir.combine(list(shares))
