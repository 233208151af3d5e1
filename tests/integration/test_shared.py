"""`Shared`: a value stored once and passed by reference, from the controller or from an
actor, to any number of calls on any meshes; each endpoint receives the value itself, read in
place from the one stored copy."""

from __future__ import annotations

import pytest
import torch

from raymesh import Actor, Shared, endpoint, this_host

from .actors import _mapping_of

pytestmark = pytest.mark.usefixtures("ray_cluster")


class Maker(Actor):
    @endpoint
    def make(self, n: int) -> tuple[int, Shared[dict[str, torch.Tensor]]]:
        return n, Shared({"w": torch.arange(n, dtype=torch.float32)})


def _place(t: torch.Tensor) -> tuple:
    """Where this process holds `t`'s data: the file it maps, the byte of it, and whether the
    mapping is shared with other processes."""
    where = _mapping_of(t.data_ptr())
    return (tuple(where["file"]), where["byte"], where["shared"])


class Reader(Actor):
    @endpoint
    def read(self, version: int, state: dict, more: list, named: dict) -> tuple[list, list]:
        # Each Shared arrived as its value: top level, in a list, in a dict.
        assert isinstance(state, dict) and isinstance(more[1], torch.Tensor)
        assert isinstance(named["s"], str)
        got = [version, float(state["w"].sum()), float(more[1].sum()), named["s"], more[0]]
        return got, [_place(state["w"]), _place(more[1])]


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
        replies = [c.get(timeout=60) for c in calls]
        assert [got for got, _ in replies] == [want, want]
        back = shared.get(timeout=30)["w"]
        assert torch.equal(back, torch.arange(1000, dtype=torch.float32))
        # Stored once, not copied by value into each call: the two calls' readers (two
        # processes) and the caller read each value in place from the same bytes of the same
        # shared file, the object store's. A value sent with each call would lie in each
        # process's own memory.
        [[theirs, mine_at], [theirs2, mine_at2]] = [places for _, places in replies]
        assert theirs == theirs2 == _place(back), (theirs, theirs2, _place(back))
        assert mine_at == mine_at2 != theirs, (mine_at, mine_at2)
        assert all(shared_map and file[1] != 0 for file, _, shared_map in (theirs, mine_at))
    finally:
        for procs in (makers, *readers):
            procs.stop().get(timeout=60)
