"""`RDMABuffer` without Ray: bad input refused before any byte moves, copies within a process,
and the one-sided path against a real second process (a `multiprocessing` child lends a tensor,
this process reads and writes it through the kernel, drops it, and sees it SIGKILLed)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from raymesh import SupervisionError
from raymesh.rdma import BufferDropped, BufferOwnerGone, RDMABuffer


def test_bad_tensors_are_refused_naming_the_argument_and_the_fix_before_any_byte_moves():
    with pytest.raises(TypeError, match=r"RDMABuffer\(data\): expected a torch.Tensor, got list"):
        RDMABuffer([1, 2, 3])
    with pytest.raises(ValueError, match=r"not contiguous.*data.contiguous\(\)"):
        RDMABuffer(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="empty"):
        RDMABuffer(torch.zeros(0))
    src = torch.arange(8, dtype=torch.float32)
    buf = RDMABuffer(src)
    assert buf.size() == 32 and buf.backend == "local"
    dst = torch.full((8,), -1.0)
    cases = [
        (
            torch.zeros(8, dtype=torch.float16),
            TypeError,
            r"the tensor.s dtype is torch.float16 .*float32 tensor, or a byte view",
        ),
        (torch.zeros(7), ValueError, r"the tensor holds 28 bytes .* at least 32 bytes"),
        (torch.zeros(8, 2)[:, 0], ValueError, r"the tensor .* is not contiguous"),
        ("dst", TypeError, "expected a torch.Tensor, got str"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=r"read_into\(dst\): " + match):
            buf.read_into(bad)
    with pytest.raises(ValueError, match=r"write_from\(src\): .* holds 36 bytes .* at most 32"):
        buf.write_from(torch.zeros(9))
    with pytest.raises(ValueError, match=r"timeout=0\): pass a positive number"):
        buf.read_into(dst, timeout=0)
    assert torch.equal(dst, torch.full((8,), -1.0))  # nothing moved
    # A byte view reads any buffer (Monarch's form); a larger tensor takes the first bytes.
    raw = torch.zeros(40, dtype=torch.uint8)
    buf.read_into(raw).get(timeout=10)
    assert torch.equal(raw[:32].view(torch.float32), src) and not raw[32:].any()
    buf.write_from(torch.tensor([9.0, 9.0])).get(timeout=10)
    assert src.tolist() == [9.0, 9.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    buf.drop().get(timeout=10)
    with pytest.raises(BufferDropped):
        buf.read_into(dst).get(timeout=10)


def _lend(queue: mp.Queue, n: int) -> None:
    t = torch.arange(n, dtype=torch.int64)
    bufs = [RDMABuffer(t), RDMABuffer(t[: n // 2])]  # the second: a view, from its own offset
    queue.put(bufs)
    queue.get()  # hold the tensors until the test is done with them (or kills this process)


def test_another_process_is_read_and_written_one_sided_and_its_death_is_a_typed_error():
    ctx = mp.get_context("spawn")
    to_child = ctx.Queue()
    n = 3 << 20  # 24 MiB of int64: a few chunks of the kernel's copy
    child = ctx.Process(target=_lend, args=(to_child, n), daemon=True)
    child.start()
    try:
        whole, half = to_child.get(timeout=60)
        assert whole.backend == "process_vm" and whole.owner == "controller,root[0]"
        dst = torch.zeros(n, dtype=torch.int64)
        whole.read_into(dst).get(timeout=30)
        assert torch.equal(dst, torch.arange(n))
        half.write_from(torch.full((4,), -5, dtype=torch.int64)).get(timeout=30)
        whole.read_into(dst).get(timeout=30)
        assert dst[:5].tolist() == [-5, -5, -5, -5, 4]  # the write landed in the child's tensor
        half.drop().get(timeout=30)  # one-sided: the child's token cell, zeroed from here
        with pytest.raises(BufferDropped):
            half.read_into(dst).get(timeout=30)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        with pytest.raises(BufferOwnerGone, match="is gone") as gone:
            whole.read_into(dst).get(timeout=30)
        assert isinstance(gone.value, SupervisionError) and gone.value.failure.kind == "proc_died"
    finally:
        child.kill()
