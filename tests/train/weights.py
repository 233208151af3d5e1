"""Comparing state dicts in the training tests."""

from __future__ import annotations

import torch

MLP = "raymesh.examples.mlp:build"


def equal(a: dict, b: dict) -> bool:
    """Bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict, b: dict, **tol) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)
