"""Secure aggregation: the server learns the exact sum of the clients' updates and nothing else.

The protocol is Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS 2017), with double masking, over the sparse neighbour graph of Bell et al.
(CCS 2020) so that a client's cost grows with `log n`, not `n`. All primitives come from
libraries: X25519 key agreement, HKDF, ChaCha20 (the mask generator) and AES-GCM (shares in
transit) from `cryptography`; SHA-256 from hashlib. Shamir secret sharing is over the prime
field GF(2**31 - 1) in NumPy (`shamir`, next to this module, says what it guarantees).

One round, for the sampled clients:

1. **advertise**: each client makes two key pairs, `c` (to encrypt shares) and `s` (to mask),
   and a fresh self-mask seed `b`, and sends the public halves with a commitment to `b`
   (a SHA-256 hash bound to the round and the client). `s` is derived from a 16-byte seed so
   the seed can be shared. The server refuses a malformed or low-order public key here.
2. **share**: each client Shamir-shares its `s` seed and its `b` seed among its neighbours
   (threshold `t`; one `split` of the two seeds side by side, whose shares' halves are the
   seeds' shares), each share encrypted for its recipient; the server routes ciphertexts
   along the neighbour graph only, and only from a client that sent one to every neighbour.
3. **mask**: each client sends `y = x + PRG(b) + sum_v +-PRG(s_uv)` modulo 2**64, where `x` is
   its fixed-point update and `s_uv` the X25519 secret it shares with neighbour `v` (`+` when
   `u < v`), for each neighbour `v` whose share it received (so a client whose shares the
   server refused is in nobody's masks). Pairwise masks cancel in the sum; the self-mask does not.
4. **unmask**: the server names who dropped; each survivor returns, from the shares it holds,
   the `s` seed of each dropped neighbour and the `b` seed of each surviving one (a share it
   cannot decrypt is skipped). The server rebuilds each seed from `t` shares (all seeds in
   one NumPy pass, in the controller) and verifies it:
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

This module is the protocol's vocabulary (messages, keys, masks, fixed point, the neighbour
graph) and the client's side: all that an edge device copies. The server's side is
`raymesh.federated.aggregation.secagg_server`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from . import shamir

__all__ = [
    "KEY_BYTES",
    "PART_BYTES",
    "SEED_BYTES",
    "SHARE_BYTES",
    "FixedPoint",
    "KeyAdvert",
    "SecAggClient",
    "SecAggError",
    "Share",
    "advert_problem",
    "combine",
    "key_problem",
    "neighbours",
]

Share = tuple[int, bytes]  # (Shamir index, PART_BYTES of share)
Revealed = tuple[str, int, bytes]  # ("s" or "b", Shamir index, PART_BYTES of share)
SEED_BYTES = 16  # the s and b seeds: 128 bits each
PART_BYTES = shamir.part_bytes(SEED_BYTES)  # one share of one seed
KEY_BYTES = 32  # a raw X25519 public key; also a commitment's length (SHA-256)
# One encrypted share: nonce, Shamir index, the s and b parts, AES-GCM's tag.
SHARE_BYTES = 12 + 4 + 2 * PART_BYTES + 16
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
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        got = f"{len(raw)} bytes" if isinstance(raw, bytes) else type(raw).__name__
        return f"a public key must be {KEY_BYTES} bytes, not {got}"
    return _point_problem(raw)


# Each client checks every neighbour's advert, so a proc hosting many clients meets each key
# about `degree` times a round; the answer depends on the bytes alone, so it is kept.
@functools.lru_cache(maxsize=4096)
def _point_problem(raw: bytes) -> str | None:
    global _PROBE
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


def commitment(round_: int, client: int, seed: bytes) -> bytes:
    """A client's commitment to its self-mask seed, bound to the round and the client."""
    return hashlib.sha256(b"raymesh secagg b-commit %d %d " % (round_, client) + seed).digest()


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def s_key(seed: bytes) -> X25519PrivateKey:
    """The masking key pair a 16-byte `s` seed stands for (so the seed can be shared)."""
    return X25519PrivateKey.from_private_bytes(_kdf(seed, b"raymesh secagg s-key"))


def raw_key(key: X25519PublicKey) -> bytes:
    """A public key as its 32 raw bytes."""
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def prg(seed: bytes, round_: int, size: int) -> np.ndarray:
    """`size` uniform uint64 words from a 32-byte key: ChaCha20's keystream."""
    key = _kdf(seed, b"raymesh secagg mask %d" % round_)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * size)), dtype=np.uint64)


def pair_mask(own: X25519PrivateKey, peer: bytes, round_: int, size: int) -> np.ndarray:
    """The pairwise mask of `own` and the peer whose raw public key is `peer`."""
    return prg(own.exchange(X25519PublicKey.from_public_bytes(peer)), round_, size)


def _share_aad(round_: int, sender: int, recipient: int) -> bytes:
    return b"raymesh secagg share %d %d %d" % (round_, sender, recipient)


class SecAggClient:
    """One client's side of one round. Methods are the protocol's steps, called in order."""

    def __init__(self, client: int, round_: int) -> None:
        self.client, self.round = client, round_
        self._c = X25519PrivateKey.generate()
        self._s_seed, self._b_seed = os.urandom(SEED_BYTES), os.urandom(SEED_BYTES)
        self._s = s_key(self._s_seed)
        self._adverts: dict[int, KeyAdvert] = {}
        self._boxes: dict[int, AESGCM] = {}  # peer -> its share key (share and unmask use it)
        self._held: dict[int, bytes] = {}  # sender -> the encrypted share it sent us
        self._revealed: dict[int, str] = {}  # peer -> which of its seeds we gave the server
        self.skipped: dict[int, str] = {}  # sender -> why its share was not revealed

    def advertise(self) -> KeyAdvert:
        return KeyAdvert(
            self.client,
            raw_key(self._c.public_key()),
            raw_key(self._s.public_key()),
            commitment(self.round, self.client, self._b_seed),
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
        # One split of s || b: each share's first PART_BYTES are s's share, the rest b's.
        parts = shamir.split(self._s_seed + self._b_seed, threshold, len(peers))
        out = {}
        for idx, (v, part) in enumerate(zip(peers, parts, strict=True), start=1):
            nonce = os.urandom(12)
            plain = idx.to_bytes(4, "big") + part
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
        y += prg(self._b_seed, self.round, y.size)
        for v, advert in self._adverts.items():
            if v not in self._held:
                continue
            m = pair_mask(self._s, advert.s_public, self.round, y.size)
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
            if len(plain) != 4 + 2 * PART_BYTES:
                self.skipped[sender] = f"the share from client {sender} is {len(plain)} bytes"
                continue
            idx = int.from_bytes(plain[:4], "big")
            part = plain[4 : 4 + PART_BYTES] if which == "s" else plain[4 + PART_BYTES :]
            out[sender] = (which, idx, part)
        return out


def combine(shares: Iterable[Share]) -> bytes | None:
    """A seed from `threshold` of its Shamir shares, or None when they rebuild no seed
    (unverified: see aggregation.secagg_server.SecAggServer.rebuild). Raises
    shamir.ShareError for a malformed share."""
    return shamir.combine(list(shares))
