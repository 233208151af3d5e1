"""How a job's first world is asked for: `launch.first_ranks` against a cluster whose room is
scripted (the placer and the rank pool are plain stand-ins: no procs start)."""

from __future__ import annotations

from raymesh import train
from raymesh.train.control.launch import first_ranks
from raymesh.train.sections import ScalingConfig


class Placer:
    """A cluster with `free` places now, `capacity` at most; counts the looks."""

    def __init__(self, free: int, capacity: int) -> None:
        self.free, self.most, self.looks = free, capacity, 0

    def capacity(self) -> int:
        return self.most

    def place(self, n: int) -> list[str]:
        self.looks += 1
        return ["node"] * min(n, self.free)


class Pool:
    def take_warm(self, n: int) -> list[str]:
        return []

    def spawn(self, n: int, name: str, nodes: list[str]) -> list[str]:
        return [f"{name}-{i}" for i in range(n)]


def _scaling() -> ScalingConfig:
    return train.TrainConfig(workers=(2, 8), global_batch_size=8, replace_timeout_s=1.0).scaling


def test_an_elastic_job_on_a_cluster_too_small_for_max_starts_with_what_fits_at_once():
    placer = Placer(free=4, capacity=4)
    ranks = first_ranks(_scaling(), Pool(), placer)  # type: ignore[arg-type]
    assert len(ranks) == 4 and placer.looks == 1  # no second look: the room cannot grow


def test_room_that_can_still_grow_is_asked_for_again_until_the_deadline():
    placer = Placer(free=4, capacity=8)  # another job still holds 4 (or just released them)
    ranks = first_ranks(_scaling(), Pool(), placer)  # type: ignore[arg-type]
    assert len(ranks) == 4 and placer.looks > 1
