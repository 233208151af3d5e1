"""What the user's build function receives (`Context`) and returns (`Task`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raymesh.train.materialize import check_init

__all__ = ["Context", "LossFn", "Task", "loss_only"]

# What a Task's loss_fn is: the batch's mean loss, or (it, {name: statistic}).
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor | tuple[torch.Tensor, dict[str, Any]]]


def loss_only(loss_fn: LossFn) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """`loss_fn` returning its loss alone (the statistics beside it dropped), for what
    measures or evaluates the loss rather than reports a step."""

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        out = loss_fn(model, batch)
        return out[0] if isinstance(out, tuple) else out

    return loss


@dataclass(frozen=True, kw_only=True)
class Context:
    """Where the build function runs: one per rank, before training starts.

    The build function must be deterministic given `seed` (raymesh seeds torch with it before
    calling build, so `torch.nn.Linear(...)` initialises identically on every rank and run).
    """

    rank: int  # global rank in the current process group
    world_size: int  # number of ranks training now
    local_rank: int  # rank among this host's ranks (LOCAL_RANK)
    local_world_size: int  # ranks on this host (LOCAL_WORLD_SIZE)
    device: torch.device  # cuda:<local> on a GPU proc, cpu otherwise
    seed: int  # TrainConfig.seed
    config: Any = None  # the TrainConfig

    @classmethod
    def alone(
        cls, *, device: torch.device | str = "cpu", seed: int = 0, config: Any = None
    ) -> Context:
        """The Context of a process that builds the model on its own, rank 0 of 1 (an export,
        a test, a reader of published weights)."""
        return cls(
            rank=0, world_size=1, local_rank=0, local_world_size=1,
            device=torch.device(device), seed=seed, config=config,
        )  # fmt: skip

    @property
    def params(self) -> dict[str, Any]:
        """The job's hyperparameters (`TrainConfig.params`; a raymesh.tune trial's)."""
        return dict(getattr(self.config, "params", None) or {})


@dataclass(frozen=True)
class Local:
    """A rank's place among the ranks of its host."""

    rank: int  # 0.. size-1, in global rank order
    size: int  # ranks on this host


def local_ranks(node_ids: Sequence[str]) -> list[Local]:
    """Each rank's `Local`, for ranks whose hosts are `node_ids` (index = global rank)."""
    size = Counter(node_ids)
    seen: Counter[str] = Counter()
    out = []
    for node in node_ids:
        out.append(Local(seen[node], size[node]))
        seen[node] += 1
    return out


@dataclass(kw_only=True)
class Task:
    """The job a rank trains: a model, its optimizer, a map-style dataset and a loss.

    model: an nn.Module on any device; raymesh moves it to `Context.device` and wraps it in DDP
        or FSDP2 as the strategy decides. A model too large for one rank is built on the meta
        device (`with torch.device("meta"):`, no memory) with `init_weights`: raymesh shards it
        first, then allocates only each rank's shards and has `init_weights` fill them.
    optimizer: built over `model.parameters()` (raymesh rebuilds its param groups after FSDP
        sharding, keeping the class and hyperparameters).
    dataset: a map-style dataset (`__len__`, `__getitem__`); raymesh decides which indices each
        rank reads at each step. None when `TrainConfig.data` gives a pipeline (which then
        takes the place of both `dataset` and `collate_fn`).
    loss_fn: `loss_fn(model, batch) -> scalar tensor`, the mean loss over `batch`; or
        `(loss, {name: value})`: statistics of the batch (means over it) that the step's row
        reports beside the loss, averaged over the ranks as the loss is.
    collate_fn: turns a list of samples into a batch (default: torch's default_collate).
    eval_dataset: a map-style dataset the ranks evaluate `loss_fn` on every
        `TrainConfig.eval_every` steps (split across ranks, no gradients); the mean is the
        report's `eval_loss`. None: no evaluation.
    init_weights: `init_weights(model)` fills a model built on the meta device, once its
        tensors are allocated on the rank's device (under no_grad; sharded by then under
        FSDP/HSDP, so its parameters are DTensors and it should read only their local
        shards, as DCP does). `raymesh.train.hf.PretrainedWeights(folder)` reads a
        `save_pretrained` folder's safetensors so. Required when the model has meta tensors;
        ignored otherwise. A checkpoint restored afterwards overwrites what it filled.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Any = None
    loss_fn: LossFn
    collate_fn: Callable[[list[Any]], Any] | None = None
    eval_dataset: Any = None
    init_weights: Callable[[torch.nn.Module], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(
                f"Task.model={type(self.model).__name__}: give a torch.nn.Module (a "
                "transformers PreTrainedModel and a PEFT model are ones)"
            )
        check_init(self.model, self.init_weights)
