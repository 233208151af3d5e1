"""A training job's config in sections, each checking its own fields, each handed to the rooms
that need only it (torchtitan's `JobConfig` shape):

- `ScalingConfig`: how many ranks, what each reserves, the spares (the placer, the world);
- `ParallelismConfig`: the strategy and what it is decided from (the placer, the controller);
- `FailureConfig`: the failure budget, the timeouts and the injected faults (the policies, the
  world);
- `LoopConfig`: steps, batch, seed, reporting, the build, the data, the hyperparameters (the
  reporter, each rank's batches);
- `StepConfig`: how each step trains: precision, gradient clipping, the learning-rate schedule,
  evaluation (each rank's step);
- `CheckpointConfig` (`raymesh.train.config`): where and how often to save.

A user writes `TrainConfig`'s flat fields (keyword arguments, or a job file's top-level keys):
`TrainConfig.scaling`, `.parallelism`, `.failure`, `.loop` and `.step` are its sections, built
from those fields, with no defaults of their own (TrainConfig's are the only ones). A section
checks its fields on construction (ValueError naming the field, the value and the fix) and
normalises them (a TOML list of workers to a tuple, fault strings to Faults, a pipeline table
to a Pipeline); TrainConfig checks what spans sections. Frozen. The rank pool and each rank are
given the whole config: a rank hands it to the user's build function (`Context.config`) and
records it in each checkpoint's manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from raymesh._common import Range, bad, check_int, check_seconds
from raymesh.data import Pipeline
from raymesh.train.faults import Fault, parse_fault

__all__ = [
    "PRECISIONS",
    "SCHEDULES",
    "STRATEGIES",
    "FailureConfig",
    "LoopConfig",
    "ParallelismConfig",
    "ScalingConfig",
    "StepConfig",
    "StrategyName",
]

StrategyName = Literal["auto", "ddp", "fsdp", "hsdp"]
STRATEGIES = ("auto", "ddp", "fsdp", "hsdp")
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS = ("fp32", "bf16", "fp16")
Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many ranks (`workers`: a count, or (min, max) for an elastic job), the CPUs and GPU
    each proc reserves, the warm spares, and how long to wait for a replacement or between
    looks for capacity to grow back."""

    workers: int | tuple[int, int]
    cpus_per_worker: float
    gpus: bool | Literal["auto"]
    spares: int
    replace_timeout_s: float
    grow_interval_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", Range.check("workers", self.workers))
        if not self.cpus_per_worker >= 0:
            raise bad("cpus_per_worker", self.cpus_per_worker, "must be >= 0")
        if self.gpus not in (True, False, "auto"):
            raise bad("gpus", self.gpus, "use 'auto', True or False")
        check_int("spares", self.spares, minimum=0)
        check_seconds("replace_timeout_s", self.replace_timeout_s)
        check_seconds("grow_interval_s", self.grow_interval_s)

    @property
    def min_workers(self) -> int:
        """The fewest ranks the job continues with (`workers` when it is not elastic)."""
        return Range.of(self.workers).min

    @property
    def max_workers(self) -> int:
        """The world size the job starts with and grows back to."""
        return Range.of(self.workers).max


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """The strategy ("auto" decides from a memory estimate), HSDP's shard group, activation
    checkpointing and offload (each "auto": the planner turns it on only when the job does not
    fit without it), the memory figures the decision may be given, and whether DDP splits the
    batch by the ranks' speed."""

    strategy: StrategyName
    shard_size: int | None
    activation_checkpointing: bool | Literal["auto"]
    offload: bool | Literal["auto"]
    memory_budget_gb: float | None
    activation_bytes: int | None
    rebalance: bool

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise bad("strategy", self.strategy, f"use one of {list(STRATEGIES)}")
        if self.shard_size is not None:
            check_int("shard_size", self.shard_size, minimum=2)
            if self.strategy not in ("auto", "hsdp"):
                raise bad(
                    "shard_size",
                    self.shard_size,
                    f"is for strategy 'hsdp' (or 'auto'), not {self.strategy!r}; drop it or "
                    "use strategy='hsdp'",
                )
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise bad("memory_budget_gb", self.memory_budget_gb, "must be > 0 (GiB per rank)")
        if self.activation_bytes is not None:
            check_int("activation_bytes", self.activation_bytes, minimum=0)
        if self.rebalance not in (True, False):
            raise bad("rebalance", self.rebalance, "use True or False")
        for name in ("activation_checkpointing", "offload"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise bad(name, value, "use 'auto', True or False")
        if self.offload is True and self.strategy == "ddp":
            raise bad(
                "offload",
                True,
                "moves FSDP's shards to host memory, and strategy='ddp' does not shard; use "
                "strategy='fsdp' (or 'auto'), or drop offload",
            )


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How each step trains: the precision of its compute, gradient clipping, the learning-rate
    schedule and how often the ranks evaluate `Task.eval_dataset`."""

    precision: Precision
    grad_clip: float | None
    lr_schedule: Schedule
    warmup_steps: int
    eval_every: int | None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise bad("precision", self.precision, f"use one of {list(PRECISIONS)}")
        if self.grad_clip is not None and not (
            isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0
        ):
            raise bad("grad_clip", self.grad_clip, "give the largest gradient norm (> 0), or None")
        if self.lr_schedule not in SCHEDULES:
            raise bad("lr_schedule", self.lr_schedule, f"use one of {list(SCHEDULES)}")
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.eval_every is not None:
            check_int("eval_every", self.eval_every, minimum=1)


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How many failures the job heals (in a window, or in all), the timeouts that bound every
    wait, and the faults injected for tests and demos."""

    max_failures: int
    failure_window_s: float | None
    timeout_s: float
    step_timeout_s: float
    faults: tuple[Fault, ...]

    def __post_init__(self) -> None:
        check_int("max_failures", self.max_failures, minimum=0)
        if self.failure_window_s is not None and not self.failure_window_s > 0:
            raise bad("failure_window_s", self.failure_window_s, "must be > 0 seconds, or None")
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("step_timeout_s", self.step_timeout_s)
        faults = tuple(parse_fault(f) if isinstance(f, str) else f for f in self.faults)
        for f in faults:
            if not isinstance(f, Fault):
                raise bad(
                    "faults", f, "use raymesh.testing.kill/fail/hang(...) or 'kill:rank=1:step=30'"
                )
        object.__setattr__(self, "faults", faults)


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """What is trained and how it is told: steps, the global and micro batch, the seed, how
    often the ranks report, whether to resume, where the run's files go, the build function's
    name, the data pipeline and the hyperparameters."""

    steps: int
    global_batch_size: int
    micro_batch_size: int | None
    seed: int
    report_every: int
    resume: bool | Literal["auto"]
    run_dir: str | None
    build: str | None
    data: Pipeline | None
    params: dict[str, Any]

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        check_int("global_batch_size", self.global_batch_size, minimum=1)
        if self.micro_batch_size is not None:
            check_int("micro_batch_size", self.micro_batch_size, minimum=1)
        check_int("seed", self.seed)
        check_int("report_every", self.report_every, minimum=1)
        if self.resume not in (True, False, "auto"):
            raise bad("resume", self.resume, "use 'auto', True or False")
        if self.build is not None and (not isinstance(self.build, str) or ":" not in self.build):
            raise bad("build", self.build, "name the build function as 'module:function'")
        if isinstance(self.data, dict):
            object.__setattr__(self, "data", Pipeline.from_dict(self.data))
        if self.data is not None and not isinstance(self.data, Pipeline):
            raise bad("data", self.data, "pass a raymesh.data.Pipeline(source=...) or None")
        if not isinstance(self.params, dict) or not all(isinstance(k, str) for k in self.params):
            raise bad("params", self.params, "give a dict of named values, e.g. {'lr': 0.01}")
