"""`fit`: run a training job and return its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from raymesh._common import resolve
from raymesh.train.config import TrainConfig
from raymesh.train.control.controller import TrainController
from raymesh.train.control.warm import WarmRanks
from raymesh.train.injector import FaultInjector
from raymesh.train.result import Result
from raymesh.train.task import Context, Task

__all__ = ["fit"]


def fit(
    build: Callable[[Context], Task] | str | None,
    config: TrainConfig,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    warm: WarmRanks | None = None,
) -> Result:
    """Train `build`'s task as `config` says, on a mesh of trainer procs; return the result.

    build: runs on every rank and returns a `Task`; a function, or "module:function" (then it
        is imported here first, so a bad name fails before any proc starts). None takes
        `config.build`.
    progress: called in this process after each reported chunk with step, steps, loss,
        samples_per_s, eta_s and per-rank losses (the CLI draws its progress bar from it). An
        exception it raises ends the job there (its procs stopped) and propagates out of fit
        (raymesh.tune prunes a trial that way).
    warm: procs kept up between jobs (`train.WarmRanks`): the job takes its ranks from there
        first, and gives its live ranks back when it ends cleanly (finished, or stopped by
        `progress`, after the ranks finish the chunk they were given) instead of stopping them.
    Raises ValueError for a bad config or build, `TrainError` when training fails.
    """
    fn, config, hooks = prepare(build, config, "fit")
    return TrainController.create(fn, config, progress=progress, hooks=hooks, warm=warm).run()


def prepare(
    build: Callable[[Context], Task] | str | None, config: TrainConfig, caller: str
) -> tuple[Callable[[Context], Task], TrainConfig, FaultInjector | None]:
    """What a job runs (`fit`, `drive`): the build function (imported here first, so a bad
    name fails before any proc starts), the config naming it where another process can
    import it, and the fault injector its `faults` ask for. TypeError, ValueError."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a train.TrainConfig, not {type(config).__name__}")
    chosen = build if build is not None else config.build
    if chosen is None:
        raise ValueError(
            f"no build function: pass one to {caller}(), or set TrainConfig(build=...)"
        )
    fn = resolve(chosen)
    if config.build is None and (name := _import_name(chosen, fn)) is not None:
        # Recorded in every checkpoint's manifest, so `raymesh export` and a serve replica
        # rebuild the model without being told the build function again.
        config = dataclasses.replace(config, build=name)
    return fn, config, FaultInjector(config.faults) if config.faults else None


def _import_name(chosen: Any, fn: Callable[..., Any]) -> str | None:
    """`chosen` as "module:function" when another process can import it; else None (a
    function of `__main__`, a method, or one defined inside another)."""
    if isinstance(chosen, str):
        return chosen
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or module == "__main__" or "." in name or "<" in name:
        return None
    return f"{module}:{name}"
