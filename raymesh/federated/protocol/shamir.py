"""Shamir secret sharing of short byte strings over the prime field GF(2**31 - 1), in NumPy.

A secret is cut into 16-bit chunks; each chunk is the constant term of its own polynomial of
degree `threshold - 1` whose other coefficients are uniform in the field, drawn from the
operating system's CSPRNG (`os.urandom`, never NumPy's generator). Share `i` (i = 1..count) of
the secret is every chunk's polynomial at `x = i`, each value as 4 bytes big-endian, so a share
is twice as long as its secret, and bytes [4k, 4k + 4) of a share belong to the secret's chunk
k alone: the first half of a share of `a + b` (two secrets of one length) is a share of `a`.

Guarantees, for shares made by `split`:
- any `threshold - 1` shares (or fewer) of a secret are uniformly distributed whatever the
  secret is, so together they reveal nothing about it (each chunk's polynomial has
  `threshold - 1` uniform coefficients, and the chunks' polynomials are independent);
- any `threshold` of them rebuild it exactly (`combine`, Lagrange interpolation at 0);
- a share of the wrong form (length, a value at or above the prime, an index outside
  1..2**31 - 2, an index given twice) is refused with `ShareError` (a ValueError) saying what
  is wrong. What no sharing can tell is a well-formed share with the wrong value: `combine`
  then returns another secret, or None when some chunk does not fit in 16 bits, so a caller
  verifies what it rebuilds (secure aggregation checks a seed against a public key or a hash).

The field fits NumPy's int64: every product of two field elements is below 2**62, so a multiply
then add stays exact before each reduction. Products are reduced one step at a time (Horner's
rule to share, one Lagrange term at a time to combine), never summed unreduced.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Sequence

import numpy as np

__all__ = [
    "PRIME",
    "ShareError",
    "combine",
    "combine_many",
    "part_bytes",
    "share_problem",
    "split",
]

PRIME = 2**31 - 1  # a Mersenne prime: field elements fit in 31 bits, products in 62
_CHUNK = ">u2"  # a secret's chunks: 16 bits each, so every chunk is a field element
_VALUE = ">u4"  # a share's values: field elements, 4 bytes each


class ShareError(ValueError):
    """A share, or a request to split, that is not of the form this sharing uses."""


def part_bytes(secret_bytes: int) -> int:
    """The length of one share of a `secret_bytes`-long secret."""
    return 2 * secret_bytes


def _uniform(shape: tuple[int, ...]) -> np.ndarray:
    """Field elements uniform in [0, PRIME), from os.urandom: 31 random bits each, and the one
    31-bit value that is not below the prime (2**31 - 1 itself) drawn again."""
    n = int(np.prod(shape, dtype=np.int64))
    out = np.frombuffer(os.urandom(4 * n), dtype="<u4").astype(np.int64) & PRIME
    while True:
        redo = np.flatnonzero(out == PRIME)
        if redo.size == 0:
            return out.reshape(shape)
        out[redo] = np.frombuffer(os.urandom(4 * redo.size), dtype="<u4").astype(np.int64) & PRIME


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """`count` shares of `secret` (an even number of bytes), any `threshold` of which rebuild
    it; share i + 1 is `out[i]` (its Shamir index is its position plus one)."""
    if not isinstance(secret, bytes) or not secret or len(secret) % 2:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ShareError(f"secret: {got}; share a non-empty even number of bytes")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ShareError(f"threshold={threshold!r}: it must be an int >= 1")
    if isinstance(count, bool) or not isinstance(count, int) or not threshold <= count < PRIME:
        raise ShareError(
            f"count={count!r} with threshold={threshold}: give threshold <= count < 2**31 - 1"
        )
    chunks = np.frombuffer(secret, dtype=_CHUNK).astype(np.int64)
    coeffs = _uniform((threshold - 1, chunks.size))  # the x**1 .. x**(t-1) coefficients
    x = np.arange(1, count + 1, dtype=np.int64)[:, None]
    y = np.zeros((count, chunks.size), np.int64)
    for c in coeffs[::-1]:  # Horner's rule: y = ((a_{t-1} x + a_{t-2}) x + ...) x + secret
        y = (y * x + c) % PRIME
    y = (y * x + chunks) % PRIME
    return [row.tobytes() for row in y.astype(_VALUE)]


def share_problem(index: object, part: object, length: int | None = None) -> str | None:
    """Why (`index`, `part`) is not a well-formed share (of a secret whose shares are `length`
    bytes, when given), or None when it is."""
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        return f"index {index!r} is not an int"
    if not 1 <= index < PRIME:
        return f"index {index} is outside 1..{PRIME - 1}"
    if not isinstance(part, bytes):
        return f"a share must be bytes, not {type(part).__name__}"
    if length is not None and len(part) != length:
        return f"a share must be {length} bytes, not {len(part)}"
    if not part or len(part) % 4:
        return f"a share's {len(part)} bytes are not a whole number of 4-byte values"
    if max(struct.unpack(f">{len(part) // 4}I", part)) >= PRIME:  # (a few us: no NumPy)
        return "a share holds a value at or above the prime 2**31 - 1"
    return None


@functools.lru_cache(maxsize=256)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The coefficients l_i with f(0) = sum_i l_i f(x_i) for any polynomial f of degree below
    len(xs) (the same index sets come back round after round: cached)."""
    out = []
    for i, xi in enumerate(xs):
        num = den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def _checked(job: Sequence[tuple[int, bytes]], where: str) -> tuple[tuple[int, ...], bytes]:
    if not job:
        raise ShareError(f"{where}: no shares to combine")
    seen: set[int] = set()
    if not all(isinstance(e, tuple) and len(e) == 2 for e in job):
        raise ShareError(f"{where}: a share must be an (index, bytes) pair")
    length = len(job[0][1]) if isinstance(job[0][1], bytes) else None
    for index, part in job:
        problem = share_problem(index, part, length)
        if problem is not None:
            raise ShareError(f"{where}: {problem}")
        if index in seen:
            raise ShareError(f"{where}: index {index} is given twice; give distinct shares")
        seen.add(int(index))
    return tuple(int(i) for i, _ in job), b"".join(part for _, part in job)


