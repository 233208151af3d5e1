"""A driven job's samples packed for the trip to the ranks (`raymesh.train.packed`): each
sample comes back as it was given, and what cannot be packed travels as it is."""

from __future__ import annotations

import pickle

import torch

from raymesh.train.packed import Packed, pack, unpack


def _samples(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "ids": torch.randint(0, 256, (3 + i % 3,), generator=g),  # lengths differ
            "old": torch.randn(2, 4, generator=g),
            "start": i,
            "advantage": 0.5 * i,
            "empty": torch.zeros(0, dtype=torch.bool),
        }
        for i in range(n)
    ]


def test_samples_come_back_as_they_were_given_their_tensors_in_one_buffer_a_key():
    samples = _samples(5)
    packed = pack(samples)
    assert isinstance(packed, Packed) and set(packed.buffers) == {"ids", "old", "empty"}
    back = unpack(pickle.loads(pickle.dumps(packed)))  # as it travels
    assert len(back) == 5
    for a, b in zip(samples, back):
        assert list(a) == list(b)  # the keys in their order
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                assert b[k].dtype == v.dtype and b[k].shape == v.shape and torch.equal(b[k], v)
            else:
                assert b[k] == v


def test_what_cannot_be_packed_travels_as_it_is():
    columns = {"x": torch.ones(4, 2)}
    assert pack(columns) is columns
    assert pack([]) == [] and unpack([1, 2]) == [1, 2]
    texts = ["a", "b"]
    assert pack(texts) is texts
    uneven = [{"x": torch.ones(1)}, {"y": torch.ones(1)}]  # another key set
    assert pack(uneven) is uneven
    # a key whose dtype differs between samples stays in the samples; the others pack
    mixed = [
        {"x": torch.ones(2), "y": torch.ones(1)},
        {"x": torch.ones(2, dtype=torch.int64), "y": torch.ones(1)},
    ]
    packed = pack(mixed)
    assert set(packed.buffers) == {"y"}
    back = unpack(packed)
    assert back[1]["x"].dtype == torch.int64 and torch.equal(back[0]["y"], torch.ones(1))
