"""GPU check: every GPU code path of raymesh, once, on a machine with one NVIDIA GPU.

    python bench/gpu_check.py            # full; at most --budget seconds (default 280) in all
    python bench/gpu_check.py --quick    # fewer steps and calls (smoke run)

Meant to be run as one script on a lent GPU machine (one H200, 16 cores, no network): it uses
only this repository's venv (nvidia-ml-py for `nvml`) and prints one JSON object on stdout, the
figures for docs/ (progress on stderr). Each section runs in a fresh python in a session of its
own, killed as a whole (its Ray too) past its time, so a hang or a crash costs that section only;
it records {"ok", "seconds", figures, "error" or "skipped"}, figures from before a failure kept.
Without CUDA the GPU sections are skipped with the reason; so is any section once --budget is spent.
- env: torch, CUDA, NCCL and nvidia-ml-py versions, the devices torch sees, CPUs, load average.
- nvml: raymesh's NVML discovery (read_gpus, local_facts): GPUs, memory, link matrix.
- nccl: an NCCL process group, rank 0 of 1 (NCCL refuses two ranks on one GPU): all_reduce and
  broadcast of CUDA tensors, values checked.
- train_ddp, train_fsdp: raymesh.train.fit of the example MLP on 1 worker, gpus=True, strategy
  forced: decision, losses, steps/s; the rank's device and backend as its build function saw them.
- memory_estimate: raymesh.train.estimate.estimate (activations from probe_activation_bytes)
  against torch.cuda.max_memory_allocated over real steps, for three example models.
- finetune_memory: one NCCL rank, TinyGPT (4x wider) under FSDP2 in bf16 (MixedPrecisionPolicy)
  with activation checkpointing and CPU offload, as raymesh.train.rank.parallelize applies
  them: losses, where the parameters live, and the device part of the estimate
  (`MemoryEstimate.under(checkpointing, offload)`) against torch.cuda.max_memory_allocated.
- finetune_fit: raymesh.train.fit on 1 GPU worker, FSDP2 + bf16 + activation checkpointing +
  CPU offload, as a user's job file asks: TinyGPT (full fine-tune) and a small HF Llama with a
  LoRA adapter (raymesh.train.hf): time, losses (they must fall), the decision's reason.
- spawn_and_messages: RAYMESH_WARM_PROCS=16; spawn 16 procs and an actor mesh until all answer,
  call_one and call-all-16 latency, what CPU procs see of the GPU; a GPU proc (per_host={"gpus":
  1}): its CUDA_VISIBLE_DEVICES, a CUDA allocation, and how a CUDA tensor it returns arrives.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolated import run_isolated

GPU = True  # finetune_fit: False tries its plumbing on a CPU
FLOOR_S = 10.0  # a section starts with at least this long, and keeps this for each one after it
ITERATIONS = {
    "full": {"train_steps": 40, "memory_steps": 5, "call_one": 500, "call_all": 200, "warmup": 20},
    "quick": {"train_steps": 10, "memory_steps": 3, "call_one": 100, "call_all": 30, "warmup": 5},
}
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu_check {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Skipped(Exception):
    """The section cannot run here (no CUDA, no GPU): recorded as skipped, not as failed."""


class Record(dict[str, Any]):
    """A section's figures, written to `path` at every `put`: a section killed for running late
    still reports what it measured."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def put(self, **figures: Any) -> None:
        self.update(figures)
        Path(self.path + ".tmp").write_text(json.dumps(self, default=str))
        os.replace(self.path + ".tmp", self.path)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"check failed: {what}")


def left(args: argparse.Namespace) -> float:
    """Seconds this section may still wait for something, keeping 5 s to report and clean up."""
    return max(1.0, args.deadline - time.monotonic() - 5.0)


def finite(x: float) -> float | str:
    return round(x, 5) if math.isfinite(x) else repr(x)  # JSON has no NaN


def need_cuda(args: argparse.Namespace) -> Any:
    """torch, where there is a CUDA device; else raise Skipped with the reason (env's, if any)."""
    if args.no_cuda:
        raise Skipped(args.no_cuda)
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} (CUDA build {torch.version.cuda})"
        raise Skipped(f"no CUDA device: {build} says torch.cuda.is_available() is False")
    return torch


