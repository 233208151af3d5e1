"""The controller's unhandled-fault hook is the public modules' attribute, read and assigned
(Monarch's programs assign `monarch.actor.unhandled_fault_hook = fn`); the integration tests
of test_monarch_semantics.py replace it this way and see real failures reach it."""

from __future__ import annotations

import pytest

import raymesh
import raymesh.actor
from raymesh._src import supervision


@pytest.fixture(autouse=True)
def _default_hook():
    yield
    raymesh.set_unhandled_fault_hook(None)


def hook(failure: object) -> None:
    pass


@pytest.mark.timeout(10)
@pytest.mark.parametrize("front", [raymesh.actor, raymesh], ids=["raymesh.actor", "raymesh"])
def test_assigning_the_attribute_replaces_the_hook_that_supervision_runs(front):
    assert front.unhandled_fault_hook is supervision.default_unhandled_fault_hook
    front.unhandled_fault_hook = hook
    assert supervision._hook is hook
    assert raymesh.unhandled_fault_hook is hook and raymesh.actor.unhandled_fault_hook is hook
    assert "unhandled_fault_hook" in dir(front)


@pytest.mark.timeout(10)
def test_putting_back_the_saved_hook_restores_it_and_none_restores_the_default():
    raymesh.set_unhandled_fault_hook(hook)
    saved = raymesh.actor.unhandled_fault_hook
    raymesh.actor.unhandled_fault_hook = print
    raymesh.actor.unhandled_fault_hook = saved
    assert supervision._hook is hook
    raymesh.actor.unhandled_fault_hook = None
    assert supervision._hook is supervision.default_unhandled_fault_hook
