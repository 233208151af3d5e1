"""Failure detection is pure: the lost ranks follow from the ranks' outcomes and statuses."""

from __future__ import annotations

import threading

import pytest

from raymesh.actor import ActorError, MeshFailure, SupervisionError
from raymesh.train.control.detection import describe, failed, find_lost, settle, settle_behind
from raymesh.train.protocol import ChunkResult, LostRank, RankStatus

pytestmark = pytest.mark.timeout(30)


def ok(done: int) -> ChunkResult:
    return ChunkResult((), done)


def peer(done: int) -> ChunkResult:
    return ChunkResult((), done, error="gloo: Connection closed by peer", cause="peer")


def status(step: int, phase: str, index: int) -> RankStatus:
    return RankStatus(step=step, phase=phase, phase_index=index, for_s=1.0, pid=1)


def died() -> SupervisionError:
    return SupervisionError(MeshFailure("trainer-1", (0,), "proc_died", "killed by SIGKILL"))


def test_a_dead_rank_is_lost_and_the_step_in_flight_is_one_past_the_survivors():
    lost, started = find_lost([peer(4), died()], [status(5, "backward", 3), died()], start=4)
    assert lost == [LostRank(1, "died", "killed by SIGKILL")] and started == 5


def test_a_rank_whose_step_raised_is_lost_and_its_peers_are_not():
    own = ChunkResult((), 2, error="InjectedFault: boom", cause="own")
    lost, started = find_lost([own, peer(2)], [status(3, "start", 1)] * 2, start=2)
    assert lost == [LostRank(0, "error", "InjectedFault: boom")] and started == 3


def test_an_endpoint_that_raised_is_an_error_rank():
    error = ActorError(
        mesh_name="m",
        rank=0,
        endpoint="run",
        remote_type="ValueError",
        remote_message="bad",
        remote_traceback="",
    )
    lost, _ = find_lost([ok(3), error], [status(3, "done", 5)] * 2, start=2)
    assert lost == [LostRank(1, "error", "ValueError: bad")]


def test_ranks_still_blocked_after_a_peer_died_are_stuck_not_hung():
    timeout = TimeoutError("no reply")
    lost, _ = find_lost([died(), timeout], [died(), status(4, "backward", 3)], start=3)
    assert [(x.rank, x.kind) for x in lost] == [(0, "died"), (1, "stuck")]


def test_with_nobody_dead_the_rank_behind_the_others_is_hung_and_they_are_waiting():
    timeout = TimeoutError("no reply")
    statuses = [status(7, "backward", 3), status(7, "forward", 2), status(7, "backward", 3)]
    lost, started = find_lost([timeout] * 3, statuses, start=6)
    assert lost == [LostRank(1, "hung", "no progress past step 7 for the step timeout")]
    assert started == 7


def test_a_rank_that_reported_a_peer_failure_and_then_died_is_lost_by_its_monitor():
    lost, _ = find_lost([peer(3), peer(3)], [status(4, "start", 1), died()], start=3)
    assert lost == [LostRank(1, "died", "killed by SIGKILL")]


class Pending:
    """A reply that never comes, honouring the timeout it is given as a real one does: `get`
    blocks for `timeout` seconds and raises TimeoutError. Asked to wait with no timeout it
    would block forever: it fails the test instead, so a detection that waits forever (or on
    a timeout of its own, past the one it was given: the test's timeout) cannot pass."""

    def done(self) -> bool:
        return False

    def get(self, timeout: float | None = None) -> None:
        assert timeout is not None, "get() without a timeout: a hung rank would block it forever"
        threading.Event().wait(timeout)  # never set: the reply never comes
        raise TimeoutError


class Answered:
    def __init__(self, value: ChunkResult) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def get(self, timeout: float | None = None) -> ChunkResult:
        return self.value


# A timeout or grace far above this module's test timeout (30 s): a settle that waited it out
# (ignoring the shorter one it was given) fails the test.
NEVER_S = 600.0


def test_settle_gives_the_others_only_the_grace_once_one_failed():
    out = settle([Answered(peer(1)), Pending()], timeout=NEVER_S, grace=0.2)
    assert failed(out[0]) and isinstance(out[1], TimeoutError)
    assert describe(out) == ("rank 1 did not answer in time; rank 0 saw its peer go")


def test_settle_waits_no_longer_than_its_timeout_when_no_rank_failed():
    out = settle([Answered(ok(2)), Pending()], timeout=0.3, grace=NEVER_S)
    assert out[0] == ok(2) and isinstance(out[1], TimeoutError)


def test_a_chunk_behind_the_failed_one_is_waited_for_only_on_the_ranks_that_answered_that_one():
    timeout = TimeoutError("no reply")
    behind = [Answered(peer(8)), Pending(), Answered(peer(8)), Pending()]
    out = settle_behind(behind, [ok(8), timeout, died(), ok(8)], timeout=0.3)
    # rank 1 never reached it: no wait; rank 3 answered the failed chunk but not this one
    assert [type(r).__name__ for r in out] == [
        "ChunkResult",
        "TimeoutError",
        "ChunkResult",
        "TimeoutError",
    ]


def test_the_step_in_flight_counts_the_chunks_queued_behind_the_failed_one():
    # Rank 0's reply to chunk [4, 6) was lost with it; rank 1 went on to step 7 in the next
    # chunk and failed in step 8, where rank 0 died.
    lost, started = find_lost(
        [died(), ok(6)], [died(), status(8, "backward", 3)], start=4, later=[[died(), peer(7)]]
    )
    assert lost == [LostRank(0, "died", "killed by SIGKILL")] and started == 8


def test_a_survivor_still_blocked_in_a_chunk_queued_behind_the_failed_one_is_stuck():
    # HSDP, 2x2, rank 1 killed at the start of a chunk: its reply to the chunk before was lost
    # with it, so that earlier chunk is the failed one, and ranks 0, 2, 3 answered it. In the
    # chunk queued behind it, ranks 0 and 2 (rank 1's shard and replica peers) fail, while
    # rank 3 stays blocked in a collective with them (FSDP2 keeps its groups' sockets open):
    # it answers no later call (its setup for the new world would queue behind the blocked
    # chunk), so it is replaced too. Left in place, the new world waited for it for timeout_s.
    timeout = TimeoutError("no reply")
    lost, started = find_lost(
        [ok(8), died(), ok(8), ok(8)],
        [status(9, "start", 1), died(), status(9, "start", 1), status(9, "backward", 3)],
        start=6,
        later=[[peer(8), died(), peer(8), timeout]],
    )
    assert [(x.rank, x.kind) for x in lost] == [(1, "died"), (3, "stuck")]
    assert started == 9
