"""Channels: small messages to procs on the caller's host go over a Unix socket, the rest through
Ray, and the guarantees (order, supervision, large buffers in the object store) hold across both."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading

import pytest
import torch

from raymesh import ActorError, SupervisionError, this_host
from raymesh._src import backend
from raymesh._src.backend import channel

from .actors import Counter, Recorder, TensorActor

pytestmark = pytest.mark.usefixtures("ray_cluster")

LARGE = 2 << 20  # bytes: over the 1 MiB line, so the payload goes through the object store


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="chan")
    yield procs
    procs.stop()


def _took_channel(future) -> bool:
    return not any(backend.is_ref(item) for item in future._items)


def test_small_messages_take_the_channel_and_large_ones_ray(procs):
    actors = procs.spawn("paths", TensorActor)
    one = actors.slice(procs=0)
    small = one.checksum.call_one(torch.ones(8))
    large = one.checksum.call_one(torch.ones(LARGE // 4))
    assert _took_channel(small) and not _took_channel(large)
    assert small.get(timeout=30) == 8.0
    assert large.get(timeout=30) == LARGE // 4


def test_one_callers_order_holds_across_both_paths(procs):
    rec = procs.slice(procs=1).spawn("mixed", Recorder)
    for i in range(40):
        rec.add.broadcast(bytes([i % 256]) * LARGE if i % 3 == 0 else i)
    log = rec.log.call_one().get(timeout=60)
    assert [x[0] if isinstance(x, bytes) else x for x in log] == list(range(40))
    assert all(len(x) == LARGE for x in log if isinstance(x, bytes))


def test_a_large_reply_to_a_small_call_arrives_intact(procs):
    actors = procs.spawn("maker", TensorActor)
    call = actors.make.call(LARGE // 4)  # a small call whose replies are 2 MiB each
    assert _took_channel(call)
    for _, t in call.get(timeout=60).items():
        assert torch.equal(t, torch.arange(LARGE // 4, dtype=torch.float32))


def test_a_message_the_proc_cannot_unpickle_is_an_actor_error_and_the_proc_lives(
    procs, tmp_path, monkeypatch
):
    # A class importable here but not in the proc: pickled by reference, it fails on arrival.
    (tmp_path / "only_here.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here  # type: ignore[import-not-found]

    try:
        rec = procs.slice(procs=0).spawn("unpicklable", Recorder)
        future = rec.add.call_one(only_here.Thing())
        assert _took_channel(future)
        with pytest.raises(ActorError, match="only_here"):
            future.get(timeout=30)
        rec.add.call_one(1).get(timeout=30)
        assert rec.log.call_one().get(timeout=30) == [1]
    finally:
        sys.modules.pop("only_here", None)


def test_sigkill_fails_a_pending_channel_call_and_every_later_one():
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="chan-victim")
    counter = procs.spawn("c", Counter)
    pending = counter.slow.call_one(60.0)
    assert _took_channel(pending)
    os.kill(procs.pids[0], signal.SIGKILL)
    with pytest.raises(SupervisionError, match="SIGKILL"):
        pending.get(timeout=30)
    with pytest.raises(SupervisionError, match="SIGKILL"):
        counter.get.call_one().get(timeout=30)
    procs.stop()


def test_channels_off_sends_every_message_through_ray(procs, monkeypatch):
    counters = procs.spawn("off", Counter)
    monkeypatch.setenv("RAYMESH_CHANNELS", "0")
    call = counters.incr.call(2)
    assert not _took_channel(call)
    assert call.get(timeout=30).values() == [2, 2]
    monkeypatch.setenv("RAYMESH_CHANNELS", "yes")
    with pytest.raises(ValueError, match="RAYMESH_CHANNELS='yes'"):
        counters.incr.call(1)


def test_sockets_live_in_a_directory_only_this_user_can_enter(procs):
    path = channel.socket_dir()
    info = os.stat(path)
    assert info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) == 0o700
    # named after the process and unique to it (pids wrap; a caller remembers dead procs)
    assert any(name.startswith(f"proc-{procs.pids[0]}-") for name in os.listdir(path))


def test_messages_sent_by_a_thread_that_ends_at_once_are_not_lost(procs):
    # Each thread sends on sockets of its own, closed when it ends: possibly before their
    # connection is even up. What they queued must still arrive.
    rec = procs.slice(procs=0).spawn("short-lived", Recorder)
    for i in range(30):
        t = threading.Thread(target=rec.add.broadcast, args=(i,))
        t.start()
        t.join()
    assert rec.log.call_one().get(timeout=60) == list(range(30))
