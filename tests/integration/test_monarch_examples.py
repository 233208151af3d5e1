"""Monarch's docs examples, as raymesh runs them (examples/monarch/): each runs as a script of
its own, on its own embedded local Ray, and must finish and print what Monarch's does.

They spawn `gpus` axes, which reserve one GPU per proc in raymesh: the scripts run with logical
GPUs (RAY_OVERRIDE_RESOURCES), as their docstrings say for a laptop. GPU procs start cold (no
warm pool), so each example takes a few seconds per proc on a small machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import raymesh.actor as api

from ..scripts import run_python

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "monarch"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYMESH_ADDRESS")}
    env["RAY_OVERRIDE_RESOURCES"] = '{"GPU": 16}'  # logical GPUs for the `gpus` axes
    env["RAYMESH_WARM_PROCS"] = "0"  # GPU procs never come from the pool
    env["RAY_DEDUP_LOGS"] = "0"  # every proc's line, not "[repeated 3x across cluster]"
    return env


def _lacking_for_getting_started() -> list[str]:
    """The names getting_started.py uses that raymesh does not have (yet)."""
    lacking = [name for name in ("hosts_from_config", "Channel") if not hasattr(api, name)]
    attributes = [
        (api.HostMesh, "extent"),
        (api.ProcMesh, "extent"),
        (api.ProcMesh, "logging_option"),
        (api.ActorContext, "actor_instance"),
    ]
    lacking += [f"{cls.__name__}.{a}" for cls, a in attributes if not hasattr(cls, a)]
    return lacking


@pytest.mark.timeout(300)
def test_the_ping_pong_example_runs_with_only_its_imports_changed():
    out = run_python([str(EXAMPLES / "ping_pong.py")], _env(), timeout=280)
    assert "Example completed successfully!" in out.splitlines()
    # the actors' prints reach the script's stdout (forwarded by Ray, prefixed by proc; some
    # after the script's own last line)
    assert "Identity: " in out and "msg='hey there, from script!!'" in out
    assert "Pong!, Receiver (actor_1:" in out  # (actor_0's come last: not waited for)


@pytest.mark.timeout(300)
def test_the_getting_started_example_runs_with_only_its_imports_changed():
    lacking = _lacking_for_getting_started()
    if lacking:
        pytest.skip(f"examples/monarch/getting_started.py needs what raymesh lacks: {lacking}")
    out = run_python([str(EXAMPLES / "getting_started.py")], _env(), timeout=280)
    assert "Counter value: 0" in out
    assert "Trainer " in out and " taking a step." in out
    assert "Step with data <fake data 1> and input = None" in out
    assert "It didn't say hello" in out
    assert "Actor rank: " in out