def env(r: Record, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    wanted = ("torch", "ray", "raymesh", "nvidia-ml-py")
    dists = importlib.metadata.distributions()
    r.put(versions={d.metadata["Name"]: d.version for d in dists if d.metadata["Name"] in wanted})
    r.put(pynvml_importable=importlib.util.find_spec("pynvml") is not None)
    r.put(torch_cuda=torch.version.cuda, nccl_available=dist.is_nccl_available())
    r.put(cpu_count=os.cpu_count(), loadavg=os.getloadavg())
    r.put(cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    r.put(cuda_available=torch.cuda.is_available(), device_count=torch.cuda.device_count())
    try:
        need_cuda(args)
    except Skipped as e:
        r.put(no_cuda=str(e))  # the GPU sections are skipped with this reason
        return
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    r.put(devices=[{"name": p.name, "memory": p.total_memory, "sm": p.major} for p in props])
    r.put(nccl=".".join(map(str, torch.cuda.nccl.version())))


def nvml(r: Record, args: argparse.Namespace) -> None:
    from raymesh.topology.discovery import local_facts, read_gpus

    devices, links, note = read_gpus()
    facts = local_facts()
    r.put(gpus=len(devices), devices=[d.to_dict() for d in devices], links=links, note=note)
    r.put(cpus={k: facts.get(k) for k in ("sockets", "numa_nodes", "cpu_affinity")})
    if not devices and args.no_cuda:  # no CUDA either: NVML's reason is expected, not a failure
        raise Skipped(f"{args.no_cuda}; NVML: {note}")
    check(bool(devices), f"NVML found no GPU: {note}")
    check(len(facts["gpus"]) == len(devices), "local_facts and read_gpus agree on the GPUs")


def nccl_group(dev: Any) -> None:
    """A process group of one rank over NCCL on `dev` (NCCL refuses two ranks on one GPU).
    device_id: the communicator is created now, so its whole setup is in the caller's timing."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(dev)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    dist.init_process_group("nccl", init_method=url, rank=0, world_size=1, device_id=dev)


def nccl(r: Record, args: argparse.Namespace) -> None:
    torch = need_cuda(args)
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    nccl_group(dev)
    try:
        r.put(init_s=round(time.perf_counter() - t0, 3), backend=dist.get_backend())
        x = torch.full((1 << 20,), 3.0, device=dev)
        dist.all_reduce(x)
        b = torch.arange(1 << 20, device=dev, dtype=torch.float32)
        dist.broadcast(b, src=0)
        want = torch.arange(1 << 20, device=dev, dtype=torch.float32)
        r.put(all_reduce_ok=bool((x == 3.0).all()), broadcast_ok=torch.equal(b, want))
        check(r["backend"] == "nccl" and r["all_reduce_ok"] and r["broadcast_ok"], str(r))
    finally:
        dist.destroy_process_group()


def train_section(strategy: Literal["ddp", "fsdp"]) -> Callable[[Record, Any], None]:
    def run(r: Record, args: argparse.Namespace) -> None:
        need_cuda(args)
        from raymesh import train
        from raymesh._src.backend import ensure_ray, shutdown

        seen = args.out + ".rank0"

        def build(ctx: train.Context) -> train.Task:
            """The example MLP, after noting what the rank sees: fit's result does not say
            which device or process group backend the ranks used."""
            import torch.distributed as dist

            from raymesh.examples import mlp

            gpu = os.environ.get("CUDA_VISIBLE_DEVICES")  # the group is formed before build
            info = {"device": str(ctx.device), "backend": dist.get_backend(), "cuda_visible": gpu}
            Path(seen).write_text(json.dumps(info))
            return mlp.build(ctx)

        t0 = time.perf_counter()
        ensure_ray()
        r.put(ray_up_s=round(time.perf_counter() - t0, 2))
        config = train.TrainConfig(
            workers=1, steps=args.it["train_steps"], global_batch_size=64, strategy=strategy,
            gpus=True, report_every=10, timeout_s=left(args),
        )  # fmt: skip
        try:
            t0 = time.perf_counter()
            result = train.fit(build, config)
            r.put(fit_s=round(time.perf_counter() - t0, 2))
        finally:
            shutdown()
        losses, ends = [h["loss"] for h in result.history], [h["end"] for h in result.history]
        r.put(decision=result.decision.strategy, reason=result.decision.reason, steps=len(losses))
        r.put(first_loss=finite(losses[0]), final_loss=finite(losses[-1]))
        r.put(steps_per_s=round((len(ends) - 1) / (ends[-1] - ends[0]), 1))
        cpu = all(t.device.type == "cpu" for t in result.state_dict().values())
        r.put(weights_on_cpu=cpu, rank0=json.loads(Path(seen).read_text()))
        check(result.decision.strategy == strategy, f"decision {result.decision.strategy}")
        check(math.isfinite(losses[-1]), f"final loss {losses[-1]}")
        check(r["rank0"]["device"].startswith("cuda"), f"rank 0 ran on {r['rank0']['device']}")
        check(r["rank0"]["backend"] == "nccl", f"rank 0's backend is {r['rank0']['backend']}")
        check(cpu, "result.state_dict() holds CPU tensors")

    return run


def memory_estimate(r: Record, args: argparse.Namespace) -> None:
    torch = need_cuda(args)
    from torch.utils.data import default_collate

    from raymesh.examples import mlp, tinygpt
    from raymesh.train.estimate import estimate, gpu_budget_bytes, probe_activation_bytes
    from raymesh.train.strategy import StrategyPolicy
    from raymesh.train.task import Context

    dev = torch.device("cuda", 0)
    # cuBLAS allocates its workspace at the first matmul and keeps it: do that first, so every
    # model's peak counts from the same baseline (reported on its own).
    (torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)).sum().item()
    budget = gpu_budget_bytes(0)
    r.put(budget_bytes=budget, baseline_bytes=torch.cuda.memory_allocated(dev))
    ctx = Context.alone(device=dev)
    # (build, batch): the batch is what fit gives one rank with its example's default batch
    builds = {"mlp": (mlp.build, 64), "mlp_large": (mlp.build_large, 64)}
    for name, (build, batch_size) in {**builds, "tinygpt": (tinygpt.build, 32)}.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.manual_seed(0)
        task = build(ctx)
        model = task.model.to(dev)
        samples = (task.collate_fn or default_collate)([task.dataset[i] for i in range(batch_size)])
        batch = tuple(t.to(dev) for t in samples)
        activation = probe_activation_bytes(model, task.loss_fn, batch)
        est = estimate(model, task.optimizer, activation)
        for _ in range(args.it["memory_steps"]):
            task.optimizer.zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated(dev)
            loss = task.loss_fn(model, batch)
            held = torch.cuda.memory_allocated(dev) - before  # kept by forward for backward
            loss.backward()
            task.optimizer.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev) - base
        fig = {"estimate": vars(est), "estimate_ddp_bytes": est.ddp_bytes()}
        ratio = round(peak / est.ddp_bytes(), 3)
        fig.update(measured_peak_bytes=peak, measured_over_estimate=ratio)
        fig.update(activation_measured_bytes=held, final_loss=finite(loss.item()))
        fig.update(peak_reserved_bytes=torch.cuda.max_memory_reserved(dev))
        fig.update(auto=StrategyPolicy().decide("auto", est, 1, budget).strategy)
        r.put(**{name: fig})
        del task, model, samples, batch, loss  # back to the baseline for the next model
        torch.cuda.empty_cache()


def finetune_memory(r: Record, args: argparse.Namespace) -> None:
    torch = need_cuda(args)
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from raymesh.examples import tinygpt
    from raymesh.train.config import TrainConfig
    from raymesh.train.rank.measure import estimate_memory
    from raymesh.train.rank.parallelize import parallelize
    from raymesh.train.rank.step import Precision, Share, Timing, run_step
    from raymesh.train.strategy import StrategyDecision

    dev = torch.device("cuda", 0)
    nccl_group(dev)
    try:
        (torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)).sum().item()
        torch.manual_seed(0)
        model = tinygpt.TinyGPT(n_embd=256, n_head=8, n_layer=6).to(dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = tinygpt.CharDataset(block_size=model.block_size)
        batch = tuple(t.to(dev) for t in default_collate([data[i] for i in range(32)]))
        config = TrainConfig(precision="bf16", gpus=True)
        task = type("T", (), {"model": model, "optimizer": optimizer, "loss_fn": tinygpt.lm_loss})
        full, _ = estimate_memory(task, batch, config, dev, 1)  # type: ignore[arg-type]
        est = full.under(checkpointing=True, offload=True)
        decision = StrategyDecision(
            strategy="fsdp", reason="gpu_check", estimate=est, budget_bytes=0,
            checkpointing=True, offload=True,
        )  # fmt: skip
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        model = parallelize(
            model, decision, world_size=1, device=dev, optimizer=optimizer, precision="bf16"
        )
        torch.cuda.reset_peak_memory_stats(dev)
        losses = []
        steps = args.it["memory_steps"]
        step_config = TrainConfig(steps=steps, global_batch_size=32, grad_clip=1.0).step
        for step in range(steps):
            losses.append(
                run_step(
                    model, optimizer, tinygpt.lm_loss,
                    Share(step=step, rank=0, world_size=1, global_batch_size=32,
                          micro=[range(32)], load=lambda _: batch),
                    config=step_config, steps=steps, device=dev, precision=Precision(),
                    timing=Timing(), hooks=None,
                )[0]
            )  # fmt: skip
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
        where = {p.to_local().device.type for p in model.parameters()}
        r.put(losses=[finite(x) for x in losses], params_on=sorted(where))
        r.put(
            estimate=vars(est), estimate_device_bytes=est.fsdp_bytes(1), host_bytes=est.host_bytes
        )
        r.put(measured_peak_bytes=peak, before_wrap_bytes=base)
        r.put(measured_over_estimate=round(peak / max(1, est.fsdp_bytes(1)), 3))
        check(all(math.isfinite(x) for x in losses), f"losses {losses}")
        check(where == {"cpu"}, f"offloaded parameters live on {where}")
    finally:
        dist.destroy_process_group()


def timed(fn: Callable[[int], None], n: int, warmup: int) -> dict[str, float]:
    for i in range(warmup):
        fn(i)
    xs = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        xs.append(time.perf_counter() - t)
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1]
    return {"median_ms": round(statistics.median(xs) * 1e3, 3), "p90_ms": round(p90 * 1e3, 3)}


def spawn_and_messages(r: Record, args: argparse.Namespace) -> None:
    import torch

    from raymesh import Actor, endpoint, this_host
    from raymesh._src import backend

    class Probe(Actor):
        @endpoint
        def ping(self, x: int) -> int:
            return x

        @endpoint
        def sees(self, allocate: bool) -> dict[str, Any]:
            seen: dict[str, Any] = {"cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
            seen.update(cuda=torch.cuda.is_available(), device_count=torch.cuda.device_count())
            if allocate:
                seen["allocation_ok"] = torch.ones(1 << 20, device="cuda").sum().item() == 1 << 20
            return seen

        @endpoint
        def cuda_tensor(self) -> torch.Tensor:
            return torch.arange(4.0, device="cuda")

    t0 = time.perf_counter()
    backend.ensure_ray()  # RAYMESH_WARM_PROCS=16 is in this process's environment already
    r.put(warm_procs=os.environ["RAYMESH_WARM_PROCS"], ray_up_s=round(time.perf_counter() - t0, 2))
    pool = getattr(backend, "pool", None)  # None in a checkout older than the warm pool
    if pool is not None:
        r.put(warm_pool_ready=pool.wait_ready(min(120.0, left(args))))
        r.put(warm_pool_s=round(time.perf_counter() - t0, 2))
    meshes = []
    try:
        t0 = time.perf_counter()
        meshes.append(this_host().spawn_procs(per_host={"procs": 16}, timeout=left(args)))
        r.put(spawn_procs_16_s=round(time.perf_counter() - t0, 2))
        actors = meshes[0].spawn("probe", Probe)
        answered = actors.ping.call(0).get(timeout=left(args)).values()
        r.put(spawn_16_s=round(time.perf_counter() - t0, 2))
        if pool is not None:
            pool.drain()  # the spawn topped the pool up: 16 procs starting would slow the calls
        check(answered == [0] * 16, f"16 answers, got {answered}")
        seen = actors.sees.call(False).get(timeout=left(args)).values()
        r.put(cpu_procs_see=[dict(t) for t in {tuple(s.items()) for s in seen}])
        one = actors.slice(procs=0)

        def call_one(i: int) -> None:
            check(one.ping.call_one(i).get() == i, "call_one reply")

        def call_all(i: int) -> None:
            check(actors.ping.call(i).get().values() == [i] * 16, "call-all replies")

        r.put(call_one=timed(call_one, args.it["call_one"], args.it["warmup"]))
        r.put(call_all_16=timed(call_all, args.it["call_all"], args.it["warmup"]))
        try:
            need_cuda(args)
        except Skipped as e:
            r.put(gpu_proc={"ok": False, "skipped": str(e)})
            return
        t0 = time.perf_counter()
        meshes.append(this_host().spawn_procs(per_host={"gpus": 1}, timeout=left(args)))
        gpu = meshes[1].spawn("probe", Probe)
        sees = gpu.sees.call_one(True).get(timeout=left(args))
        r.put(gpu_proc={"spawn_s": round(time.perf_counter() - t0, 2), **sees})
        try:  # a CUDA tensor as a reply: where (and whether) it arrives is the finding
            t = gpu.cuda_tensor.call_one().get(timeout=left(args))
            reply = f"{type(t).__name__} on {t.device}: {t.tolist()}"
        except Exception as e:
            reply = f"{type(e).__name__}: {e}"[:500]
        r.put(gpu_proc={**r["gpu_proc"], "cuda_tensor_reply": reply})
        check(sees["allocation_ok"] and sees["device_count"] == 1, f"the GPU proc saw {sees}")
        r.put(gpu_proc={**r["gpu_proc"], "ok": True})
    finally:
        for m in meshes:
            with contextlib.suppress(Exception):  # the section's own error stays its error
                m.stop()
        backend.shutdown()


def finetune_fit(r: Record, args: argparse.Namespace) -> None:
    """raymesh.train.fit as a user runs a fine-tune on one GPU: FSDP2 in bf16 with activation
    checkpointing and CPU offload, for TinyGPT (full) and a small HF Llama (LoRA adapter)."""
    need_cuda(args)
    from raymesh import train
    from raymesh._src.backend import ensure_ray, shutdown
    from raymesh.train import hf

    root = Path(args.out + ".finetune")
    model = hf.save_tiny_llama(root / "llama", hidden_size=256, layers=4, heads=8, kv_heads=4)
    text = root / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(4000)))
    jobs = {
        "tinygpt": ("raymesh.examples.tinygpt:build", {}),
        "llama_lora": (
            "raymesh.train.hf:build",
            {"model": str(model), "text": str(text), "block_size": 64, "lora_r": 8},
        ),
    }
    ensure_ray()
    try:
        for name, (build, params) in jobs.items():
            config = train.TrainConfig(
                build=build, params=params, workers=1, gpus=GPU, strategy="fsdp",
                precision="bf16", activation_checkpointing=True, offload=GPU,
                steps=args.it["train_steps"] // 2, global_batch_size=16, report_every=5,
                grad_clip=1.0, timeout_s=left(args),
            )  # fmt: skip
            t0 = time.perf_counter()
            result = train.fit(None, config)
            losses = [h["loss"] for h in result.history]
            fig = {"fit_s": round(time.perf_counter() - t0, 2), "reason": result.decision.reason}
            fig.update(first_loss=finite(losses[0]), final_loss=finite(losses[-1]))
            decision = result.decision
            fig.update(offload=decision.offload, checkpointing=decision.checkpointing)
            r.put(**{name: fig})
            check(decision.offload == GPU and decision.checkpointing, f"{name}: {fig}")
            check(all(math.isfinite(x) for x in losses), f"{name}: losses {losses}")
            check(losses[-1] < losses[0], f"{name}: the loss did not fall: {losses}")
    finally:
        shutdown()


def rl_learner(r: Record, args: argparse.Namespace) -> None:
    """GRPO whose learner is a train job on the GPU (`trainer={"gpus": True}`), its ranks
    noting the device and process group they got; the generators stay CPU procs (generators
    on GPUs are not built: recorded)."""
    need_cuda(args)
    from raymesh import rl
    from raymesh._src.backend import ensure_ray, shutdown

    seen = args.out + ".learner"

    def policy(ctx: Any) -> Any:
        import torch.distributed as dist

        from raymesh.examples import tinygpt

        if dist.is_initialized():  # a learner rank (a generator builds the policy too)
            info = {"device": str(ctx.device), "backend": dist.get_backend()}
            Path(seen).write_text(json.dumps(info))
        return tinygpt.build(ctx)

    ensure_ray()
    try:
        t0 = time.perf_counter()
        result = rl.run(
            policy=policy, prompts=["def ", "for "], reward="raymesh.examples.rewards:python_lines",
            algorithm=rl.GRPO(group_size=4, max_tokens=16), steps=3, prompts_per_step=2,
            generators=1, trainer={"workers": 1, "gpus": True}, timeout_s=left(args),
        )  # fmt: skip
        r.put(run_s=round(time.perf_counter() - t0, 2))
    finally:
        shutdown()
    r.put(learner=json.loads(Path(seen).read_text()), generators="cpu (GPU generators: not built)")
    r.put(rewards=[finite(h["reward_mean"]) for h in result.history], version=result.version)
    check(r["learner"]["device"].startswith("cuda"), f"the learner ran on {r['learner']['device']}")
    check(r["learner"]["backend"] == "nccl", f"the learner's backend is {r['learner']['backend']}")
    check(result.version == 3, f"version {result.version}")


# name: (function, its own time limit in seconds, skipped at once without CUDA, environment).
# A trainer is a GPU proc, which never comes from the warm pool (pool.py): warm CPU procs would
# only compete with its start.
NO_POOL = {"RAYMESH_WARM_PROCS": "0"}
SECTIONS: dict[str, tuple[Callable[[Record, Any], None], float, bool, dict[str, str]]] = {
    "env": (env, 30, False, {}),
    "nvml": (nvml, 20, False, {}),
    "nccl": (nccl, 45, True, {}),
    "train_ddp": (train_section("ddp"), 75, True, NO_POOL),
    "train_fsdp": (train_section("fsdp"), 75, True, NO_POOL),
    "memory_estimate": (memory_estimate, 45, True, {}),
    "finetune_memory": (finetune_memory, 45, True, {}),
    "finetune_fit": (finetune_fit, 90, True, NO_POOL),
    "rl_learner": (rl_learner, 90, True, NO_POOL),
    "spawn_and_messages": (spawn_and_messages, 150, False, {"RAYMESH_WARM_PROCS": "16"}),
}


def run_section(args: argparse.Namespace) -> NoReturn:
    """In the section's own process: run it, record how it ended, exit at once."""
    args.deadline = time.monotonic() + args.timeout
    r = Record(args.out)
    try:
        SECTIONS[args.section][0](r, args)
        r.put(ok=True)
    except Skipped as e:
        r.put(ok=False, skipped=str(e))
    except Exception as e:
        traceback.print_exc()
        r.put(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    sys.stderr.flush()
    os._exit(0)  # Ray's and NCCL's threads may hold up a normal exit; the parent kills the rest


def run_child(name: str, timeout: float, args: argparse.Namespace, td: str) -> dict[str, Any]:
    out = os.path.join(td, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--out", out]
    cmd += ["--timeout", f"{timeout:.1f}", "--no-cuda", args.no_cuda] + ["--quick"] * args.quick
    # A Ray temp dir of our own: never another Ray's on this machine, and gone with `td`.
    env = {**os.environ, "RAY_TMPDIR": td, **SECTIONS[name][3]}
    log(f"{name}: starting, up to {timeout:.0f} s")
    t0 = time.monotonic()
    rc = run_isolated(cmd, env, timeout)
    res = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if "ok" not in res:
        why = f"ran past its {timeout:.0f} s and was killed" if rc is None else f"exited with {rc}"
        res.update(ok=False, error=why)
    res = {"ok": res.pop("ok"), "seconds": round(time.monotonic() - t0, 2), **res}
    log(f"{name}: {'ok' if res['ok'] else res.get('skipped') or res.get('error')}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and calls (smoke run)")
    ap.add_argument("--budget", type=float, default=280.0, help="global deadline, seconds")
    for internal in ("--section", "--out", "--timeout", "--no-cuda"):  # a section's process
        ap.add_argument(internal, default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.it = ITERATIONS["quick" if args.quick else "full"]
    if args.section:
        args.timeout = float(args.timeout)
        run_section(args)
    sections: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_", ignore_cleanup_errors=True) as td:
        for i, (name, (_, budget_s, gpu, _)) in enumerate(SECTIONS.items()):
            remaining = args.budget - (time.monotonic() - T0)
            later = sum(not (s[2] and args.no_cuda) for s in list(SECTIONS.values())[i + 1 :])
            if gpu and args.no_cuda:
                sections[name] = {"ok": False, "seconds": 0.0, "skipped": args.no_cuda}
            elif remaining < FLOOR_S:
                why = f"budget spent: {remaining:.0f} s of --budget {args.budget:g} s left"
                sections[name] = {"ok": False, "seconds": 0.0, "skipped": why}
            else:  # leave the sections after this one FLOOR_S each, where that is possible
                timeout = min(budget_s, remaining, max(FLOOR_S, remaining - FLOOR_S * later))
                sections[name] = run_child(name, timeout, args, td)
            if name == "env":
                args.no_cuda = sections[name].get("no_cuda", "")
    seconds = round(time.monotonic() - T0, 2)
    report = {"check": "gpu", "quick": args.quick, "budget_s": args.budget, "seconds": seconds}
    print(json.dumps({**report, "iterations": args.it, "sections": sections}), flush=True)


if __name__ == "__main__":
    main()
