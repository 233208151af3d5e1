"""The policies a training job decides by, as one bundle the controller is given: each is a
small object that turns plain data into a decision (`StrategyPolicy`: DDP, FSDP or HSDP;
`FailurePolicy`: replace, shrink or abort; `GrowPolicy`: when an elastic job grows back;
`BalancePolicy`: the split of the global batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raymesh.train.control.balance import BalancePolicy
from raymesh.train.control.failure import FailurePolicy, GrowPolicy
from raymesh.train.sections import FailureConfig
from raymesh.train.strategy import StrategyPolicy

__all__ = ["Policies"]


@dataclass(frozen=True, kw_only=True)
class Policies:
    failure: FailurePolicy
    strategy: StrategyPolicy = field(default_factory=StrategyPolicy)
    grow: GrowPolicy = field(default_factory=GrowPolicy)
    balance: BalancePolicy = field(default_factory=BalancePolicy)

    @classmethod
    def of(cls, config: FailureConfig) -> Policies:
        """The policies a job's failure section asks for (its failure budget; the others'
        defaults)."""
        return cls(
            failure=FailurePolicy(
                max_failures=config.max_failures, window_s=config.failure_window_s
            )
        )
