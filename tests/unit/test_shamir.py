"""Shamir sharing over GF(2**31 - 1) (raymesh.federated.protocol.shamir): any `threshold`
shares rebuild the secret, fewer tell nothing, and a malformed share is refused by name."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from raymesh.federated.protocol.shamir import (
    PRIME,
    ShareError,
    combine,
    combine_many,
    share_problem,
    split,
)


def test_any_threshold_of_the_shares_rebuild_every_secret_and_halves_share_halves():
    for t, n in ((1, 1), (1, 4), (3, 6), (6, 6)):
        secrets = [os.urandom(32) for _ in range(3)] + [bytes(32), b"\xff" * 32]
        shares = [split(s, t, n) for s in secrets]
        assert all(len(p) == 64 for sh in shares for p in sh)
        picks = list(itertools.combinations(range(n), t))
        jobs = [[(i + 1, sh[i]) for i in pick] for sh in shares for pick in picks]
        rebuilt = combine_many(jobs)  # all secrets, all sets, one pass
        assert rebuilt == [s for s in secrets for _ in picks]
        # The first half of each share is a share of the secret's first half (s of s || b).
        assert all(
            combine([(i + 1, sh[i][:32]) for i in picks[0]]) == s[:16]
            for s, sh in zip(secrets, shares)
        )
    assert combine([(1, split(b"\x12\x34", 1, 1)[0])]) == b"\x12\x34"


def test_fewer_than_threshold_shares_rebuild_nothing_and_look_alike_for_any_secret():
    """t - 1 shares give a random value, not the secret; and share values are uniform in the
    field whatever the secret (zeros and all-ones secrets: the same spread)."""
    for _ in range(200):
        secret = os.urandom(16)
        shares = split(secret, 4, 7)
        assert combine([(i + 1, shares[i]) for i in (0, 2, 5)]) != secret
    for secret in (bytes(16), b"\xff" * 16):
        first = np.concatenate(
            [np.frombuffer(split(secret, 2, 2)[0], ">u4") for _ in range(500)]
        ).astype(np.float64)
        assert abs(first.mean() / PRIME - 0.5) < 0.02  # 4000 values: sd of the mean ~0.005
        assert 0.47 < np.mean(first >= PRIME // 2) < 0.53
        assert len(np.unique(first)) > 3990  # not the secret's 16-bit chunks


def test_a_wrong_share_changes_what_is_rebuilt():
    """A well-formed share with a wrong value is not detectable here: the result is another
    value (or None), which is why secure aggregation verifies every seed it rebuilds."""
    secret = os.urandom(16)
    shares = [(i + 1, p) for i, p in enumerate(split(secret, 3, 5))]
    values = bytearray(shares[1][1])
    values[3] ^= 1
    bad = [shares[0], (2, bytes(values)), shares[2]]
    assert share_problem(*bad[1], 32) is None
    assert combine(bad) != secret
    assert combine(shares[2:]) == secret  # a set without it still rebuilds


@pytest.mark.parametrize(
    "job, reason",
    [
        ([(1, bytes(31))], "not a whole number of 4-byte values"),
        ([(1, bytes(32)), (2, bytes(28))], "must be 32 bytes, not 28"),
        ([(0, bytes(32))], "index 0 is outside 1..2147483646"),
        ([(PRIME, bytes(32))], "index 2147483647 is outside"),
        ([(-3, bytes(32))], "index -3 is outside"),
        ([(True, bytes(32))], "index True is not an int"),
        ([(2, bytes(32)), (2, bytes(32))], "index 2 is given twice"),
        ([(1, b"\x7f\xff\xff\xff" + bytes(28))], "at or above the prime"),
        ([(1, "x" * 32)], "must be bytes, not str"),
        ([(1,)], "an \\(index, bytes\\) pair"),
        ([], "no shares"),
    ],
)
def test_malformed_shares_are_refused_with_the_reason(job, reason):
    with pytest.raises(ShareError, match=reason):
        combine(job)


def test_split_refuses_what_it_cannot_share():
    with pytest.raises(ShareError, match="even number of bytes"):
        split(b"odd", 2, 3)
    with pytest.raises(ShareError, match="threshold=0"):
        split(bytes(16), 0, 3)
    with pytest.raises(ShareError, match="count=2 with threshold=3"):
        split(bytes(16), 3, 2)
