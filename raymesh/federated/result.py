"""What a federated run gives back: a `RoundRecord` per round and the `Result` at the end; and
what one round's steps gathered (`Outcome`), before the round decides whether to apply it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from raymesh.federated.protocol.client import Layout
from raymesh.federated.protocol.messages import Fitted

__all__ = ["Outcome", "Result", "RoundRecord", "state_dict"]


@dataclass(frozen=True)
class RoundRecord:
    """What one round did. `dropped[cid]` says why a sampled client is not in the update;
    `ignored[cid]` why a client whose update is in it had a later answer refused (its shares
    for removing masks went unused); `reason` why the round was not applied; `metrics` are
    the evaluation's and the clients' mean figures ("loss")."""

    round: int
    sampled: int
    responded: int
    dropped: dict[int, str]
    applied: bool
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    epsilon: float | None = None
    replaced_hosts: int = 0
    reason: str = ""
    ignored: dict[int, str] = field(default_factory=dict)


@dataclass
class Result:
    history: list[RoundRecord]
    epsilon: float | None
    layout: Layout
    weights: np.ndarray
    template: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final global model, in the template model's state_dict form."""
        return state_dict(self.layout, self.weights, self.template)


def state_dict(
    layout: Layout, weights: np.ndarray, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`weights` (flat, as `layout` lays them out) in `template`'s state_dict form."""
    out = {k: v.clone() for k, v in template.items()}
    for name, value in layout.unflatten(weights).items():
        out[name] = torch.from_numpy(value.copy()).to(out[name].dtype)
    return out


@dataclass
class Outcome:
    """What a round's steps gathered: `total` (the summed update, `weight` its divisor) or,
    when None, the `fitted` answers for the strategy to aggregate; `reason` when the round
    must not be applied; `ignored` as in RoundRecord."""

    total: np.ndarray | None
    weight: float
    fitted: list[Fitted]
    reason: str = ""
    ignored: dict[int, str] = field(default_factory=dict)
