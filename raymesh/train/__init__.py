"""raymesh.train: declarative distributed training on meshes.

    from raymesh import train
    result = train.fit(build, train.TrainConfig(workers=4, steps=300, global_batch_size=64))
    result.state_dict(), result.history

The build function runs on every rank and returns a `train.Task` (model, optimizer, dataset,
loss); raymesh owns the loop, the process group, the strategy (DDP or FSDP), the data order and
the checkpoints.
"""

from raymesh.train.api import fit
from raymesh.train.config import CheckpointConfig, TrainConfig, load_config
from raymesh.train.controller import Result, TrainError
from raymesh.train.failure import FailureRecord, TooManyFailures
from raymesh.train.task import Context, Task

__all__ = [
    "CheckpointConfig",
    "Context",
    "FailureRecord",
    "Result",
    "Task",
    "TooManyFailures",
    "TrainConfig",
    "TrainError",
    "fit",
    "load_config",
]
