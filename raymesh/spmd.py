"""torchrun-style SPMD programs on a proc mesh, with Monarch's names (`monarch.spmd`).

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    setup_torch_elastic_env(procs)              # RANK, WORLD_SIZE, MASTER_ADDR, ... on each proc
    trainers = procs.spawn("trainer", Trainer)  # their code calls init_process_group("env://")

    spmd = procs.spawn("spmd", SPMDActor)
    addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get()
    spmd.main.call(addr, port, ["train.py", "--lr", "0.1"]).get()  # the script, unchanged

Guarantees:
- Each proc gets torchrun's environment (torch.distributed.run's variables): `RANK` (the
  proc's rank in the mesh, row-major), `WORLD_SIZE` (the mesh's size), `LOCAL_RANK` and
  `LOCAL_WORLD_SIZE` (its coordinate on, and the size of, the mesh's last axis, the one a host's
  procs span), `GROUP_RANK`/`GROUP_WORLD_SIZE` (which such group, and how many),
  `ROLE_RANK`/`ROLE_WORLD_SIZE`/`ROLE_NAME`, and `MASTER_ADDR`/`MASTER_PORT`.
- The rendezvous port cannot be taken between its choice and its use: rank 0's actor holds a
  `TCPStore` server on a port the kernel chose and keeps it, and every rank's `env://`
  rendezvous joins it as a client (`TORCHELASTIC_USE_AGENT_STORE`, as torchrun's agent does).
  Monarch instead probes a free port and closes it, which another socket can take first.
- `main(addr, port, ["script.py", *args])` (or `["-m", "module", *args]`) runs the script as
  `__main__` with that `sys.argv`, in the proc; a script that raises, or exits non-zero, fails
  the call with `ActorError` naming it (the other ranks are the caller's to stop: supervision
  reports a proc that died). An empty `script_args` is a ValueError.
"""

from __future__ import annotations

import datetime
import math
import os
import runpy
import sys
from typing import Any

from raymesh.actor import (
    Actor,
    ActorMesh,
    ProcMesh,
    current_rank,
    current_size,
    endpoint,
    this_host,
)

__all__ = ["SPMDActor", "setup_torch_elastic_env"]


class SPMDActor(Actor):
    """One rank of an SPMD program: its place in the mesh as torchrun's variables, the
    rendezvous store on rank 0, and the script run in its proc (see the module docstring)."""

    def __init__(self) -> None:
        point, sizes = current_rank(), current_size()
        local = point.extent.labels[-1]  # the axis a host's procs span ("gpus", "procs")
        self.rank = point.rank
        self.world_size = math.prod(sizes.values())
        self.local_rank, self.local_world_size = point[local], sizes[local]
        self._store: Any = None  # rank 0's rendezvous store, kept while the actor lives

    @endpoint
    def get_host_port(self, use_ipaddr: Any = None) -> tuple[str, int]:
        """This host's address and the port of a rendezvous store started here and kept
        (`use_ipaddr` is Monarch's; raymesh gives the host's address as the cluster knows it)."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            this_host().addresses[0],
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        return this_host().addresses[0], self._store.port

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> None:
        """Set torchrun's environment in this proc."""
        self._setup_env(master_addr, master_port)

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Set torchrun's environment and run the script (`["path.py", *args]` or `["-m",
        "module", *args]`) as `__main__`; True once it returns or exits with status 0."""
        if not script_args or (script_args[0] == "-m" and len(script_args) < 2):
            raise ValueError(
                f"script_args={script_args!r}: give the script and its arguments, "
                '["train.py", "--lr", "0.1"], or ["-m", "module", ...]'
            )
        self._setup_env(master_addr, master_port)
        argv = sys.argv
        try:
            if script_args[0] == "-m":
                sys.argv = list(script_args[1:])
                runpy.run_module(script_args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(script_args)
                runpy.run_path(script_args[0], run_name="__main__")
        except SystemExit as e:  # sys.exit() in a script ends the script, not the proc
            if e.code not in (None, 0):
                raise RuntimeError(
                    f"{' '.join(script_args)} exited with status {e.code} on rank {self.rank}"
                ) from None
        finally:
            sys.argv = argv
        return True

    def _setup_env(self, master_addr: str, master_port: int) -> None:
        groups = -(-self.world_size // self.local_world_size)
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            GROUP_RANK=str(self.rank // self.local_world_size),
            GROUP_WORLD_SIZE=str(groups),
            ROLE_RANK=str(self.rank),
            ROLE_WORLD_SIZE=str(self.world_size),
            ROLE_NAME="rank",
            TORCHELASTIC_USE_AGENT_STORE="True",  # join rank 0's kept store, never start one
        )
        if master_addr.startswith("127."):  # gloo picks an interface that reaches the address
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def setup_torch_elastic_env(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: Any = None,
) -> ActorMesh:
    """Set torchrun's environment on every proc of `proc_mesh` (see the module docstring);
    rank 0 hosts the rendezvous store unless `master_addr` and `master_port` name one (give
    both or neither). Returns the mesh's `SPMDActor`s, which keep the store up: keep them as
    long as the program rendezvous."""
    if (master_addr is None) != (master_port is None):
        raise ValueError(
            f"master_addr={master_addr!r}, master_port={master_port!r}: give both, or neither "
            "(rank 0 then hosts the rendezvous)"
        )
    actors = proc_mesh.spawn("_spmd", SPMDActor)
    if master_addr is None:
        first = actors.slice(**dict.fromkeys(proc_mesh.extent.labels, 0))
        master_addr, master_port = first.get_host_port.call_one(use_ipaddr).get()
    actors.setup_env.call(master_addr, master_port).get()
    return actors
