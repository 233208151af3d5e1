"""`TrainConfig` and `CheckpointConfig`: the whole job, as keyword-only dataclasses.

A config file (`raymesh train job.toml`) and the Python API are the same schema: the file's
top-level keys are TrainConfig's fields, `[checkpoint]` is CheckpointConfig's. Every field is
checked on construction; a bad one raises ValueError naming the field, the value and the fix.
The fields are written flat, and read in sections (`TrainConfig.scaling`, `.parallelism`,
`.step`, `.failure`, `.loop`, `.checkpoint`; `raymesh.train.sections`): each room of the
controller is handed the section it needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raymesh._common import bad, check_int, from_table, read_toml, split_job, store_sections, stored
from raymesh.data import Pipeline
from raymesh.train.faults import Fault
from raymesh.train.sections import (
    FailureConfig,
    LoopConfig,
    ParallelismConfig,
    Precision,
    ScalingConfig,
    Schedule,
    StepConfig,
    StrategyName,
)

__all__ = ["CheckpointConfig", "TrainConfig", "load_config"]


# TrainConfig's sections by property name (raymesh.train.sections): what each room is given.
_SECTIONS: dict[str, type] = {
    "scaling": ScalingConfig,
    "parallelism": ParallelismConfig,
    "step": StepConfig,
    "failure": FailureConfig,
    "loop": LoopConfig,
}


def check_fp16(precision: str, strategy: str) -> None:
    """ValueError for fp16 with a sharded strategy (given, or decided for "auto"): its loss
    scaler is DDP's here."""
    if precision == "fp16" and strategy in ("fsdp", "hsdp"):
        raise bad(
            "precision",
            "fp16",
            f"with strategy={strategy!r}: loss scaling is for DDP here; use precision='bf16' "
            "(no scaling needed), or strategy='ddp'",
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often a job checkpoints (`TrainConfig.checkpoint`; `[checkpoint]` in a
    config file). Without one a job saves nothing, cannot resume, and an FSDP or HSDP job
    cannot heal (its lost shards exist nowhere else).

    Checked on construction: `dir` a non-empty path, `every` >= 0, `keep` >= 1; a bad field
    raises ValueError naming it (as `checkpoint.<field>`), the value and the fix. Frozen.

        CheckpointConfig(dir="runs/gpt", every=50, keep=3)  # step-00000050/, -100/, ... newest 3

    The layout and what a checkpoint guarantees (atomic, verified, resharded on load) are in
    `raymesh.train.checkpoint`.
    """

    dir: str  # folder of the run's checkpoints (step-00000050/, ...); created if missing
    every: int = 0  # save every N steps (0: only at the end)
    keep: int = 3  # keep the newest K committed checkpoints
    # Overlap writing with the next steps (torch's async DCP save). The commit then waits for
    # the next save or the end of the run, and a failure before that loses this checkpoint (the
    # previous one stands), so it is off by default.
    async_save: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise bad("checkpoint.dir", self.dir, "give a folder path, e.g. 'runs/gpt'")
        check_int("checkpoint.every", self.every, minimum=0)
        check_int("checkpoint.keep", self.keep, minimum=1)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job, whole: its size, batch, seed, strategy, checkpoints, failure handling
    and timeouts. `fit(build, config)` runs it; a TOML file with the same fields (`build` as
    "module:function", `[checkpoint]` as a table) is the same job for `raymesh train`.

    Checked on construction, every field and the ones that depend on each other (e.g.
    `global_batch_size` >= the largest world, `shard_size` a divisor of `workers` giving two or
    more groups, faults naming existing ranks): a bad one raises ValueError naming the field,
    the value and the fix. A `checkpoint` dict becomes a CheckpointConfig, a `workers` list a
    tuple and fault strings (`"kill:rank=1:step=30"`) Faults, so parsed file data is accepted
    as is. Frozen: a run's config does not change under it.

        TrainConfig(
            workers=(2, 4),  # elastic: start with 4, continue with no fewer than 2
            steps=300,
            global_batch_size=64,
            checkpoint=CheckpointConfig(dir="runs/gpt", every=50),
        )
    """

    # Ranks (trainer actors, one proc each). `(min, max)`: elastic; start at max, continue with
    # fewer (down to min) when a lost rank cannot be replaced, grow back when capacity returns.
    workers: int | tuple[int, int] = 1
    steps: int = 1  # optimizer steps in total (raise it and resume to train further)
    global_batch_size: int = 1  # samples per step, across all ranks
    micro_batch_size: int | None = None  # per-rank forward size; None: the rank's whole share
    seed: int = 0  # model init, data order: same seed, same run, bit for bit
    strategy: StrategyName = "auto"  # "auto" picks DDP, HSDP or FSDP from a memory estimate
    # HSDP's shard group: ranks each replica is sharded over (a divisor of workers). None: the
    # ranks of one host, when the ranks fill several hosts evenly.
    shard_size: int | None = None
    # Recompute each block's activations in the backward instead of keeping them: about a
    # third more compute for a fraction of the activation memory. "auto": only when needed.
    activation_checkpointing: bool | Literal["auto"] = "auto"
    # FSDP's parameters, gradients and optimizer state in host memory (GPU ranks): a model far
    # larger than the GPUs, at the cost of copies every step. "auto": only when needed.
    offload: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = None  # per-rank budget on CPU (GPU: the device's memory)
    activation_bytes: int | None = None  # per-rank activation memory hint (else measured)
    checkpoint: CheckpointConfig | None = None  # None: no saves (no resume; FSDP/HSDP cannot heal)
    resume: bool | Literal["auto"] = "auto"  # continue from the newest valid checkpoint
    run_dir: str | None = None  # metrics.jsonl goes here (default: checkpoint.dir, or none)
    report_every: int = 1  # send metrics to the controller every N steps
    cpus_per_worker: float = 1.0  # logical CPUs each trainer proc reserves
    gpus: bool | Literal["auto"] = "auto"  # one GPU per rank when the cluster has GPUs
    build: str | None = None  # "module:function" (config files; fit() takes the function)
    timeout_s: float = 600.0  # longest wait for any one controller step (setup, a report)
    step_timeout_s: float = 30.0  # floor of the hang timeout (else 10x the measured step time)
    max_failures: int = 3  # failures the job heals; one more stops it (TooManyFailures)
    failure_window_s: float | None = None  # count only failures this recent (None: all)
    spares: int = 0  # warm spare procs kept ready to replace a lost rank at once
    replace_timeout_s: float = 60.0  # wait this long to place a replacement, then shrink/abort
    grow_interval_s: float = 30.0  # elastic: how often to look for capacity to grow back
    # Split each global batch in proportion to the ranks' measured speed (DDP), so a straggler
    # does not hold every step back (raymesh.train.control.balance). Off: equal shares, bit-for-bit
    # reproducible runs (a rebalanced run is equal to float precision, not bitwise).
    rebalance: bool = False
    faults: tuple[Fault, ...] = ()  # injected faults, for tests and demos (raymesh.testing)
    # Preprocessing on procs of its own, ahead of the ranks (raymesh.data; `[data]` in a job
    # file). None: each rank reads and collates the build function's `Task.dataset` itself.
    data: Pipeline | None = None
    # The compute's precision: "bf16" or "fp16" autocast (DDP) or FSDP2's mixed precision, with
    # fp32 master weights, optimizer state and gradient reductions; "fp16" scales the loss
    # (GPU ranks only).
    precision: Precision = "fp32"
    grad_clip: float | None = None  # clip the global gradient norm to this (None: no clipping)
    # The learning rate of each step: the optimizer's, times a linear warmup over `warmup_steps`,
    # then constant, or decaying to 0 at `steps` (linear or cosine).
    lr_schedule: Schedule = "constant"
    warmup_steps: int = 0
    # Evaluate `Task.eval_dataset` every N steps and at the last (None: at the last step only);
    # reports then carry eval_loss (and perplexity).
    eval_every: int | None = None
    # Hyperparameters the build function reads as `ctx.params` (raymesh.tune sets a trial's);
    # plain data (numbers, strings, lists), as a checkpoint's manifest stores them.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint, dict):
            checkpoint = from_table(CheckpointConfig, self.checkpoint, "checkpoint")
            object.__setattr__(self, "checkpoint", checkpoint)
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise bad("checkpoint", self.checkpoint, "pass a CheckpointConfig(dir=...) or None")
        store_sections(self, _SECTIONS)  # each checks its own fields, once
        # What spans sections.
        if self.global_batch_size < self.max_workers:
            raise bad(
                "global_batch_size",
                self.global_batch_size,
                f"gives some of the {self.max_workers} workers no samples; use at least "
                f"{self.max_workers} (a multiple of the world size splits evenly)",
            )
        shard = self.shard_size
        if shard is not None and (self.max_workers % shard or self.max_workers == shard):
            raise bad(
                "shard_size",
                shard,
                f"must split workers={self.max_workers} into 2 or more equal shard groups; "
                f"use a divisor of {self.max_workers} below it",
            )
        check_fp16(self.precision, self.strategy)
        if self.warmup_steps > self.steps:
            raise bad(
                "warmup_steps",
                self.warmup_steps,
                f"is longer than the run (steps={self.steps}); use at most {self.steps}",
            )
        for f in self.faults:
            if f.rank >= self.max_workers:
                raise bad(
                    "faults", str(f), f"rank {f.rank} does not exist with workers={self.workers}"
                )

    # ---- the sections (raymesh.train.sections): what each room is given --------------------
    @property
    def scaling(self) -> ScalingConfig:
        return stored(self, "scaling", ScalingConfig)

    @property
    def parallelism(self) -> ParallelismConfig:
        return stored(self, "parallelism", ParallelismConfig)

    @property
    def step(self) -> StepConfig:
        return stored(self, "step", StepConfig)

    @property
    def failure(self) -> FailureConfig:
        return stored(self, "failure", FailureConfig)

    @property
    def loop(self) -> LoopConfig:
        return stored(self, "loop", LoopConfig)

    @property
    def min_workers(self) -> int:
        """`ScalingConfig.min_workers`: the fewest ranks the job continues with."""
        return self.scaling.min_workers

    @property
    def max_workers(self) -> int:
        """`ScalingConfig.max_workers`: the world size the job starts and grows back to."""
        return self.scaling.max_workers

    def run_folder(self) -> str | None:
        """Where metrics.jsonl and events.jsonl go: `run_dir`, else the checkpoint folder, else
        nowhere (None)."""
        return self.run_dir or (self.checkpoint.dir if self.checkpoint else None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (faults as their CLI strings), e.g. for a checkpoint's manifest."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["checkpoint"] = dataclasses.asdict(self.checkpoint) if self.checkpoint else None
        data["faults"] = [str(f) for f in self.faults]
        data["data"] = self.data.to_dict() if self.data is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from plain data (a parsed config file); unknown keys are an error."""
        return from_table(cls, data)


def load_config(path: str | Path, *, build: bool = False) -> TrainConfig:
    """Read a TOML job file whose schema is TrainConfig (the tables other commands own, such
    as [tune] and [serve], are skipped: `raymesh._common.tables`). A bad field is a ValueError
    naming the file and the field; with `build`, so is a file that names no build function."""
    job, _ = split_job(read_toml(path))
    try:
        config = TrainConfig.from_dict(job)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if build and config.build is None:
        raise ValueError(f'{path}: set build = "module:function" in the job file')
    return config
