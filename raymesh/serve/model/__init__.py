"""The model: what a replica serves (`ModelSpec`, plain data the controller checks and sends:
`spec`) and the model it loads from that (`LoadedModel`, in the replica's process: `loaded`)."""

from raymesh.serve.model.loaded import LoadedModel
from raymesh.serve.model.spec import (
    ModelInfo,
    ModelSpec,
    PromptTooLong,
    check_under_root,
    resolve_checkpoint,
)

__all__ = [
    "LoadedModel",
    "ModelInfo",
    "ModelSpec",
    "PromptTooLong",
    "check_under_root",
    "resolve_checkpoint",
]
