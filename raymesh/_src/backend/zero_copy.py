"""Zero-copy tensors through Ray's object store, without importing torch before it is used.

Ray sends torch tensors zero-copy when `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS` is set: procs read
it from the environment the raylet gives them. In the controller, Ray would `import torch` as
soon as it builds its serialisation context (the first remote call), 1.4 s on this project's
machines, which a program that never touches a tensor (or touches one later) should not pay at
its start. So the controller's context is built without it, and Ray's tensor reducer is
registered on it the moment torch is imported, by anyone (an import hook, removed once it has
run); a program that imported torch before connecting gets it at once. Either way every tensor
the controller sends goes zero-copy, as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from typing import Any

ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
_lock = threading.Lock()


def enable() -> None:
    """Set zero-copy for the procs (the environment) and for this process (see the module
    docstring). Call before `ray.init`."""
    os.environ.update(ENV)
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
