"""`Shared`: a value stored once and passed by reference, from the controller or from an
actor, to any number of calls on any meshes; each endpoint receives the value itself."""

from __future__ import annotations

import pytest
import torch

from raymesh import Actor, Shared, endpoint, this_host

pytestmark = pytest.mark.usefixtures("ray_cluster")


class Maker(Actor):
    @endpoint
    def make(self, n: int) -> tuple[int, Shared[dict[str, torch.Tensor]]]:
        return n, Shared({"w": torch.arange(n, dtype=torch.float32)})


class Reader(Actor):
    @endpoint
    def read(self, version: int, state: dict, more: list, named: dict) -> list:
        # Each Shared arrived as its value: top level, in a list, in a dict.
        assert isinstance(state, dict) and isinstance(more[1], torch.Tensor)
        assert isinstance(named["s"], str)
        return [version, float(state["w"].sum()), float(more[1].sum()), named["s"], more[0]]


def test_a_value_shared_by_an_actor_reaches_other_meshes_as_itself_and_the_caller_as_a_reference():
    makers = this_host().spawn_procs(per_host={"procs": 1}, name="maker")
    readers = [this_host().spawn_procs(per_host={"procs": 1}, name=f"reader{i}") for i in (0, 1)]
    try:
        maker = makers.spawn("m", Maker)
        version, shared = maker.make.call_one(1000).get(timeout=60)
        assert version == 1000 and isinstance(shared, Shared)  # a reference, not the value
        mine = Shared(torch.ones(5))
        note = Shared("from the controller")
        calls = [
            procs.spawn("r", Reader).read.call_one(version, shared, ["x", mine], {"s": note})
            for procs in readers
        ]
        want = [1000, float(sum(range(1000))), 5.0, "from the controller", "x"]
        assert [c.get(timeout=60) for c in calls] == [want, want]
        assert torch.equal(shared.get(timeout=30)["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        for procs in (makers, *readers):
            procs.stop().get(timeout=60)
