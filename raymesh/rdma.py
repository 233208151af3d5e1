"""One-sided tensor buffers with Monarch's names (`monarch.rdma`): a process lends a tensor's
bytes as an `RDMABuffer`, a small handle that travels in ordinary messages, and whoever holds it
copies the bytes with `read_into` / `write_from` without the owner's participation.

    from raymesh.rdma import RDMABuffer

    class ParameterServer(Actor):
        def __init__(self):
            self.weights = torch.rand(1000, 1000)
            self.buffer = RDMABuffer(self.weights)

        @endpoint
        def weights_buffer(self) -> RDMABuffer:
            return self.buffer  # a small message: the handle, not the bytes

    # in another actor:
    buf = server.weights_buffer.call_one().get()
    buf.read_into(self.local_weights).get()  # the bytes, copied without the server's help

On one host the kernel copies between the two processes' memories (`process_vm_readv`); from
another host, or for a GPU tensor, the owner's proc serves the copy through Ray's object store.
docs/programming-model.md says where this differs from Monarch.
"""

from raymesh._src.rdma_buffer import (
    BufferDropped,
    BufferOwnerGone,
    RDMABuffer,
    get_rdma_backend,
    is_available,
    is_rdma_available,
)

__all__ = [
    "BufferDropped",
    "BufferOwnerGone",
    "RDMABuffer",
    "get_rdma_backend",
    "is_available",
    "is_rdma_available",
]
