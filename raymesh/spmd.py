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
  `__main__` with that `sys.argv`, in the proc, its folder first on `sys.path` (as `python
  script.py`), in the launcher's working folder where the host has it (`launch` passes it);
  a script that raises, or exits non-zero, fails the call with `ActorError` naming it (the
  other ranks are the caller's to stop: supervision reports a proc that died). An empty
  `script_args` is a ValueError.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import math
import os
import runpy
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from raymesh.actor import (
    Actor,
    ActorError,
    ActorMesh,
    ProcMesh,
    current_rank,
    current_size,
    endpoint,
    host_mesh,
    this_host,
)

__all__ = ["Attempt", "SPMDActor", "SPMDError", "launch", "setup_torch_elastic_env"]

logger = logging.getLogger("raymesh")


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
        # What a script that returned left in its globals, kept: freeing a DDP model there can
        # hang in gloo's process group destructor (joining its threads) after
        # destroy_process_group, which would keep main() from returning.
        self._globals: dict[str, Any] | None = None

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
    def main(
        self,
        master_addr: str,
        master_port: int,
        script_args: list[str],
        *,
        cwd: str | None = None,
    ) -> bool:
        """Set torchrun's environment and run the script (`["path.py", *args]` or `["-m",
        "module", *args]`) as `__main__`; True once it returns or exits with status 0.

        As `python path.py` would, the script's folder comes first on `sys.path` (its sibling
        modules import). `cwd` (raymesh's; `launch` gives the launcher's) is the folder the
        script runs in where this host has it, as torchrun's workers inherit the launcher's;
        where it does not (a cluster that ships code with Ray's `working_dir`), the proc's
        own. Both are put back when the script ends."""
        if not script_args or (script_args[0] == "-m" and len(script_args) < 2):
            raise ValueError(
                f"script_args={script_args!r}: give the script and its arguments, "
                '["train.py", "--lr", "0.1"], or ["-m", "module", ...]'
            )
        self._setup_env(master_addr, master_port)
        argv, path, here = sys.argv, list(sys.path), os.getcwd()
        error: BaseException | None = None
        try:
            if cwd is not None and os.path.isdir(cwd):
                os.chdir(cwd)
            if script_args[0] == "-m":
                sys.argv = list(script_args[1:])
                sys.path.insert(0, os.getcwd())  # as `python -m`
                self._globals = runpy.run_module(
                    script_args[1], run_name="__main__", alter_sys=True
                )
            else:
                sys.argv = list(script_args)
                sys.path.insert(0, os.path.dirname(os.path.abspath(script_args[0])))
                self._globals = runpy.run_path(script_args[0], run_name="__main__")
        except SystemExit as e:  # sys.exit() in a script ends the script, not the proc
            if e.code not in (None, 0):
                error = RuntimeError(
                    f"{' '.join(script_args)} exited with status {e.code} on rank {self.rank}"
                )
                error.__suppress_context__ = True
        except BaseException as e:
            # Its frames let go of what the script made (a DDP model holds the process group,
            # whose sockets then close: a peer waiting on this rank learns it failed).
            traceback.clear_frames(e.__traceback__)
            error = e
        finally:
            sys.argv, sys.path[:] = argv, path
            os.chdir(here)
        _leave_group()
        if error is not None:
            raise error
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


def _leave_group() -> None:
    """Destroy the default process group a script left (it failed, or never destroyed it), so
    that a later run in this proc can join a new one, as a new process would."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer died may not close cleanly; it is gone anyway
            logger.debug("raymesh: destroying a script's process group failed", exc_info=True)
    gc.collect()  # what still holds the group is in reference cycles (a traceback's frames)


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
        master_addr, master_port = first.get_host_port.call_one(use_ipaddr).get(timeout=60)
    actors.setup_env.call(master_addr, master_port).get(timeout=60)
    return actors


@dataclass(frozen=True)
class Attempt:
    """One start of a program's ranks: what ended each rank that failed (none: it succeeded)."""

    failures: dict[int, str]


class SPMDError(RuntimeError):
    """A program failed on some rank in every attempt `launch` was allowed."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.attempts = attempts


def launch(
    script_args: list[str],
    *,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    max_restarts: int = 0,
    timeout_s: float = 86400.0,
) -> list[Attempt]:
    """Run a torchrun script (`["train.py", *args]` or `["-m", "module", *args]`) as
    `nnodes` x `nproc_per_node` ranks, one proc each (`raymesh run`'s launcher): this host's
    procs, or `nnodes` hosts of the cluster's. When a rank fails (raises, exits non-zero, its
    proc dies) the attempt ends, and up to `max_restarts` times the group starts again **in
    place**: a dead rank's proc is replaced by a new one on its host, the other ranks run the
    script again in the procs they ran it in (torch and the script's imports already loaded;
    their process group destroyed first), and the script's own checkpoints resume it, as under
    torchrun. A surviving rank that has not ended `_DRAIN_S` after the failure (a peer in a
    computation, or a collective that does not notice) is killed and replaced too. An attempt
    that runs past `timeout_s` fails. Returns the attempts, the last one a success; raises
    SPMDError naming each rank's failure when none is left.

    A script run again in the same proc sees the module state its imports left (a module
    global a script's import changed keeps its value); torchrun's new processes do not."""
    for name, value, least in (
        ("nproc_per_node", nproc_per_node, 1),
        ("nnodes", nnodes, 1),
        ("max_restarts", max_restarts, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r}: give an integer >= {least}")
    if not script_args:
        raise ValueError("script_args=[]: give the script and its arguments")
    group = _Group(nproc_per_node, nnodes)
    try:
        attempts: list[Attempt] = []
        for n in range(max_restarts + 1):
            attempt = group.run(script_args, timeout_s)
            attempts.append(attempt)
            if not attempt.failures:
                return attempts
            said = "; ".join(f"rank {r}: {why}" for r, why in sorted(attempt.failures.items()))
            if n < max_restarts:
                logger.warning("raymesh run: restart %d of %d after %s", n + 1, max_restarts, said)
                group.renew()
        raise SPMDError(
            f"{' '.join(script_args)} failed in {len(attempts)} attempt(s); the last: {said}",
            attempts,
        )
    finally:
        group.stop()


_DRAIN_S = 10.0  # how long survivors of a failed attempt get to end their script by themselves


class _Placed(SPMDActor):
    """A rank started in a proc of its own (a replacement): its place is given, not read from
    the one-proc mesh it lives in."""

    def __init__(self, rank: int, world_size: int, local_world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = rank % local_world_size, local_world_size
        self._store, self._globals = None, None


class _Group:
    """The ranks of a `launch`, one proc each: the first mesh's procs, and one-proc meshes for
    the ranks replaced since. Rank r lives on host r // per_host."""

    def __init__(self, per_host: int, hosts: int) -> None:
        self.per_host, self.world = per_host, per_host * hosts
        self.hosts = this_host()
        if hosts > 1:
            every = host_mesh()
            have = every.extent.sizes[0]
            if have < hosts:
                raise ValueError(
                    f"nnodes={hosts}: the cluster has {have} host(s) that can run a proc; ask "
                    "for at most that many, or add hosts"
                )
            self.hosts = every.slice(hosts=slice(0, hosts))
        first = self.hosts.spawn_procs(per_host={"procs": per_host}, name="spmd", escalate=False)
        self.meshes: list[ProcMesh] = [first]
        try:
            flat = first.spawn("spmd", SPMDActor).flatten("rank")
        except BaseException:
            first.stop()
            raise
        procs = first.flatten("rank")
        self.procs = [procs.slice(rank=r) for r in range(self.world)]
        self.actors = [flat.slice(rank=r) for r in range(self.world)]
        self.calls: list[Any] = []

    def run(self, script_args: list[str], timeout_s: float) -> Attempt:
        """Every rank runs the script once; watched until all succeed, one fails or
        `timeout_s` passes."""
        addr, port = self.actors[0].get_host_port.call_one(None).get(timeout=60)
        cwd = os.getcwd()
        self.calls = [a.main.call_one(addr, port, script_args, cwd=cwd) for a in self.actors]
        settled = threading.Event()
        for c in self.calls:
            c.add_done_callback(settled.set)
        deadline = time.monotonic() + timeout_s
        while True:
            failures = {r: why for r, c in enumerate(self.calls) if (why := _failure(c))}
            if failures or all(c.done() for c in self.calls):
                return Attempt(failures)
            if time.monotonic() > deadline:
                left = [r for r, c in enumerate(self.calls) if not c.done()]
                return Attempt({r: f"still running after {timeout_s:g}s" for r in left})
            settled.wait(0.5)  # a reply wakes it; the bound only rechecks the deadline
            settled.clear()

    def renew(self) -> None:
        """After a failed attempt: survivors end their script (or are killed) and destroy
        their process group; every rank whose proc is gone gets a new proc on its host."""
        deadline = time.monotonic() + _DRAIN_S
        for c in self.calls:
            with contextlib.suppress(Exception):  # its end is read below, not here
                c.get(timeout=max(0.0, deadline - time.monotonic()))
        # A rank still running (or leaving its group) is replaced with the dead ones.
        dead = [r for r, c in enumerate(self.calls) if not c.done() or _gone(c)]
        for r in dead:
            with contextlib.suppress(Exception):  # already dead, most often
                self.procs[r].kill()
            host = (
                self.hosts.slice(hosts=r // self.per_host)
                if self.world > self.per_host
                else self.hosts
            )
            mesh = host.spawn_procs(per_host={"procs": 1}, name=f"spmd-r{r}", escalate=False)
            self.meshes.append(mesh)
            self.procs[r] = mesh
            self.actors[r] = mesh.spawn("spmd", _Placed, r, self.world, self.per_host)
        logger.info("raymesh run: ranks %s on new procs, the others in place", sorted(dead))

    def stop(self) -> None:
        """Kill every proc, then release them: a rank may wait in a collective for one that
        failed, and after a success the script is over, and a process exiting gracefully can
        hang freeing a gloo process group (joining its threads)."""
        for mesh in self.meshes:
            with contextlib.suppress(Exception):
                mesh.kill()
            mesh.stop()


def _gone(call: Any) -> bool:
    """Whether a finished call ended because its proc is gone (not by the script's error)."""
    try:
        call.get(timeout=0)
    except ActorError:
        return False
    except Exception:
        return True
    return False


def _failure(call: Any) -> str | None:
    """What ended a finished call in failure (None: it is running, or succeeded)."""
    if not call.done():
        return None
    try:
        call.get(timeout=0)
    except ActorError as e:  # the script's own error, not the one-point slice's "rank 0"
        return f"{e.remote_type}: {e.remote_message}".splitlines()[0][:300]
    except Exception as e:  # its proc died (SupervisionError), or the call could not be made
        return str(e).splitlines()[0][:300] or type(e).__name__
    return None
