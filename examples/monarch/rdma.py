"""Monarch's "RDMA support" docs example (docs/source/rdma.py), on raymesh: the same program
with `raymesh` in place of `monarch` in the imports, nothing else changed.

A parameter server lends its weights as an `RDMABuffer`: only the small handle travels in the
reply to `get_weights`, and the worker pulls the 1000x1000 float32 weights (4 MB) into its own
tensor with `read_into`, without the server taking part.

    python examples/monarch/rdma.py

Differences: raymesh has no RDMA NIC path. On one host the bytes are copied straight between the
two processes' memory (`process_vm_readv`); across hosts the owner's proc serves them through
Ray's object store (see `raymesh.rdma`). An axis named `gpus` on hosts without GPUs gives CPU
procs, as in Monarch.
"""

import torch

from raymesh.actor import Actor, endpoint, this_host
from raymesh.rdma import RDMABuffer

# %%
# Point-to-Point RDMA
# ====================
# Monarch provides first-class RDMA support through the RDMABuffer API. This lets
# you separate data references from data movement - instead of sending large tensors
# through your messaging patterns, you pass lightweight buffer references anywhere
# in your system, then explicitly transfer the actual data only when and where you need it.
# This approach lets you design your service's coordination patterns based on your application
# logic rather than being constrained by when the framework forces data transfers.


class ParameterServer(Actor):
    def __init__(self):
        self.weights = torch.rand(1000, 1000)  # Large model weights
        self.weight_buffer = RDMABuffer(self.weights.view(torch.uint8).flatten())

    @endpoint
    def get_weights(self) -> RDMABuffer:
        return self.weight_buffer  # Small message: just a reference!


class Worker(Actor):
    def __init__(self):
        self.local_weights = torch.zeros(1000, 1000)

    @endpoint
    def sync_weights(self, server: ParameterServer):
        # Control plane: get lightweight reference
        weight_ref = server.get_weights.call_one().get()

        # Data plane: explicit bulk transfer when needed
        weight_ref.read_into(self.local_weights.view(torch.uint8).flatten()).get()


server_proc = this_host().spawn_procs(per_host={"gpus": 1})
worker_proc = this_host().spawn_procs(per_host={"gpus": 1})

server = server_proc.spawn("server", ParameterServer)
worker = worker_proc.spawn("worker", Worker)

worker.sync_weights.call_one(server).get()
