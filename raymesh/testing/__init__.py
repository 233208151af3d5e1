"""Fault injection for training jobs, as a public API.

    from raymesh.testing import kill, fail, hang
    TrainConfig(..., faults=[kill(rank=1, at_step=30), fail(rank=0, at_step=50)])

and on the command line, `raymesh train job.toml --inject kill:rank=1:step=30`.

A fault fires once per job, on the rank it names, as that rank starts the given step (1-based:
`at_step=30` is the 30th step, the one in flight when it fires):
- `kill`: SIGKILL of the rank's process (no cleanup, like the OOM killer);
- `fail`: the step raises `InjectedFault` on that rank;
- `hang`: the rank stops making progress for `seconds` (default: until it is killed);
- `slow`: from that step on, the rank takes `factor` times as long per step (a straggler).

`fit` hands a config's faults to `FaultInjector`, which carries them out through
raymesh.train's hooks (`raymesh.train.hooks`): the training code has no fault of its own.
They live in `raymesh.train.faults` and `raymesh.train.injector` (a config carries faults, so
training needs them, not this package); this is their public front for tests and demos.
"""

from raymesh.train.faults import Fault, InjectedFault, fail, hang, kill, parse_fault, slow
from raymesh.train.injector import FaultInjector

__all__ = ["Fault", "FaultInjector", "InjectedFault", "fail", "hang", "kill", "parse_fault", "slow"]
