"""Non-IID partitions of a labelled dataset across simulated clients."""

from __future__ import annotations

import numpy as np

from raymesh._common import check_int

__all__ = ["dirichlet_partition"]


def dirichlet_partition(
    labels: np.ndarray, clients: int, *, alpha: float, seed: int = 0, min_size: int = 1
) -> list[np.ndarray]:
    """Splits example indices among `clients` with a Dirichlet(`alpha`) label mix per class
    (Hsu et al., 2019): small `alpha` gives each client a few dominant labels, large `alpha`
    approaches IID. Every example goes to exactly one client; the same arguments give the same
    partition. Draws again (up to 100 times) until every client holds at least `min_size`."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels: got shape {labels.shape}; give a non-empty 1-D array")
    check_int("clients", clients, 1)
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r}: give a concentration > 0 (0.5 is a common non-IID mix)")
    if clients * min_size > labels.size:
        raise ValueError(
            f"min_size={min_size}: {clients} clients x {min_size} exceeds the {labels.size} "
            "examples; lower min_size or clients"
        )
    rng = np.random.default_rng(seed)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(clients)]
        for cls in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet([alpha] * clients)) * idx.size).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(idx, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"alpha={alpha}: no draw in 100 gave every client {min_size} examples; raise alpha or "
        "lower min_size"
    )
