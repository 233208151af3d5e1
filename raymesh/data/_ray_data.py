"""Ray Data sources: a `ray.data.Dataset` run once by Ray Data's streaming engine, its blocks
kept in the object store and read back by index (`raymesh.data.sources.RaySource`).

Ray Data is Ray's library, not the core's runtime: it lives here, with its one user. Imported
only when a Ray dataset is given, so `import raymesh.data` does not import Ray Data."""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["block", "materialize"]


def materialize(dataset: Any) -> tuple[list[Any], list[int]]:
    """Run `dataset`'s transforms (Ray Data executes them, streaming) and return its blocks'
    object refs and row counts, in the dataset's order. The refs keep the blocks alive."""
    if not isinstance(dataset, ray.data.Dataset):
        raise ValueError(
            f"source={type(dataset).__name__}: not a ray.data.Dataset; give one, e.g. "
            "ray.data.read_parquet(...)"
        )
    # Ray Data may emit blocks in the order its tasks finish; the sample order needs the
    # dataset's own order, the same in every run. A dataset runs with the context it was made
    # with (a copy of the one current then), so that is the one to set.
    context = dataset.context
    preserved = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    try:
        materialized = dataset.materialize()
    finally:
        context.execution_options.preserve_order = preserved
    refs: list[Any] = []
    sizes: list[int] = []
    for bundle in materialized.iter_internal_ref_bundles():
        for entry in bundle.blocks:  # a BlockEntry (Ray >= 2.60), a (ref, metadata) pair before
            ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
            refs.append(ref)
            sizes.append(int(meta.num_rows or 0))
    return refs, sizes


def block(ref: Any) -> Any:
    """The block behind `ref`, as a pyarrow Table (Ray stores blocks as Arrow or pandas)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(ray.get(ref, timeout=300)).to_arrow()
