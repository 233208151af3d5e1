"""Unit tests for `raymesh.testing.faults`: faults as data and their CLI syntax."""

from __future__ import annotations

import pytest

from raymesh.testing import kill, slow
from raymesh.testing.faults import Fault, parse_fault


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
    ],
)
def test_bad_faults_name_the_field(kwargs, match):
    base = {"kind": "kill", "rank": 0, "at_step": 1}
    with pytest.raises(ValueError, match=match):
        Fault(**{**base, **kwargs})


def test_bad_cli_syntax_shows_the_form():
    with pytest.raises(ValueError, match=r"use kind:rank=R:step=S.*when=join"):
        parse_fault("kill:rank=1:at=3")
