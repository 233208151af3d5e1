"""raymesh.train: declarative distributed training on meshes.

    from raymesh import train
    result = train.fit(build, train.TrainConfig(workers=4, steps=300, global_batch_size=64))
    result.state_dict(), result.history

The build function runs on every rank and returns a `train.Task` (model, optimizer, dataset,
loss); raymesh owns the loop, the process group, the strategy (DDP, FSDP or HSDP), the data
order and the checkpoints.
"""

from raymesh import preload
from raymesh.train.api import fit
from raymesh.train.config import CheckpointConfig, TrainConfig, load_config
from raymesh.train.control.failure import TooManyFailures
from raymesh.train.control.placement import use_gpus
from raymesh.train.control.warm import WarmRanks
from raymesh.train.driven import DrivenJob, drive
from raymesh.train.export import export_hf
from raymesh.train.plot import save_picture
from raymesh.train.rank.full_state import ShardedState
from raymesh.train.result import FailureRecord, Result, TrainError
from raymesh.train.task import Context, Task

# A training rank imports these (with DCP and DTensor, ~2 s and ~0.1 GB here): let warm procs
# pay for that before they are adopted.
preload("torch._dynamo", "raymesh.train.rank.worker")

__all__ = [
    "CheckpointConfig",
    "Context",
    "DrivenJob",
    "FailureRecord",
    "Result",
    "ShardedState",
    "Task",
    "TooManyFailures",
    "TrainConfig",
    "TrainError",
    "WarmRanks",
    "drive",
    "export_hf",
    "fit",
    "load_config",
    "save_picture",
    "use_gpus",
]
