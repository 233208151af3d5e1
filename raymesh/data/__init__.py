"""raymesh.data: preprocessing on a mesh of CPU procs of its own, ahead of the trainers.

    from raymesh import data, train

    pipe = data.Pipeline(source=data.from_files("shards/*.parquet"), transform=augment,
                         workers=(1, 8), prefetch=8)
    train.fit(build, train.TrainConfig(workers=4, steps=1000, global_batch_size=128, data=pipe))

A batch is a pure function of (seed, step, indices) (`raymesh.data.pipeline`): the trainers'
sample order (`raymesh.data.order`) decides the indices, so a run with a pipeline trains on
exactly the batches of a run without one, and healing, resuming and resizing keep their
guarantees. `data.batches(pipe, ...)` gives the same batches to a script of one's own.
"""

from raymesh.data.loader import Batches, batches
from raymesh.data.pipeline import DataError, Pipeline, make_batch, sample_seed
from raymesh.data.scaling import Scale, ScalePolicy
from raymesh.data.sources import Source, from_dataset, from_files, from_ray
from raymesh.data.workers import PipelineReport

__all__ = [
    "Batches",
    "DataError",
    "Pipeline",
    "PipelineReport",
    "Scale",
    "ScalePolicy",
    "Source",
    "batches",
    "from_dataset",
    "from_files",
    "from_ray",
    "make_batch",
    "sample_seed",
]