def combine_many(jobs: Sequence[Sequence[tuple[int, bytes]]]) -> list[bytes | None]:
    """Each job's secret, rebuilt from its (index, share) pairs: exact when the job holds
    `threshold` or more genuine shares of one secret; else another value, or None when the
    result is not a secret (a chunk above 16 bits). Jobs of the same size and share length
    are combined together, in one NumPy pass. Raises ShareError for a malformed job."""
    out: list[bytes | None] = [None] * len(jobs)
    groups: dict[tuple[int, int], list[tuple[int, tuple[int, ...], bytes]]] = {}
    for n, job in enumerate(jobs):
        xs, joined = _checked(list(job), f"job {n}")
        groups.setdefault((len(xs), len(joined)), []).append((n, xs, joined))
    for (t, size), members in groups.items():
        values = np.frombuffer(b"".join(m[2] for m in members), dtype=_VALUE)
        values = values.astype(np.int64).reshape(len(members), t, size // (4 * t))
        weights = np.array([_lagrange_at_zero(m[1]) for m in members], dtype=np.int64)
        acc = np.zeros((len(members), values.shape[2]), np.int64)
        for k in range(t):
            acc = (acc + weights[:, k, None] * values[:, k, :]) % PRIME
        fits = np.all(acc < 1 << 16, axis=1)
        for (n, _, _), ok, row in zip(members, fits, acc, strict=True):
            out[n] = row.astype(_CHUNK).tobytes() if ok else None
    return out


def combine(shares: Sequence[tuple[int, bytes]]) -> bytes | None:
    """One secret from its (index, share) pairs (`combine_many` of one job)."""
    return combine_many([shares])[0]
