"""A federated client trains in its proc with plain torch, never DDP: warm procs import torch
alone, not what a training rank adds (torch._dynamo, raymesh.train's modules)."""

from tests.conftest import warm_procs_import

_warm_procs_import_torch = warm_procs_import("torch")
