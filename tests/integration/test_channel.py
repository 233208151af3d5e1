"""Channels: small messages to procs on the caller's host go over a Unix socket, the rest through
Ray, and the guarantees (order, supervision, large buffers in the object store) hold across both."""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import secrets
import signal
import stat
import sys
import tempfile
import threading
import uuid

import pytest
import torch
import zmq

from raymesh import ActorError, SupervisionError, this_host
from raymesh._src import backend
from raymesh._src.backend import channel, channel_auth, channel_sockets

from ..waiting import wait_for
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
    monkeypatch.setenv("RAYMESH_CHANNELS", "maybe")
    with pytest.raises(ValueError, match="RAYMESH_CHANNELS='maybe'"):
        counters.incr.call(1)


def test_sockets_live_in_a_directory_only_this_user_can_enter(procs):
    path = channel_sockets.socket_dir()
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


class _WritesAFile:
    """A pickle that, were it ever unpickled, would create `path`: what a foreign process
    could send a channel to run code in the proc."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _raw(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def test_frames_from_a_foreign_process_are_never_unpickled_and_the_channel_keeps_working(
    procs, tmp_path
):
    rec = procs.slice(procs=0).spawn("foreign", Recorder)
    rec.add.call_one(0).get(timeout=30)
    address = procs._state.procs[0].channel
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(_WritesAFile(str(marker)))
    reply_to = f"ipc://{channel_sockets.socket_dir()}/test-{uuid.uuid4().hex[:12]}.sock"
    replies = _raw(zmq.PULL, reply_to)
    sender = _raw(zmq.PUSH, address)
    try:
        here = reply_to.encode()
        sender.send_multipart([here, b"1", evil, evil])  # the frame as it was, with no MAC
        sender.send_multipart([b"\0" * 32, here, b"2", evil, evil])  # a wrong MAC
        sender.send_multipart([evil])  # a part alone
        other = secrets.token_bytes(32)  # another cluster's key
        foreign = channel_auth.Mac(other)
        sender.send_multipart(
            channel_auth.signed(foreign, channel_auth.REQUEST, [here, b"3", evil, evil])
        )
        # Then a frame with this cluster's key, on the same connection (read after the others):
        # its header is no message, so the proc answers with the failure.
        mac = channel_auth.Mac(channel_auth.runtime_key())
        parts = [here, b"4", pickle.dumps(("no", "header")), pickle.dumps(((), {}))]
        sender.send_multipart(channel_auth.signed(mac, channel_auth.REQUEST, parts))
        answered = []  # the msgids answered: only the last frame's, where all is well
        while b"4" not in answered:
            assert replies.poll(30_000), "the proc did not answer a frame with the cluster's key"
            answered.append(
                channel_auth.verified(mac, channel_auth.REPLY, replies.recv_multipart(), 3)[0]
            )
    finally:
        sender.close(0)
        replies.close(0)
        channel_sockets.unlink(reply_to)
    assert not marker.exists()
    assert answered == [b"4"]
    future = rec.add.call_one(1)
    assert _took_channel(future)
    future.get(timeout=30)
    assert rec.log.call_one().get(timeout=30) == [0, 1]
    assert not marker.exists()


def test_a_forged_reply_is_never_unpickled_and_the_real_one_arrives(procs, tmp_path, caplog):
    counter = procs.slice(procs=1).spawn("forged", Counter)
    go = tmp_path / "go"
    pending = counter.wait_for.call_one(str(go), 60.0)
    assert _took_channel(pending)
    client = channel.client()
    address = procs._state.procs[1].channel.encode()
    [msgid] = [m for m, p in client._pending.items() if p.address == address]
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(_WritesAFile(str(marker)))
    dropped = client.drops.count
    forger = _raw(zmq.PUSH, client._reply_to)
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        try:
            forger.send_multipart([msgid, channel.VALUE, evil])
            forger.send_multipart([b"\0" * 32, msgid, channel.VALUE, evil])
            forger.send_multipart([secrets.token_bytes(32), msgid, channel.FETCH, b""])
            wait_for(lambda: client.drops.count == dropped + 3, 30, what="3 forged replies dropped")
        finally:
            forger.close(0)
        go.touch()
        assert pending.get(timeout=30) == 0  # the proc's own reply (its rank), still awaited
    assert not marker.exists()
    # Three are one line in the log (the first; then at most one a minute), not one each.
    lines = [r for r in caplog.records if "without this Ray cluster's channel key" in r.message]
    assert len(lines) == (0 if dropped else 1), caplog.text


def test_a_frames_mac_is_hmac_sha256_of_its_kind_lengths_and_parts():
    large = b"y" * (channel_auth.JOIN_BELOW + 1)  # hashed in place, not joined
    for key in (secrets.token_bytes(32), secrets.token_bytes(100)):
        for parts in ([b"a", b"", b"bc"], [b"r", b"m", b"h", b"d"], [b"r", b"m", b"h", large]):
            lengths = b"".join(len(p).to_bytes(8, "little") for p in parts)
            message = channel_auth.REQUEST + lengths + b"".join(parts)
            expected = hmac.digest(key, message, "sha256")
            assert channel_auth.Mac(key)(channel_auth.REQUEST, parts) == expected
    # Moving a byte from one part to the next, or a message taken for a reply: another MAC.
    mac = channel_auth.Mac(b"k" * 32)
    assert mac(channel_auth.REQUEST, [b"ab", b"c", b""]) != mac(
        channel_auth.REQUEST, [b"a", b"bc", b""]
    )
    assert mac(channel_auth.REQUEST, [b"a", b"", b""]) != mac(channel_auth.REPLY, [b"a", b"", b""])


def test_a_symlinked_or_open_socket_directory_is_refused(tmp_path, monkeypatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    made = channel_sockets.socket_dir()  # made there, private to this user
    assert made == str(runtime / "raymesh")
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    os.rmdir(made)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, made)
    with pytest.raises(PermissionError, match=r"raymesh is a symbolic link .* remove it"):
        channel_sockets.socket_dir()
    os.unlink(made)
    os.mkdir(made)
    for mode in (0o777, 0o750, 0o701):
        os.chmod(made, mode)
        with pytest.raises(PermissionError, match=f"has mode {mode:04o}: its group or others"):
            channel_sockets.socket_dir()
    # A runtime directory others may write to is not used: the temp dir's is.
    os.chmod(runtime, 0o777)
    assert channel_sockets.socket_dir() == os.path.join(
        tempfile.gettempdir(), f"raymesh-{os.getuid()}"
    )
