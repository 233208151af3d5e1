"""The trainer actor: one per rank. It owns the process group, the model, the optimizer and the
data cursor; the controller tells it what to do, one endpoint call per phase.

Determinism (what makes two runs with the same seed bit-identical, and a resumed run equal to an
uninterrupted one at the same world size):
- torch is seeded with `seed` before the build function runs, so every rank builds identical
  weights;
- the samples of step s are a pure function of (seed, s) (`raymesh.train.data`), split across
  ranks in rank order;
- before step s each rank reseeds torch with (seed, s, rank), so dropout and other random ops
  depend only on the step, not on how many steps this process has run;
- deterministic algorithms are requested, and intra-op threads are fixed per worker.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from raymesh._src import backend
from raymesh.actor import Actor, endpoint
from raymesh.testing.faults import Fault
from raymesh.train import data as data_order
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import TrainConfig
from raymesh.train.strategy import (
    StrategyDecision,
    cpu_budget_bytes,
    estimate,
    fsdp_blocks,
    gpu_budget_bytes,
    probe_activation_bytes,
)
from raymesh.train.task import Context, Local, Task

logger = logging.getLogger("raymesh")


def _mix(*values: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() is salted per process)."""
    acc = 0x9E3779B97F4A7C15
    for v in values:
        acc = (acc ^ (v + 0x9E3779B97F4A7C15 + (acc << 6) + (acc >> 2))) & (2**64 - 1)
    return acc & (2**63 - 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


# This process's training progress. The trainer updates it; the Monitor actor on the same proc
# reads it while the trainer is busy (actors sharing a proc run concurrently), which is how a
# hung rank is told apart from the ranks waiting for it in a collective.
_PHASES = ("idle", "start", "forward", "backward", "optimizer", "done")
_progress: dict[str, Any] = {"step": 0, "phase": "idle", "since": time.monotonic()}


def _mark(step: int, phase: str) -> None:
    _progress.update(step=step, phase=phase, since=time.monotonic())


class Monitor(Actor):
    """Reports the trainer's progress in this proc, even while the trainer is stuck."""

    @endpoint
    def status(self) -> dict[str, Any]:
        p = dict(_progress)
        p["phase_index"] = _PHASES.index(p["phase"])
        p["for_s"] = time.monotonic() - p.pop("since")
        p["pid"] = os.getpid()
        return p


class TrainWorker(Actor):
    """One rank of a training job (see the module docstring for its guarantees)."""

    def __init__(self, build: Any, config: TrainConfig) -> None:
        self.build = build
        self.config = config
        self.rank = -1
        self.world_size = 0
        self.task: Task | None = None
        self.model: torch.nn.Module | None = None  # the wrapped (DDP/FSDP) model
        self.checkpointer: Checkpointer | None = None
        self.decision: StrategyDecision | None = None
        self.done = 0  # steps completed (the data position)
        self.sizes: list[int] | None = None  # samples per rank (None: the even split)
        self.slow = 1.0  # a `slow` fault's factor, once it fired
        self.compute_s = 0.0  # this rank's own forward + backward time in the last step
        self.samples = 0  # and how many samples it trained on
        self.step_samples = 0  # samples of the last step (compute_s may be one step late)
        self.base_s = 0.0  # compute_s without a `slow` fault's sleep
        self.slept_s = 0.0  # that sleep, in the last step

    @endpoint
    def warm(self) -> None:
        """Get a spare ready to join fast: pay the one-time costs of a process while waiting,
        not while the job waits for it. The first use_deterministic_algorithms imports
        torch._inductor (0.7-2.5 s here); a first process group loads gloo."""
        torch.use_deterministic_algorithms(True, warn_only=True)
        if dist.is_initialized():
            return
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.zeros(1))
        dist.destroy_process_group()

    @endpoint
    def address(self) -> tuple[str, int]:
        """Where this rank can host the process group's store (rank 0 is asked)."""
        return backend.node_ip(), _free_port()

    def _join(
        self, master_addr: str, master_port: int, rank: int, world_size: int, local: Local
    ) -> None:
        """Join (a new generation of) the process group."""
        cfg = self.config
        self.rank, self.world_size = rank, world_size
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local.rank),
            LOCAL_WORLD_SIZE=str(local.size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        if master_addr.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
        )

    @endpoint
    def setup(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        local: Local,
        measure: bool = True,
        faults: list[Fault] | None = None,
    ) -> dict[str, Any]:
        """Join the process group as `rank`, run the user's build function, and (`measure`)
        estimate memory for the strategy decision: at the start only, not when healing.

        On a rank that was set up before (an FSDP or HSDP job healing or resizing), it first
        leaves the old group and drops the old model: the process stays warm, the state is
        rebuilt. `faults` (when="join") fire first, as the rank joins."""
        for fault in faults or ():
            fault.fire()
        cfg = self.config
        if self.task is not None:
            self._abort()
            self.task = None
            self.__dict__.pop("optimizer", None)
            gc.unfreeze()  # the old task was frozen with the rest (see _wrap)
            gc.collect()
        # A CPU proc can still see the machine's GPUs: use one only if Ray gave it one.
        use_cuda = cfg.gpus is not False and torch.cuda.is_available() and bool(backend.gpu_ids())
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")
        self._join(master_addr, master_port, rank, world_size, local)
        if not use_cuda:
            torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(cfg.seed)
        ctx = Context(
            rank=rank,
            world_size=world_size,
            local_rank=local.rank,
            local_world_size=local.size,
            device=self.device,
            seed=cfg.seed,
            config=cfg,
        )
        task = self.build(ctx)
        if not isinstance(task, Task):
            raise TypeError(f"the build function returned {type(task).__name__}, not train.Task")
        task.model.to(self.device)
        self.task = task
        self.n = len(task.dataset)
        self.collate = task.collate_fn or default_collate
        params = sum(p.numel() for p in task.model.parameters())
        if not measure:
            return {"params": params, "device": str(self.device)}
        activation = cfg.activation_bytes
        if activation is None:
            first = data_order.micro_batches(self._indices(0), cfg.micro_batch_size)[0]
            activation = probe_activation_bytes(task.model, task.loss_fn, self._batch(first))
        est = estimate(task.model, task.optimizer, activation)
        if use_cuda:
            budget = gpu_budget_bytes(self.device.index or 0)
        else:
            budget = cpu_budget_bytes(cfg.memory_budget_gb, ranks_per_host=local.size)
        return {
            "estimate": est,
            "budget_bytes": budget,
            "params": params,
            "device": str(self.device),
        }

    @endpoint
    def prepare(self, decision: StrategyDecision, resume: str | None) -> int:
        """Wrap the model as decided, restore a checkpoint if given; return the next step."""
        assert self.task is not None
        self.decision = decision
        model = self.task.model
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in self.task.optimizer.param_groups]
        self._wrap()
        if decision.sharded:
            # fully_shard replaced the parameters with sharded ones: point the user's optimizer
            # (class, groups, hyperparameters unchanged; no state yet) at the new objects.
            params = dict(model.named_parameters())
            for group, ns in zip(self.task.optimizer.param_groups, groups):
                group["params"] = [params[n] for n in ns]
            self.task.optimizer.state.clear()
        self.optimizer = self.task.optimizer
        self._new_checkpointer()
        start = 0
        if self.checkpointer is not None and resume is not None:
            assert self.model is not None
            manifest: Manifest = self.checkpointer.load(Path(resume), self.model, self.optimizer)
            start = manifest.data_position
        self.done = start
        return start

    def _wrap(self) -> None:
        """Wrap the user's model for the current process group, as the strategy decided."""
        assert self.task is not None and self.decision is not None
        # Everything alive now (Ray, torch, the user's task) outlives this wrapper: freeze it
        # out of the garbage collector, so the collection that drops the wrapper after a
        # failure (see _abort) scans little and takes milliseconds, not ~0.25 s. Collect first,
        # so no garbage of the build (or of a failed step) is frozen with it.
        gc.collect()
        gc.freeze()
        model = self.task.model
        if self.decision.sharded:
            from torch.distributed.fsdp import fully_shard

            mesh = None  # FSDP: every rank, one dimension
            dims = self.decision.mesh(self.world_size)
            if dims is not None:  # HSDP: reduce-scatter within a shard group, then all-reduce
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh(
                    self.device.type, dims, mesh_dim_names=("replicate", "shard")
                )
            for unit in fsdp_blocks(model):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
        else:
            ids = [self.device.index] if self.device.type == "cuda" else None
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            if self.config.rebalance:  # per-step compute timings (see _ddp_compute_s)
                ddp._set_ddp_runtime_logging_sample_rate(1)
            self.model = ddp

    def _new_checkpointer(self) -> None:
        ckpt = self.config.checkpoint
        if ckpt is not None:
            self.checkpointer = Checkpointer(ckpt.dir, keep=ckpt.keep, async_save=ckpt.async_save)

    def _abort(self) -> None:
        """Leave a broken process group at once, so peers blocked on us fail fast too."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            except Exception:
                pass  # its group is broken too; the last committed checkpoint stands
        # Drop the wrapper first: DDP's reducer holds the process group, and the group's
        # sockets only close (failing the peers' collectives) once nothing holds it. (FSDP2
        # keeps its groups alive past this, which is why HSDP's survivors that wait on this
        # rank in another group stay stuck: the controller replaces them, see find_lost.)
        if self.model is not None:
            self.model = None
            gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.warning(
                    "raymesh.train: rank %d: destroying its process group failed", self.rank
                )

    @endpoint
    def reform(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        local: Local,
        faults: list[Fault] | None = None,
    ) -> None:
        """Join the next generation of the process group as `rank` (a survivor of a failure),
        and wrap the model for it. DDP only: the caller then restores state with set_state.
        `faults` (when="join") fire first."""
        for fault in faults or ():
            fault.fire()
        assert self.task is not None
        self._abort()
        self._join(master_addr, master_port, rank, world_size, local)
        self._wrap()
        self._new_checkpointer()

    @endpoint
    def get_state(self) -> dict[str, Any]:
        """This rank's model and optimizer state and its completed steps (DDP: a full replica)."""
        assert self.task is not None
        return {
            "model": self.task.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "done": self.done,
        }

    @endpoint
    def set_state(self, state: dict[str, Any]) -> int:
        """Load a peer's state (tensors arrive as read-only shared memory: copy them first)."""
        assert self.task is not None
        state = _clone(state)
        self.task.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.done = state["done"]
        return self.done

    def _indices(self, step: int) -> list[int]:
        cfg = self.config
        batch = data_order.global_batch(cfg.seed, step, cfg.global_batch_size, self.n)
        return data_order.rank_share(batch, self.world_size, self.rank, self.sizes)

    def _batch(self, indices: list[int]) -> Any:
        assert self.task is not None
        return _to(self.collate([self.task.dataset[i] for i in indices]), self.device)

    def _step(self, step: int) -> float:
        assert self.task is not None and self.model is not None
        cfg = self.config
        torch.manual_seed(_mix(cfg.seed, step, self.rank))
        indices = self._indices(step)
        micro = data_order.micro_batches(indices, cfg.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        wall = 0.0  # forward + backward wall time
        quiet, quiet_samples = 0.0, 0  # of which micro batches that do not reduce (no waiting)
        slept = 0.0  # of which a `slow` fault's sleep
        for i, m in enumerate(micro):
            last = i == len(micro) - 1
            with self._no_sync(not last):
                _mark(step + 1, "forward")
                # The loss is a mean over the micro batch; weighting it by the micro batch's
                # share of the global batch (x world size, as the reduction averages ranks)
                # makes the averaged gradient the global batch's mean for any split.
                weight = len(m) * self.world_size / cfg.global_batch_size
                t0 = time.perf_counter()
                loss = self.task.loss_fn(self.model, self._batch(m)) * weight
                if self.slow > 1 and last:  # a straggler: stretch the step by the factor
                    slept = (self.slow - 1) * self.base_s
                    time.sleep(slept)
                _mark(step + 1, "backward")
                loss.backward()
                seconds = time.perf_counter() - t0
                wall += seconds
                if not last:  # only the last micro batch reduces, so only it waits for peers
                    quiet, quiet_samples = quiet + seconds, quiet_samples + len(m)
            total += loss.detach()
        self._account(len(indices), len(micro) == 1, wall, (quiet, quiet_samples), slept)
        _mark(step + 1, "optimizer")
        self.optimizer.step()
        return float(total)

    def _account(
        self, samples: int, single: bool, wall: float, quiet: tuple[float, int], slept: float
    ) -> None:
        """Record this step's own compute time (for load balancing) and the base a `slow` fault
        stretches. quiet: (seconds, samples) of the micro batches that did not reduce."""
        measured = self._ddp_compute_s() if single else None
        if quiet[1]:  # gradient accumulation: the quiet micro batches measure the rank alone
            self.compute_s, self.samples = quiet
        elif measured is not None:  # DDP's figures are the previous step's: pair them so
            self.compute_s, self.samples = measured, self.step_samples
        else:  # wall times include waiting, except on the slowest rank
            self.compute_s, self.samples = wall, samples
        self.step_samples = samples
        # A straggler's own compute: DDP's figure when there is one (the previous step's, with
        # the previous sleep); else the wall time, which is the compute while this rank is the
        # slowest (the last to reach the reduction).
        base = measured - self.slept_s if measured is not None else wall - slept
        self.base_s, self.slept_s = max(base, 0.0), slept

    def _ddp_compute_s(self) -> float | None:
        """The forward + backward compute DDP measured on this rank, without the time spent
        waiting for peers in the all-reduce (its runtime logging, on when rebalancing). DDP
        logs a step when the next one starts, so this is the previous step's; None when
        there is no such figure (not rebalancing, not DDP, the first step)."""
        if not self.config.rebalance:
            return None
        if not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return None
        try:
            stats = self.model._get_ddp_logging_data()
            seconds = (stats["forward_compute_time"] + stats["backward_compute_time"]) / 1e9
        except (AttributeError, KeyError, RuntimeError):  # a torch without these stats
            return None
        return seconds if seconds > 0 else None

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """Gradient accumulation: no gradient reduction until the last micro batch."""
        if not skip:
            return contextlib.nullcontext()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        self.model.set_requires_gradient_sync(False)  # type: ignore[union-attr,operator]
        return _resync(self.model)

    @endpoint
    def run(
        self,
        start: int,
        stop: int,
        faults: list[Fault] | None = None,
        sizes: list[int] | None = None,
    ) -> dict[str, Any]:
        """Train steps [start, stop) (0-based) with `sizes` samples per rank (None: the even
        split); checkpoint on the configured steps.

        Returns {"metrics": per completed step ("step" is 1-based), "done": steps completed,
        "error": None or why the chunk stopped early}. A failing step is not retried here: the
        rank leaves its process group at once (so peers blocked on it fail fast) and the
        controller heals the job."""
        out: list[dict[str, float]] = []
        ckpt = self.config.checkpoint
        if not dist.is_initialized():  # a chunk queued behind a failed one: nothing to do
            return {"metrics": out, "done": self.done, "error": "no process group", "cause": "peer"}
        self.sizes = sizes
        try:
            for step in range(start, stop):
                _mark(step + 1, "start")
                for fault in faults or ():
                    if fault.rank == self.rank and fault.at_step == step + 1:
                        if fault.factor is not None:
                            self.slow = fault.factor
                        fault.fire()
                t0 = time.perf_counter()
                loss = self._step(step)
                self.done = step + 1
                out.append(
                    {
                        "step": step + 1,
                        "loss": loss,
                        "step_s": time.perf_counter() - t0,
                        "end": time.time(),
                        "compute_s": self.compute_s,
                        "samples": self.samples,
                    }
                )
                if ckpt is not None and ckpt.every and (step + 1) % ckpt.every == 0:
                    self._save(step + 1)
                _mark(step + 1, "done")
        except Exception as e:
            self._abort()
            return {
                "metrics": out,
                "done": self.done,
                "error": f"{type(e).__name__}: {str(e)[:500]}",
                # "peer": a collective failed because another rank went away; "own": this
                # rank's step itself raised (it is then replaced).
                "cause": "peer" if _is_comm_error(e) else "own",
            }
        return {"metrics": out, "done": self.done, "error": None}

    @endpoint
    def save(self, done: int) -> None:
        """Checkpoint now, at `done` completed steps (collective), and wait for the commit."""
        self._save(done)
        assert self.checkpointer is not None
        self.checkpointer.wait()

    def _save(self, done: int) -> None:
        assert self.checkpointer is not None and self.decision is not None
        self.checkpointer.save(
            done,
            self.model,  # type: ignore[arg-type]
            self.optimizer,
            world_size=self.world_size,
            strategy=self.decision.strategy,
            config=self.config.to_dict(),
            data_position=done,
            rank=self.rank,
        )

    @endpoint
    def finish(self, done: int, save: bool) -> dict[str, torch.Tensor] | None:
        """Final checkpoint (if asked), then the full model state on rank 0 (collective)."""
        if save and self.checkpointer is not None:
            self._save(done)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank != 0:
            return None
        return {
            k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)
        }

    @endpoint
    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    markers = ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL", "Socket")
    return any(m in text for m in markers)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


@contextlib.contextmanager
def _resync(model: Any) -> Any:
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
