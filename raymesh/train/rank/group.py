"""The rank's process group: joining a generation of it as the controller's rendezvous says,
paying gloo's one-time costs ahead, and telling a peer's failure from the rank's own."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from raymesh.train.protocol import Rendezvous

__all__ = ["is_comm_error", "join", "warm_up"]


def join(rdv: Rendezvous, *, device: torch.device, timeout_s: float) -> None:
    """Join (a new generation of) the process group, as `rdv` says: NCCL on a GPU, else gloo,
    every collective bounded by `timeout_s`."""
    os.environ.update(
        RANK=str(rdv.rank),
        WORLD_SIZE=str(rdv.world_size),
        LOCAL_RANK=str(rdv.local.rank),
        LOCAL_WORLD_SIZE=str(rdv.local.size),
        MASTER_ADDR=rdv.addr,
        MASTER_PORT=str(rdv.port),
    )
    if rdv.addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{rdv.addr}:{rdv.port}",
        rank=rdv.rank,
        world_size=rdv.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def warm_up() -> None:
    """Pay a process's one-time costs while it waits as a spare, not while a job waits for it:
    the first use_deterministic_algorithms imports torch._inductor (0.7-2.5 s here); a first
    process group loads gloo."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.zeros(1))
    dist.destroy_process_group()


def is_comm_error(e: BaseException) -> bool:
    """Whether a step failed in a collective (a peer gone) rather than of itself."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    markers = ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL", "Socket")
    return any(m in text for m in markers)
