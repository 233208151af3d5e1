"""Faults as plain data (`Fault`), their constructors, and the CLI syntax `kind:rank=R:step=S`."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from raymesh._common import check_int

__all__ = ["Fault", "InjectedFault", "fail", "hang", "kill", "parse_fault", "slow"]

_KINDS = ("kill", "fail", "hang", "slow")
_WHEN = ("step", "join")


class InjectedFault(RuntimeError):
    """Raised in a rank by a `fail` fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str  # "kill" | "fail" | "hang" | "slow"
    rank: int  # the rank it fires on (in the current world)
    at_step: int  # 1-based step that is in flight when it fires
    seconds: float | None = None  # for "hang": how long (None: until killed)
    factor: float | None = None  # for "slow": each step takes this many times as long
    # "step": as the rank starts step at_step. "join": in the rank joining as `rank` a world
    # re-formed while step at_step is next (healing a failure at that step, or growing just
    # before it): a failure while healing.
    when: str = "step"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"fault kind={self.kind!r}: use one of {list(_KINDS)}")
        check_int("fault rank", self.rank, 0)
        check_int("fault at_step", self.at_step, 1)
        if self.when not in _WHEN:
            raise ValueError(f"fault when={self.when!r}: use one of {list(_WHEN)}")
        if self.kind == "slow" and self.when != "step":
            raise ValueError("fault 'slow': fires at a step (when='step'), not on joining")
        if (self.kind == "slow") != (self.factor is not None):
            raise ValueError(f"fault {self.kind!r}: factor is for (and required by) 'slow'")
        if self.factor is not None and not self.factor >= 1:
            raise ValueError(f"fault factor={self.factor!r}: must be >= 1 (2: twice as slow)")

    def fire(self) -> None:
        """Carry the fault out, here, in the rank's process ("slow" is carried out by the
        trainer, which stretches each step from then on)."""
        if self.kind == "slow":
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "fail":
            raise InjectedFault(f"injected failure on rank {self.rank} at step {self.at_step}")
        deadline = None if self.seconds is None else time.monotonic() + self.seconds
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.1)

    def __str__(self) -> str:
        extra = f":seconds={self.seconds:g}" if self.seconds is not None else ""
        extra += f":factor={self.factor:g}" if self.factor is not None else ""
        extra += f":when={self.when}" if self.when != "step" else ""
        return f"{self.kind}:rank={self.rank}:step={self.at_step}{extra}"


def kill(*, rank: int, at_step: int, when: str = "step") -> Fault:
    """SIGKILL `rank` as it starts step `at_step` (when="join": as it joins a world re-formed
    while `at_step` is next, e.g. healing a failure at that step)."""
    return Fault(kind="kill", rank=rank, at_step=at_step, when=when)


def fail(*, rank: int, at_step: int, when: str = "step") -> Fault:
    """Raise `InjectedFault` in `rank` as it starts step `at_step` (or joins, see `kill`)."""
    return Fault(kind="fail", rank=rank, at_step=at_step, when=when)


def hang(*, rank: int, at_step: int, seconds: float | None = None) -> Fault:
    """Stop `rank` making progress at step `at_step`, for `seconds` (None: until killed)."""
    return Fault(kind="hang", rank=rank, at_step=at_step, seconds=seconds)


def slow(*, rank: int, factor: float, at_step: int = 1) -> Fault:
    """Make `rank` `factor` times slower from step `at_step` on (it sleeps for the difference
    between its forward and backward passes: a straggler, for load-balancing tests)."""
    return Fault(kind="slow", rank=rank, at_step=at_step, factor=factor)


def parse_fault(text: str) -> Fault:
    """Parse the CLI syntax `kind:rank=R:step=S[:seconds=T][:factor=F][:when=join]`, e.g.
    `kill:rank=1:step=30` or `slow:rank=3:step=1:factor=2`."""
    kind, *parts = text.strip().split(":")
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--inject {text!r}: expected key=value after the kind, got {part!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"rank", "step", "seconds", "factor", "when"}
    if unknown or "rank" not in fields or "step" not in fields:
        raise ValueError(
            f"--inject {text!r}: use kind:rank=R:step=S[:seconds=T][:factor=F][:when=join], "
            "e.g. kill:rank=1:step=30"
        )
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
        seconds = float(fields["seconds"]) if "seconds" in fields else None
        factor = float(fields["factor"]) if "factor" in fields else None
    except ValueError:
        raise ValueError(
            f"--inject {text!r}: rank and step must be integers, seconds and factor numbers"
        ) from None
    return Fault(
        kind=kind,
        rank=rank,
        at_step=step,
        seconds=seconds,
        factor=factor,
        when=fields.get("when", "step"),
    )
