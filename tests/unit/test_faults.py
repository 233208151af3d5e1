"""Unit tests for `raymesh.train.faults`: faults as data and their CLI syntax."""

from __future__ import annotations

import pytest

from raymesh.testing import kill, slow
from raymesh.train.faults import Fault, parse_fault


@pytest.mark.parametrize(
    "fault",
    [
        kill(rank=1, at_step=30),
        kill(rank=1, at_step=6, when="join"),
        slow(rank=3, factor=2.5),
        Fault(kind="hang", rank=0, at_step=4, seconds=1.5),
    ],
)
def test_a_fault_round_trips_through_its_cli_syntax(fault):
    assert parse_fault(str(fault)) == fault


def test_the_cli_syntax_reads_when_join():
    assert str(kill(rank=1, at_step=6, when="join")) == "kill:rank=1:step=6:when=join"
    assert parse_fault("fail:rank=2:step=3:when=join").when == "join"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "explode"}, "kind='explode'"),
        ({"when": "later"}, "when='later'"),
        ({"kind": "slow", "factor": 2.0, "when": "join"}, "fires at a step"),
        ({"at_step": 0}, "at_step=0"),
        ({"rank": True}, "rank=True: give an integer >= 0"),  # a bool is no rank
        ({"at_step": True}, "at_step=True"),
    ],
)
def test_bad_faults_name_the_field(kwargs, match):
    base = {"kind": "kill", "rank": 0, "at_step": 1}
    with pytest.raises(ValueError, match=match):
        Fault(**{**base, **kwargs})


def test_bad_cli_syntax_shows_the_form():
    with pytest.raises(ValueError, match=r"use kind:rank=R:step=S.*when=join"):
        parse_fault("kill:rank=1:at=3")


def test_the_injector_gives_each_world_its_pending_faults_and_drops_those_that_fired():
    from raymesh.testing import fail
    from raymesh.train.injector import FaultInjector

    injector = FaultInjector([kill(rank=1, at_step=5), fail(rank=0, at_step=9, when="join")])
    first = injector.for_world(1, rejoin=False)
    assert first is not None and [str(f) for f in first.faults] == ["kill:rank=1:step=5"]
    injector.on_lost([1], 5)  # rank 1 was lost with step 5 in flight: its kill fired
    assert injector.for_world(5, rejoin=True) is None
    joining = injector.for_world(9, rejoin=True)
    assert joining is not None and [f.when for f in joining.faults] == ["join"]
    assert injector.for_world(9, rejoin=True) is None  # a join fault fires in one world only


def test_a_slow_rank_hook_stretches_only_its_rank_from_its_step(monkeypatch):
    from raymesh.train import injector

    slept: list[float] = []
    monkeypatch.setattr(injector.time, "sleep", slept.append)
    hooks = injector.RankFaults((slow(rank=1, factor=3.0, at_step=2),))
    hooks.in_step(0, 5, 0.05)  # another rank
    hooks.in_step(1, 1, 0.05)  # before its step
    assert slept == []
    hooks.in_step(1, 2, 0.05)
    assert slept == [pytest.approx(0.1)]  # (3 - 1) x its own compute time
