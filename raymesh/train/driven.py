"""`drive`: a training job whose steps an outer loop supplies, one batch at a time.

    job = train.drive(build, train.TrainConfig(workers=4, steps=100, global_batch_size=64))
    while job.trained < 100:
        samples = make_samples(job.weights())  # e.g. rollouts sampled with the newest policy
        row = job.step(samples)  # forward, backward, optimizer on every rank
    result = job.close()

For a loop that owns its data (reinforcement learning: the rollouts of a step exist only once
the policy of the step before is out; online learning; a curriculum decided as it goes), the
job is `fit`'s, run a step at a time: the same controller, states, placement, strategy (DDP,
FSDP, HSDP, decided or given), precision, memory planning, checkpoints, run folder, dashboard
and healing. torchft's `Manager` is fault tolerance as a layer any loop can call; here the loop
calls the job, and the job heals under it.

Guarantees:
- `step(samples)` returns once the step is trained on every rank, or raises (`TrainError`,
  `TooManyFailures`); a rank lost during the step (SIGKILLed, raising, hung past the step
  timeout) is replaced and the step trained again on the new world before it returns, with
  the samples the loop gave (the controller keeps them until no heal can need them).
- Bit for bit: the weights after step n equal those of a run without failures at the same
  world size (DDP heals in place from a survivor; FSDP and HSDP from the newest checkpoint,
  then train the steps since again on the samples kept for them).
- The samples of a step are its global batch, in the loop's order: rank r trains its share as
  `fit`'s ranks do (the split, micro batches and loss weighting are `fit`'s), so the gradient
  is the global batch's mean for any world size. `Task.dataset` is not read (None is fine).
  They are a list (each sample what `Task.collate_fn` takes), or columns: a dict of tensors
  whose rows are the samples (a batch is their rows, no collate_fn; cheaper to send). A list
  of dicts travels packed, one buffer per tensor key (`raymesh.train.packed`), and each
  sample reaches the ranks as it was given.
- `steps([samples, ...])` trains several steps in one call to the ranks (PPO's minibatches of
  one update): the same steps as one `step` each, with one round trip.
- `loss_fn(model, batch)` may return `(loss, {name: float})`: each statistic is weighed as the
  loss is and averaged over the ranks into the step's row, beside the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from raymesh.actor import Shared
from raymesh.train.api import prepare
from raymesh.train.checkpoint import read_manifest
from raymesh.train.config import TrainConfig
from raymesh.train.control.controller import TrainController
from raymesh.train.control.warm import WarmRanks
from raymesh.train.packed import pack
from raymesh.train.rank.full_state import ShardedState
from raymesh.train.reporting import JOB_EVENTS
from raymesh.train.result import Result
from raymesh.train.task import Context, Task

__all__ = ["DrivenJob", "Samples", "drive"]

# A step's samples: a list (each what Task.collate_fn takes), or columns (tensors whose rows
# are the samples).
Samples = Sequence[Any] | dict[str, torch.Tensor]


def drive(
    build: Callable[[Context], Task] | str | None,
    config: TrainConfig,
    *,
    example: Samples | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    warm: WarmRanks | None = None,
    labels: dict[str, Any] | None = None,
) -> DrivenJob:
    """Start a job whose loop supplies each step's samples (see the module docstring); it
    returns once the ranks are up, the strategy decided and a checkpoint restored (`resume`).

    build, config, progress, warm: as `fit`'s. `config.global_batch_size` is the number of
    samples each step takes; `config.steps` the most steps the loop will supply (the learning
    rate schedule's length). example: samples of one step, which the ranks measure activation
    memory on for the strategy decision; without it (and without `config.activation_bytes`)
    the decision weighs the weights and the optimizer alone. labels: what the run folder's
    "job" event says beside the config, e.g. {"kind": "rl"} (the dashboard shows an RL run
    so), JSON data.
    Raises ValueError for a bad config, build or example; `TrainError` when starting fails."""
    fn, config, hooks = prepare(build, config, "drive")
    if config.data is not None:
        raise ValueError(
            "drive(): TrainConfig(data=...) is a pipeline that makes the batches, and a driven "
            "job's loop supplies them; drop data=, or train with fit()"
        )
    controller = TrainController.create(
        fn, config, progress=progress, hooks=hooks, warm=warm, driven=True, labels=labels
    )
    job = DrivenJob(controller)
    controller.open(Shared([job._checked(example, "example")]) if example is not None else None)
    return job


class DrivenJob:
    """A running job of `drive`: `step` trains a step, `weights` reads the model, `save`
    checkpoints, `close` finishes, `stop` ends it at once. A context manager: leaving the
    block closes it (a failure in the block stops it)."""

    def __init__(self, controller: TrainController) -> None:
        self._controller = controller
        self._result: Result | None = None

    @property
    def config(self) -> TrainConfig:
        return self._controller.config

    @property
    def trained(self) -> int:
        """Steps trained so far (the next `step` trains 0-based step `trained`): 0, or where a
        resumed job's checkpoint was, plus the steps trained since."""
        return self._controller.world.step

    @property
    def world_size(self) -> int:
        return len(self._controller.world.ranks)

    @property
    def resumed(self) -> tuple[int, dict[str, Any]]:
        """(the step the job resumed at, the `extra` saved with that checkpoint); (0, {}) for a
        job that started fresh."""
        path = self._controller.resumed_path
        if path is None:
            return 0, {}
        manifest = read_manifest(Path(path))
        return manifest.data_position, dict(manifest.extra or {})

    def step(self, samples: Samples, *, report: dict[str, Any] | None = None) -> dict:
        """Train the next step on `samples` (its global batch: `global_batch_size` samples, a
        list or columns), healing as needed; the step's row, as the run folder's
        `metrics.jsonl` has it (step, loss, the loss function's statistics, and `report`: the
        loop's own figures of the step, e.g. its mean reward).
        ValueError for a wrong number of samples or a step past `config.steps`."""
        return self.steps([samples], report=report)[0]

    def steps(self, batches: Sequence[Samples], *, report: dict[str, Any] | None = None) -> list:
        """Train the next `len(batches)` steps, one on each batch, in one call to the ranks
        (as `step` each, `report` in the last one's row); their rows."""
        self._open("steps")
        if not batches:
            return []
        if self.trained + len(batches) > self.config.steps:
            raise ValueError(
                f"step: the job trained {self.trained} of its steps={self.config.steps}, and "
                f"{len(batches)} more would pass it; give TrainConfig(steps=...) the most steps "
                "the loop supplies, or close() it"
            )
        # one put, one read; each step's tensors packed (`raymesh.train.packed`)
        bundle = Shared([pack(self._checked(b, "samples")) for b in batches])
        return self._controller.drive(bundle, len(batches), report)

    def weights(self, *, trained_only: bool = False) -> Shared[dict[str, Any]] | ShardedState:
        """The model's full state now, stored once in the object store: rank 0's copy
        (`Shared`), or, for a model sharded by rows (FSDP), every rank's shards where they
        are (`ShardedState`: no rank gathers). Either is references: hand it to many readers;
        `get()` reads it (a `ShardedState` assembles the full tensors where it is read).
        `trained_only`: only the parameters that train (a LoRA model's adapters)."""
        self._open("weights")
        return self._controller.weights(trained_only)

    def tell(self, event: str, /, **data: Any) -> None:
        """Add an event of the loop's to the run folder's events.jsonl (and to every sink),
        `{"t", "event": event, **data}` (JSON data): raymesh.rl tells its roles and a
        replaced generator so. `event` must not be one of the job's own (`JOB_EVENTS`):
        ValueError naming it."""
        if event in JOB_EVENTS or not isinstance(event, str) or not event:
            raise ValueError(
                f"tell: event={event!r}: the job writes its own {sorted(JOB_EVENTS)}; name the "
                "loop's event otherwise"
            )
        self._controller.log.emit(event, **data)

    def save(self, *, extra: dict[str, Any] | None = None) -> str:
        """Checkpoint now, with `extra` (JSON data, read back by `resumed`), as `fit`'s
        checkpoints are (`raymesh serve --checkpoint`, `export` and `init=` read it); the
        committed step folder. ValueError without `config.checkpoint`."""
        self._open("save")
        return self._controller.save(extra)

    def close(self, *, extra: dict[str, Any] | None = None) -> Result:
        """Finish: the final checkpoint (with a checkpoint section; with `extra`, as `save`'s),
        the weights from rank 0, the procs stopped (or given back to `warm`); the job's
        `Result`. Closing again returns the same result."""
        if self._result is None:
            self._result = self._controller.close(extra)
        return self._result

    def stop(self, error: BaseException | None = None) -> None:
        """End the job now, without a final checkpoint (what failed may be the model): its
        procs stopped, its run folder told it ended (Failed, with `error`: what failed in the
        loop; else Stopped). Nothing after `close`."""
        self._controller.stop(error)

    def __enter__(self) -> DrivenJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.stop(exc[0] if isinstance(exc[0], BaseException) else None)

    def _open(self, what: str) -> None:
        if self._result is not None or self._controller.ended:
            raise RuntimeError(
                f"{what}: the job has ended (closed, stopped, or failed: what ended it was "
                "raised then); start another with train.drive"
            )

    def _checked(self, samples: Samples, field: str) -> Samples:
        n = self.config.global_batch_size
        if isinstance(samples, dict):
            rows = {k: len(v) for k, v in samples.items() if isinstance(v, torch.Tensor)}
            if not samples or len(rows) < len(samples) or len(set(rows.values())) != 1:
                raise TypeError(
                    f"{field}: columns are a dict of tensors with as many rows each (the "
                    f"samples); got {_describe(samples)}"
                )
            got = next(iter(rows.values()))
        elif isinstance(samples, Sequence) and not isinstance(samples, (str, bytes)):
            got, samples = len(samples), list(samples)
        else:
            raise TypeError(
                f"{field}: give a list of samples, or columns (a dict of tensors), not "
                f"{type(samples).__name__}"
            )
        if got != n:
            raise ValueError(
                f"{field}: {got} samples, but a step takes global_batch_size={n}; supply {n}, "
                f"or set TrainConfig(global_batch_size={got})"
            )
        return samples


def _describe(columns: dict) -> str:
    return ", ".join(
        f"{k}: {list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
        for k, v in list(columns.items())[:6]
    )
