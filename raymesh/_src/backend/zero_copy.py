"""Zero-copy tensors through Ray's object store, without importing torch before it is used.

Ray sends torch tensors zero-copy when its `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS` is on, and then
imports torch as soon as a process builds its serialisation context (its first remote call, or
a worker's first task): 1.4 s of CPU on this project's machines, paid by a controller that never
touches a tensor and by every cold proc, most of a proc's start (8 cold procs took 7.9 s with it
and 3.2 s without, 2 cores). So no raymesh process turns it on in the environment: the
controller (`enable`, before `ray.init`) and every proc (`ProcHost`'s constructor) build their
context without it, and Ray's tensor reducer is registered on it the moment torch is imported,
by anyone (an import hook, removed once it has run); a process that imported torch first gets
it at once. Either way every tensor a raymesh process sends goes zero-copy, as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from typing import Any

_lock = threading.Lock()


def enable() -> None:
    """Zero-copy tensors for this process from the moment it imports torch (see the module
    docstring): in the controller before `ray.init`, in a proc as it starts."""
    quiet_warnings()
    from ray._private import ray_constants

    if "torch" in sys.modules:
        ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = True
        return
    ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = False  # Ray's context: no torch import
    with _lock:
        if not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterTorch())


def quiet_warnings() -> None:
    """Ray warns on every tensor it sends zero-copy, and torch on every read-only tensor it
    receives; raymesh documents that received tensors are read-only views instead."""
    warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _torch_imported() -> None:
    """Register Ray's zero-copy reducer for tensors on every serialisation context of this
    process, and on those Ray builds from now on."""
    import torch
    from ray._private import ray_constants, tensor_serialization_utils
    from ray._private import worker as ray_worker

    ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = True
    contexts = getattr(ray_worker.global_worker, "serialization_context_map", {})
    for context in list(contexts.values()):
        if not context._zero_copy_tensors_enabled:
            context._register_cloudpickle_reducer(
                torch.Tensor, tensor_serialization_utils.zero_copy_tensors_reducer
            )
            context._zero_copy_tensors_enabled = True


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when torch is first imported, it wraps torch's loader so that
    `_torch_imported` runs once torch's module has executed, then removes itself."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch":
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _torch_imported()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
