"""`raymesh.rdma.RDMABuffer` between procs: the handle travels in a message, the bytes move
without the owner actor's participation (one-sided through the kernel, or served by the owner's
proc), a dropped buffer and a SIGKILLed owner fail copies with typed errors, and CUDA tensors
stay on their device."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from raymesh import Actor, SupervisionError, endpoint, this_host
from raymesh.rdma import BufferDropped, BufferOwnerGone, RDMABuffer

pytestmark = pytest.mark.usefixtures("ray_cluster")

N = 1 << 20  # float32s: 4 MiB


class Owner(Actor):
    @endpoint
    def lend(self, n: int, device: str = "cpu") -> RDMABuffer:
        self.t = torch.arange(n, dtype=torch.float32, device=device)
        return RDMABuffer(self.t)

    @endpoint
    def busy(self, until: str) -> None:
        """Hold the actor's only thread until the file `until` exists: copies go on without it."""
        deadline = time.monotonic() + 120
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.05)

    @endpoint
    def head(self) -> list[float]:
        return self.t[:3].tolist()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Reader(Actor):
    @endpoint
    def copy(self, buf: RDMABuffer, n: int, one_sided: bool) -> tuple[str, float, float]:
        os.environ["RAYMESH_RDMA_ONE_SIDED"] = "1" if one_sided else "0"
        dst = torch.zeros(n, dtype=torch.float32)
        buf.read_into(dst).get(timeout=60)
        buf.write_from(torch.tensor([-1.0 if one_sided else -2.0])).get(timeout=60)
        return buf.backend, float(dst[0]), float(dst[1:].double().sum())

    @endpoint
    def read(self, buf: RDMABuffer, n: int) -> str:
        """The error a read raises, by type and message."""
        os.environ["RAYMESH_RDMA_ONE_SIDED"] = "1"
        try:
            buf.read_into(torch.zeros(n)).get(timeout=60)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "read"


def _spawn(name: str) -> tuple:
    procs = this_host().spawn_procs(per_host={"procs": 2}, name=name, escalate=False)
    return procs, procs.slice(procs=0).spawn("o", Owner), procs.slice(procs=1).spawn("r", Reader)


def test_a_buffer_is_read_and_written_by_other_procs_while_its_owner_actor_is_busy(
    monkeypatch, tmp_path
):
    procs, owner, reader = _spawn("rdma")
    release = tmp_path / "release"
    try:
        buf = owner.lend.call_one(N).get(timeout=60)
        busy = owner.busy.call_one(str(release))  # the owner actor's thread is taken from here on
        rest = float(torch.arange(N, dtype=torch.float64).sum())
        # One-sided through the kernel, then served by the owner's proc: each reads the bytes
        # and writes its mark into the owner's tensor, while the owner's endpoint runs.
        assert reader.copy.call_one(buf, N, True).get(timeout=60) == ("process_vm", 0.0, rest)
        assert reader.copy.call_one(buf, N, False).get(timeout=60) == ("object_store", -1.0, rest)
        for one_sided, route in (("1", "process_vm"), ("0", "object_store")):
            monkeypatch.setenv("RAYMESH_RDMA_ONE_SIDED", one_sided)
            dst = torch.zeros(N)
            buf.read_into(dst).get(timeout=60)
            assert buf.backend == route and dst[0] == -2.0 and dst[-1] == N - 1
        assert not busy.done()
        buf.drop().get(timeout=60)  # through the owner's proc, which the owner actor never sees
        assert "BufferDropped" in reader.read.call_one(buf, N).get(timeout=60)
        with pytest.raises(BufferDropped):
            buf.read_into(torch.zeros(N)).get(timeout=60)
        assert not busy.done()
    finally:
        release.touch()
        procs.stop().get(timeout=60)


def test_reads_of_a_buffer_whose_owner_was_sigkilled_raise_buffer_owner_gone(monkeypatch):
    procs, owner, reader = _spawn("rdma-kill")
    try:
        buf = owner.lend.call_one(N).get(timeout=60)
        os.kill(owner.pid.call_one().get(timeout=60), signal.SIGKILL)
        # One-sided (the reader proc: the kernel says the process is gone) ...
        said = reader.read.call_one(buf, N).get(timeout=60)
        assert said.startswith("BufferOwnerGone: MeshFailure(mesh_name=rdma-kill"), said
        # ... and through the owner's proc (Ray reports it dead): bounded, typed, never a hang.
        monkeypatch.setenv("RAYMESH_RDMA_ONE_SIDED", "0")
        with pytest.raises(BufferOwnerGone, match="is gone") as gone:
            buf.read_into(torch.zeros(N)).get(timeout=60)
        assert isinstance(gone.value, SupervisionError)
        assert gone.value.failure.kind == "proc_died" and gone.value.failure.ranks == (0,)
    finally:
        procs.stop().get(timeout=60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_buffer_is_read_and_written_on_device():
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="rdma-gpu", escalate=False)
    try:
        owner = procs.spawn("o", Owner)
        buf = owner.lend.call_one(N, "cuda").get(timeout=120)
        assert buf.backend == "object_store"  # a GPU tensor: the owner's proc stages it
        dst = torch.zeros(N, device="cuda")
        buf.read_into(dst).get(timeout=60)
        assert dst.is_cuda and torch.equal(dst.cpu(), torch.arange(N, dtype=torch.float32))
        buf.write_from(torch.tensor([7.0, 8.0], device="cuda")).get(timeout=60)
        assert owner.head.call_one().get(timeout=60) == [7.0, 8.0, 2.0]
        # A CPU buffer read into a CUDA tensor (one-sided, then onto the device).
        cpu = RDMABuffer(torch.arange(N, dtype=torch.float32))
        cpu.read_into(dst).get(timeout=60)
        assert dst.is_cuda and float(dst[-1]) == N - 1
    finally:
        procs.stop().get(timeout=60)
