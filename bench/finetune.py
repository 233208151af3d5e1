"""Fine-tuning benchmark: raymesh.train vs the Hugging Face Trainer (transformers + accelerate,
DDP under torchrun), full fine-tune and LoRA, in one run.

    python bench/finetune.py              # full run: 60 steps per side and mode (~6 min here)
    python bench/finetune.py --quick      # smoke run: 8 steps (steady window 4..8), ~1.5 min
    python bench/finetune.py --only lora --steps 40 --precision fp32
    python bench/finetune.py --quick --side raymesh   # one side only (no comparison)
    python bench/finetune.py --save       # also write bench/results/finetune.json

The job, the same for both sides: a Llama of hidden 256, 4 layers, 8 heads (4 key/value heads),
intermediate 688 with a byte-level tokenizer (`raymesh.train.hf.save_tiny_llama`, seed 0),
trained on pydoc_data's topics text packed into blocks of 256 tokens (`raymesh.train.hf.build`;
the last 5 % of blocks are the eval set), 2 ranks x 8 blocks (global batch 16), AdamW (lr 3e-4
full, 1e-3 LoRA r=8 alpha=16 on q_proj/v_proj; weight decay 0), constant learning rate, no
warm-up, gradients clipped at norm 1.0, CPU, gloo on 127.0.0.1, one torch thread per rank.
Precision (`--precision auto`): bf16 autocast where the CPU computes bf16 natively (avx512_bf16
or amx_bf16 in /proc/cpuinfo), else fp32: without them torch's CPU autocast converts to and from
bf16 around every matmul, and a forward + backward of this job took ~15x as long as in fp32 on
the 2-core AMD EPYC this was written on (12 s vs 0.8 s). `--precision bf16` forces it.
Both sides train on the very same blocks in the very same order from the very same initial weights:
- the parent runs `raymesh.train.hf.build` once per mode (seeded as a raymesh rank seeds it)
  and hands the Trainer side its train and eval blocks and the model's initial state dict
  (LoRA's random A matrices included); the Trainer side checks its parameter sum against what
  raymesh's ranks built (`same_init`);
- the Trainer's train dataset is the blocks laid out in raymesh's global order
  (`raymesh.data.order.global_batch`, the order raymesh's ranks read), read sequentially
  (`train_sampling_strategy="sequential"`): accelerate hands each rank its contiguous half of
  each global batch, as raymesh does.
So the loss curves differ only by arithmetic (reduction order, fused vs foreach AdamW, the
Trainer's token-count loss normalisation), and the eval losses agree far inside the 2 % target
(0.1 % in the smoke runs).

The Trainer side: `python -m torch.distributed.run --standalone --nproc-per-node 2` this script
with `--hf-rank`, TrainingArguments(use_cpu=True, ddp_backend="gloo", bf16=..., max_steps=N,
per_device_train_batch_size=8, lr_scheduler_type="constant", max_grad_norm=1.0, the default
optimizer (adamw_torch_fused; raymesh.train.hf.build's is torch's AdamW, foreach: in the smoke
runs the fused one took ~30-40 ms off the Trainer's 0.85 s full fine-tune step),
dataloader_num_workers=0, report_to="none", save_strategy="no",
logging_strategy="no", disable_tqdm=True), and ddp_find_unused_parameters=False: the Trainer's
default for a PEFT model (and any model not a PreTrainedModel) is True, a graph walk every step
that this job does not need, so the anchor runs at its best. Eval loss: `trainer.evaluate()`
after training (the mean over the eval batches, under the same autocast).
The raymesh side, in a fresh python of its own (its own Ray temp dir): `train.fit(build,
TrainConfig(workers=2, steps=N, global_batch_size=16, strategy="ddp", precision=...,
activation_checkpointing=False, grad_clip=1.0, lr_schedule="constant", warmup_steps=0,
eval_every=N, cpus_per_worker=1, step_timeout_s=300, params=...))`, where `build` is
`raymesh.train.hf.build` with each rank noting its pid, its RSS before the build and its
parameter sum. Eval loss: the history's `eval_loss` at step N. (step_timeout_s: the first chunk
has no measured step time, so its hang timeout is that floor, 30 s by default, for the whole
chunk; a slow step, e.g. bf16 on this CPU, would count as a hang.)

Measures, per mode and side:
- steady tokens/s: (N - W) * 16 * 256 / (t[N] - t[W]), t[s] the wall time step s ended
  (raymesh: the history's `end`, every rank done, stamped before its evaluation; the Trainer:
  rank 0's `on_step_end`), W the warm-up steps skipped (10; 3 with --quick).
- peak memory per rank: VmHWM of each rank's process (the Trainer's ranks read their own after
  evaluate(); raymesh's are read from /proc every 0.2 s by the parent of fit(), until fit
  returns: the high-water mark only grows). Both include the process's own runtime (python,
  torch, transformers; raymesh's ranks also Ray's worker and what raymesh preloads), so the
  growth over the RSS before the build is recorded too (`growth_mb`: model, data, optimizer,
  activations, DDP buckets, allocator slack), and the RSS right after the build. Before the
  baseline both sides have imported transformers (and peft for LoRA). raymesh's side also keeps
  its ranks' VmRSS about once a second (`rss_timeline_mb`, on the clock of `step_end_s`), to
  show where the memory goes: setup (its activation probes), the steps, the evaluation.
- eval loss after N steps, both sides, and raymesh's over the Trainer's.
- raymesh's memory estimate (`Result.decision.estimate`, the per-rank bytes its strategy decision
  used; DDP: `ddp_bytes()`) over the measured peak growth of its ranks (and over the whole RSS).
Targets (printed pass/fail): tokens/s >= 1.05x the Trainer's; peak RSS <= the Trainer's (the
larger rank of each); eval loss within 2 %; estimate within 15 % of the measured peak growth.
Order: full then LoRA; the Trainer first in full, raymesh first in LoRA (drift hits both). The
load average is recorded before and after. Progress and the table go to stderr, one JSON object
to stdout. `--child JSON` and `--hf-rank JSON` (internal) run one side.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolated import run_isolated

ROOT = Path(__file__).resolve().parents[1]
WORKERS, SEED = 2, 0
MODEL = dict(
    hidden_size=256, layers=4, heads=8, kv_heads=4, intermediate_size=688, max_position=512
)
BLOCK, GLOBAL_BATCH, EVAL_FRACTION, GRAD_CLIP = 256, 16, 0.05, 1.0
MODES: dict[str, dict[str, Any]] = {
    "full": {"lora_r": 0, "lr": 3e-4},
    "lora": {"lora_r": 8, "lora_alpha": 16, "lora_targets": ["q_proj", "v_proj"], "lr": 1e-3},
}
TOKENS_MIN, MEMORY_MAX, EVAL_LOSS_TOL, ESTIMATE_TOL = 1.05, 1.0, 0.02, 0.15
CHILD_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's node address: 127.0.0.1
    "GLOO_SOCKET_IFNAME": "lo",
    "HF_HUB_OFFLINE": "1",  # everything is local: never ask the Hub
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars too
}


def log(msg: str) -> None:
    print(f"[finetune-bench] {msg}", file=sys.stderr, flush=True)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB figures of /proc/<pid>/status (VmRSS, VmHWM, ...); {} once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0])
    return out


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def param_sum(model: Any) -> float:
    """Every parameter summed in float64: equal on both sides iff they start from the same
    weights (to rounding)."""
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    return float(sum(p.detach().double().sum().item() for p in local))


# ---- the Trainer side: one torchrun rank -----------------------------------------------------
def hf_rank(spec: dict[str, Any]) -> None:
    """One rank of the Hugging Face Trainer anchor (run by torchrun). Rank 0 writes the step
    stamps and the eval loss to `out`.json; every rank its pid, RSS and parameter sum to
    `out`.rank<r>."""
    import torch

    torch.set_num_threads(1)
    from torch.utils.data import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    rank = int(os.environ["RANK"])
    p = spec["params"]
    if p["lora_r"]:
        from peft import LoraConfig, get_peft_model
    rss_before = proc_status()["VmRSS"]
    data = torch.load(spec["data"], weights_only=True)
    # As raymesh.train.hf.load_causal_lm loads it: fp32, no KV cache, LoRA on the named targets.
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], local_files_only=True, dtype=torch.float32
    )
    model.config.use_cache = False
    if p["lora_r"]:
        lora = LoraConfig(
            r=p["lora_r"], lora_alpha=p["lora_alpha"], lora_dropout=0.0,
            target_modules=list(p["lora_targets"]), task_type="CAUSAL_LM",
        )  # fmt: skip
        model = get_peft_model(model, lora)
    # raymesh's initial weights (LoRA's A matrices drawn as its ranks drew them)
    model.load_state_dict(torch.load(spec["init"], weights_only=True), strict=True)
    init_sum = param_sum(model)
    rss_after = proc_status()["VmRSS"]

    class Blocks(Dataset):
        """`blocks[order[i]]`: raymesh's global order, read front to back."""

        def __init__(self, blocks: torch.Tensor, order: torch.Tensor | None = None) -> None:
            self.blocks, self.order = blocks, order

        def __len__(self) -> int:
            return len(self.blocks if self.order is None else self.order)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.blocks[i if self.order is None else int(self.order[i])]

    def collate(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        x = torch.stack(blocks)
        return {"input_ids": x, "labels": x}

    class Stamps(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t.append(time.time())

    per_rank = spec["global_batch"] // WORKERS
    args = TrainingArguments(
        output_dir=os.path.join(spec["dir"], "hf_out"),
        max_steps=spec["steps"],
        per_device_train_batch_size=per_rank,
        per_device_eval_batch_size=per_rank,
        learning_rate=p["lr"],
        weight_decay=p["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=GRAD_CLIP,
        bf16=spec["precision"] == "bf16",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        seed=SEED,
        label_names=["labels"],
        prediction_loss_only=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    stamps = Stamps()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Blocks(data["train"], data["order"]),
        eval_dataset=Blocks(data["eval"]),
        data_collator=collate,
        callbacks=[stamps],
    )
    t0 = time.time()
    train_out = trainer.train()
    t_train = time.time() - t0
    metrics = trainer.evaluate()
    status = proc_status()
    mine = {
        "pid": os.getpid(),
        "rss_before_build_kb": rss_before,
        "rss_after_build_kb": rss_after,
        "vmhwm_kb": status["VmHWM"],
        "init_sum": init_sum,
    }
    Path(f"{spec['out']}.rank{rank}").write_text(json.dumps(mine))
    if rank == 0:
        Path(spec["out"] + ".json").write_text(json.dumps({
            "stamps": stamps.t,
            "eval_loss": metrics["eval_loss"],
            "train_s": t_train,
            "train_metrics": train_out.metrics,
            "eval_metrics": metrics,
            "accelerate_state": str(trainer.accelerator.state).strip().splitlines(),
        }))  # fmt: skip
    # Everything is written: skip the interpreter's teardown, where a rank can abort in gloo's
    # threads ("terminate called without an active exception") or wait on them for ever, and
    # the run would count as failed though it finished.
    sys.stdout.flush()
    os._exit(0)


def hf_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The Trainer side: torchrun over 2 ranks of this script, then what they wrote."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORKERS}", os.path.abspath(__file__), "--hf-rank", json.dumps(spec),
    ]  # fmt: skip
    t0 = time.time()
    rc = run_isolated(cmd, dict(os.environ), spec["timeout"])
    if rc != 0:
        why = f"ran past {spec['timeout']:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"HF Trainer ({spec['mode']}) {why}")
    wall = time.time() - t0
    out = json.loads(Path(spec["out"] + ".json").read_text())
    ranks = [json.loads(Path(f"{spec['out']}.rank{r}").read_text()) for r in range(WORKERS)]
    return {
        **side_figures(spec, out["stamps"], out["eval_loss"], ranks),
        "wall_s": round(wall, 2),
        "train_metrics": out["train_metrics"],
        "accelerate_state": out["accelerate_state"],
    }


# ---- the raymesh side ------------------------------------------------------------------------
def measured_build(out: str, ctx: Any) -> Any:
    """raymesh.train.hf.build, with the rank noting its pid, its RSS before the build and its
    initial parameter sum in `out`.rank<r> (shipped to the ranks by value from __main__)."""
    import transformers  # noqa: F401  (loaded before the baseline, as on the Trainer side)

    if ctx.params.get("lora_r"):
        import peft  # noqa: F401
    from raymesh.train import hf

    rss_before = proc_status()["VmRSS"]
    task = hf.build(ctx)  # on the meta device: the weights are read once it is wrapped
    mine = {
        "pid": os.getpid(),
        "rss_before_build_kb": rss_before,
        "rss_after_build_kb": proc_status()["VmRSS"],
    }
    Path(f"{out}.rank{ctx.rank}").write_text(json.dumps(mine))
    fill = task.init_weights
    assert fill is not None

    def noted(model: Any) -> None:  # the initial weights, as read (a shard under FSDP)
        fill(model)
        mine["init_sum"] = param_sum(model)
        Path(f"{out}.rank{ctx.rank}").write_text(json.dumps(mine))

    task.init_weights = noted
    return task


def mesh_config(spec: dict[str, Any]) -> Any:
    from raymesh import train

    steps = spec["steps"]
    return train.TrainConfig(
        workers=WORKERS, steps=steps, global_batch_size=spec["global_batch"], seed=SEED,
        strategy=spec.get("strategy", "ddp"), precision=spec["precision"],
        activation_checkpointing=spec.get("activation_checkpointing", False),
        memory_budget_gb=spec.get("memory_budget_gb"),
        grad_clip=GRAD_CLIP, lr_schedule="constant", warmup_steps=0, eval_every=steps,
        cpus_per_worker=1.0, report_every=spec["report_every"], params=spec["params"],
        # The first chunk has no measured step time, so its hang timeout is this floor for the
        # whole chunk (30 s by default): bf16 on a CPU without native bf16 takes ~12 s a step.
        step_timeout_s=300.0,
    )  # fmt: skip


def raymesh_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One raymesh fit in this (fresh) python; its ranks' VmHWM polled from /proc meanwhile."""
    import dataclasses
    import logging

    from raymesh import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    peaks: dict[int, int] = {}
    timeline: list[list[float]] = []  # [s since fit(), each rank's VmRSS MB], about 1 a second
    done = threading.Event()
    t0 = time.time()

    def poll() -> None:
        rss = []
        for r in range(WORKERS):
            f = Path(f"{spec['out']}.rank{r}")
            status = proc_status(json.loads(f.read_text())["pid"]) if f.exists() else {}
            peaks[r] = max(peaks.get(r, 0), status.get("VmHWM", 0))
            rss.append(round(status.get("VmRSS", 0) / 1024, 1))
        if any(rss) and (not timeline or time.time() - t0 >= timeline[-1][0] + 1.0):
            timeline.append([round(time.time() - t0, 1), *rss])

    def watch() -> None:  # VmHWM is a high-water mark: a read a second misses no peak
        while not done.wait(1.0):
            poll()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    config = mesh_config(spec)
    result = train.fit(functools.partial(measured_build, spec["out"]), config)
    poll()
    done.set()
    watcher.join()
    ends = {int(h["step"]): h["end"] for h in result.history}
    stamps = [ends[s] for s in range(1, spec["steps"] + 1)]
    evals = [h["eval_loss"] for h in result.history if h.get("eval_loss") is not None]
    ranks = [json.loads(Path(f"{spec['out']}.rank{r}").read_text()) for r in range(WORKERS)]
    for r, mine in enumerate(ranks):
        mine["vmhwm_kb"] = peaks.get(r, 0)
    decision = result.decision
    estimate = decision.estimate
    return {
        **side_figures(spec, stamps, evals[-1] if evals else None, ranks),
        "fit_s": round(time.time() - t0, 2),
        "step_end_s": [round(t - t0, 1) for t in stamps],  # on the timeline's clock
        "rss_timeline_mb": timeline,
        "final_train_loss": result.history[-1]["loss"],
        "strategy": decision.strategy,
        "decision_reason": decision.reason,
        "estimate": {**dataclasses.asdict(estimate), "ddp_bytes": estimate.ddp_bytes()},
        "estimate_bytes": estimate.ddp_bytes() if decision.strategy == "ddp"
        else estimate.fsdp_bytes(WORKERS),
    }  # fmt: skip


# ---- figures, the report ---------------------------------------------------------------------
def side_figures(
    spec: dict[str, Any], stamps: list[float], eval_loss: float | None, ranks: list[dict]
) -> dict[str, Any]:
    """Steady tokens/s over steps W+1..N, per-rank peak RSS and growth, eval loss."""
    n, w = spec["steps"], spec["warmup"]
    seconds = stamps[n - 1] - stamps[w - 1]  # step N's end minus step W's
    tokens = (n - w) * spec["global_batch"] * spec["params"]["block_size"]
    mb = 1 / 1024
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "steady_window": [w + 1, n],
        "step_s": [round(b - a, 3) for a, b in itertools.pairwise(stamps)],
        "eval_loss": None if eval_loss is None else round(eval_loss, 5),
        "peak_rss_mb": [round(r["vmhwm_kb"] * mb, 1) for r in ranks],
        "rss_before_build_mb": [round(r["rss_before_build_kb"] * mb, 1) for r in ranks],
        "rss_after_build_mb": [round(r["rss_after_build_kb"] * mb, 1) for r in ranks],
        "growth_mb": [round((r["vmhwm_kb"] - r["rss_before_build_kb"]) * mb, 1) for r in ranks],
        "init_sum": [r["init_sum"] for r in ranks],
        "pids": [r["pid"] for r in ranks],
    }


def compare(hf: dict[str, Any], mesh: dict[str, Any]) -> dict[str, Any]:
    """raymesh over the Trainer, and each target met or not."""
    out: dict[str, Any] = {
        "tokens_per_s_ratio": round(mesh["tokens_per_s"] / hf["tokens_per_s"], 3),
        "peak_rss_ratio": round(max(mesh["peak_rss_mb"]) / max(hf["peak_rss_mb"]), 3),
        "growth_ratio": round(max(mesh["growth_mb"]) / max(hf["growth_mb"]), 3),
        "same_init": all(
            abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a in mesh["init_sum"] for b in hf["init_sum"]
        ),
    }
    if mesh["eval_loss"] is not None and hf["eval_loss"] is not None:
        out["eval_loss_ratio"] = round(mesh["eval_loss"] / hf["eval_loss"], 4)
    est_mb = mesh["estimate_bytes"] / (1 << 20)
    out["estimate_mb"] = round(est_mb, 1)
    out["estimate_over_peak_growth"] = round(est_mb / max(mesh["growth_mb"]), 3)
    out["estimate_over_peak_rss"] = round(est_mb / max(mesh["peak_rss_mb"]), 3)
    ratio = out.get("eval_loss_ratio")
    out["targets"] = {
        f"tokens_per_s >= {TOKENS_MIN}x HF": out["tokens_per_s_ratio"] >= TOKENS_MIN,
        "peak RSS <= HF's": out["peak_rss_ratio"] <= MEMORY_MAX,
        f"eval loss within {EVAL_LOSS_TOL:.0%}": ratio is not None
        and abs(ratio - 1) <= EVAL_LOSS_TOL,
        f"estimate within {ESTIMATE_TOL:.0%} of peak growth": abs(
            out["estimate_over_peak_growth"] - 1
        ) <= ESTIMATE_TOL,
    }  # fmt: skip
    return out


def table(res: dict[str, Any]) -> str:
    """The figures and targets, as text."""
    lines = [f"{'mode':5s} {'side':8s} {'tokens/s':>9s} {'peak RSS MB':>15s} "
             f"{'growth MB':>13s} {'eval loss':>9s}"]  # fmt: skip
    for mode, run in res["runs"].items():
        for side in ("hf_trainer", "raymesh"):
            s = run.get(side)
            if s is None:
                if side + "_error" in run:
                    lines.append(f"{mode:5s} {side:8s} failed: {run[side + '_error']}")
                continue
            rss = "/".join(f"{x:.0f}" for x in s["peak_rss_mb"])
            growth = "/".join(f"{x:.0f}" for x in s["growth_mb"])
            loss = "-" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"
            lines.append(f"{mode:5s} {side:8s} {s['tokens_per_s']:9.1f} {rss:>15s} "
                         f"{growth:>13s} {loss:>9s}")  # fmt: skip
        c = run.get("compare")
        if c:
            lines.append(
                f"      raymesh/HF: tokens/s {c['tokens_per_s_ratio']}x, peak RSS "
                f"{c['peak_rss_ratio']}x, growth {c['growth_ratio']}x, eval loss "
                f"{c.get('eval_loss_ratio')}x; estimate {c['estimate_mb']} MB = "
                f"{c['estimate_over_peak_growth']}x peak growth "
                f"({c['estimate_over_peak_rss']}x peak RSS); same init: {c['same_init']}"
            )
            for name, met in c["targets"].items():
                lines.append(f"      {'PASS' if met else 'FAIL'}  {name}")
    return "\n".join(lines)


def prepare(td: Path, modes: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """The model folder; per mode the build's params, its initial weights and the data as the
    Trainer side reads them (train blocks, eval blocks, raymesh's order for `steps` steps)."""
    import torch

    from raymesh.data import order
    from raymesh.train import hf
    from raymesh.train.materialize import materialize
    from raymesh.train.task import Context

    model = hf.save_tiny_llama(td / "model", **MODEL, seed=SEED)
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        params = {
            "model": str(model), "block_size": BLOCK, "eval_fraction": EVAL_FRACTION,
            "weight_decay": 0.0, **MODES[mode],
        }  # fmt: skip
        torch.manual_seed(SEED)  # as a raymesh rank seeds its build
        ctx = Context(rank=0, world_size=WORKERS, local_rank=0, local_world_size=WORKERS,
                      device=torch.device("cpu"), seed=SEED,
                      config=argparse.Namespace(params=params))  # fmt: skip
        task = hf.build(ctx)
        materialize(task.model, torch.device("cpu"), task.init_weights, task.optimizer)
        n = len(task.dataset)
        plan = [i for s in range(steps) for i in order.global_batch(SEED, s, GLOBAL_BATCH, n)]
        data = {
            "train": torch.stack([task.dataset[i] for i in range(n)]),
            "eval": torch.stack([task.eval_dataset[i] for i in range(len(task.eval_dataset))]),
            "order": torch.tensor(plan),
        }
        torch.save(data, td / f"data_{mode}.pt")
        torch.save(task.model.state_dict(), td / f"init_{mode}.pt")
        trainable = sum(p.numel() for p in task.model.parameters() if p.requires_grad)
        out[mode] = {
            "params": params,
            "data": str(td / f"data_{mode}.pt"),
            "init": str(td / f"init_{mode}.pt"),
            "blocks": {"train": n, "eval": len(task.eval_dataset)},
            "parameters": sum(p.numel() for p in task.model.parameters()),
            "trainable": trainable,
        }
        log(f"{mode}: {out[mode]['parameters']:,} parameters ({trainable:,} trained), "
            f"{n} train / {len(task.eval_dataset)} eval blocks of {BLOCK}")  # fmt: skip
    return out


def fits_run(td: Path, steps: int, warmup: int, precision: str, timeout: float) -> dict:
    """A full fine-tune whose fp32 DDP estimate is 3x the per-rank budget (a model of 8 blocks,
    `memory_budget_gb` set to a third of it), with the plan `strategy="auto"` and
    `activation_checkpointing="auto"` choose; raymesh only (the Trainer has no planner). Its
    figures: the plan and its reason, the estimate under the plan against the budget, each
    rank's peak RSS growth against the budget."""
    import torch
    from torch.utils.data import default_collate

    from raymesh.train import Context, TrainConfig, hf
    from raymesh.train.rank.measure import estimate_memory

    model = hf.save_tiny_llama(td / "model8", **{**MODEL, "layers": 8}, seed=SEED)
    params = {"model": str(model), "block_size": BLOCK, "eval_fraction": EVAL_FRACTION,
              "weight_decay": 0.0, **MODES["full"]}  # fmt: skip
    config = TrainConfig(workers=WORKERS, global_batch_size=GLOBAL_BATCH, params=params)
    torch.manual_seed(SEED)
    ctx = Context(rank=0, world_size=WORKERS, local_rank=0, local_world_size=WORKERS,
                  device=torch.device("cpu"), seed=SEED, config=config)  # fmt: skip
    task = hf.build(ctx)
    share = GLOBAL_BATCH // WORKERS
    batch = default_collate([task.dataset[i] for i in range(share)])
    full, _ = estimate_memory(task, batch, config, torch.device("cpu"), WORKERS)
    budget = full.ddp_bytes() / 3
    spec = {
        "mode": "fits", "side": "raymesh", "steps": steps, "warmup": warmup,
        "global_batch": GLOBAL_BATCH, "precision": precision, "params": params,
        "model": str(model), "dir": str(td), "out": str(td / "raymesh_fits"),
        "timeout": timeout, "report_every": min(5, steps), "strategy": "auto",
        "activation_checkpointing": "auto", "memory_budget_gb": budget / (1 << 30),
    }  # fmt: skip
    log(f"fits: fp32 ddp estimate {full.ddp_bytes() / (1 << 20):.1f} MB, budget a third: "
        f"{budget / (1 << 20):.1f} MB per rank")  # fmt: skip
    got = run_side("raymesh", spec)
    growth = max(got["growth_mb"])
    return {
        "fp32_ddp_estimate_mb": round(full.ddp_bytes() / (1 << 20), 1),
        "budget_mb": round(budget / (1 << 20), 1),
        "plan": got["strategy"], "reason": got["decision_reason"],
        "estimate_under_plan_mb": round(got["estimate_bytes"] / (1 << 20), 1),
        "peak_growth_mb": got["growth_mb"], "peak_growth_over_budget": round(
            growth / (budget / (1 << 20)), 3),
        "steps": steps, "tokens_per_s": got["tokens_per_s"], "eval_loss": got["eval_loss"],
    }  # fmt: skip


def heal_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One raymesh fit of the small model with rank 1 SIGKILLed mid-run: its recovery."""
    from raymesh import train
    from raymesh.testing import kill

    config = train.TrainConfig(
        workers=WORKERS, steps=16, global_batch_size=8, seed=SEED, report_every=2,
        strategy="ddp", precision=spec["precision"],
        activation_checkpointing=spec["activation_checkpointing"],
        faults=[kill(rank=1, at_step=9)], params=spec["params"], step_timeout_s=300.0,
    )  # fmt: skip
    result = train.fit("raymesh.train.hf:build", config)
    [failure] = result.failures
    ends = [h["end"] for h in result.history]
    steps = sorted(b - a for a, b in itertools.pairwise(ends))
    return {
        "recovery_s": round(failure.recovery_s, 3),
        "steps_recomputed": failure.steps_recomputed,
        "median_step_s": round(steps[len(steps) // 2], 4),
    }


def heal_run(td: Path, timeout: float) -> dict[str, Any]:
    """Kill to first step again, DDP: the small Llama (hidden 64, 2 blocks, blocks of 64
    tokens) full in fp32, against LoRA in bf16 with activation checkpointing."""
    from raymesh.train import hf

    model = hf.save_tiny_llama(td / "model_small", seed=SEED)
    base = {"model": str(model), "block_size": 64, "eval_fraction": 0.0}
    out: dict[str, Any] = {}
    for name, extra in {
        "fp32_full": {"precision": "fp32", "activation_checkpointing": False, "lora_r": 0},
        "bf16_lora_checkpointed": {"precision": "bf16", "activation_checkpointing": True,
                                   "lora_r": 8},
    }.items():  # fmt: skip
        spec = {"heal": True, "precision": extra["precision"], "dir": str(td),
                "activation_checkpointing": extra["activation_checkpointing"],
                "params": {**base, "lora_r": extra["lora_r"]}, "out": str(td / f"heal_{name}"),
                "timeout": timeout, "mode": f"heal {name}"}  # fmt: skip
        out[name] = run_side("raymesh", spec)
        log(f"heal {name}: recovered in {out[name]['recovery_s']} s")
    out["ratio"] = round(
        out["bf16_lora_checkpointed"]["recovery_s"] / out["fp32_full"]["recovery_s"], 3
    )
    return out


def run_side(side: str, spec: dict[str, Any]) -> dict[str, Any]:
    if side == "hf_trainer":
        return hf_child(spec)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    # Our own Ray temp dir: never join another Ray on this machine.
    env = {**os.environ, "RAY_TMPDIR": spec["dir"]}
    t0 = time.time()
    rc = run_isolated(cmd, env, spec["timeout"])
    if rc != 0:
        why = f"ran past {spec['timeout']:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"raymesh ({spec['mode']}) {why}")
    result: dict[str, Any] = json.loads(Path(spec["out"] + ".json").read_text())
    return {**result, "wall_s": round(time.time() - t0, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 steps, warm-up 3 (a smoke run)")
    p.add_argument("--steps", type=int, help="steps per run (default 60; 8 with --quick)")
    p.add_argument("--only", choices=sorted(MODES), help="one mode only")
    p.add_argument("--side", choices=["hf_trainer", "raymesh"], help="one side only")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 where the CPU has native bf16, else fp32")  # fmt: skip
    p.add_argument("--save", action="store_true", help="write bench/results/finetune.json")
    p.add_argument("--no-fits", action="store_true", help="skip the 3x-over-budget run")
    p.add_argument("--fits-only", action="store_true", help="only the 3x-over-budget run")
    p.add_argument("--heal-only", action="store_true", help="only the kill-to-first-step runs")
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec: the raymesh side
    p.add_argument("--hf-rank", help=argparse.SUPPRESS)  # JSON spec: a torchrun rank
    args = p.parse_args()
    if args.hf_rank:
        hf_rank(json.loads(args.hf_rank))
        return
    if args.child:
        spec = json.loads(args.child)
        child = heal_child if spec.get("heal") else raymesh_child
        Path(spec["out"] + ".json").write_text(json.dumps(child(spec)))
        return

    import torch
    import transformers

    import raymesh

    steps = args.steps or (8 if args.quick else 60)
    warmup = 3 if args.quick else 10
    if steps < warmup + 3:
        p.error(f"--steps {steps}: needs at least {warmup + 3} (warm-up {warmup}, then 2 timed)")
    alone = args.fits_only or args.heal_only
    modes = [] if alone else [args.only] if args.only else list(MODES)
    native = native_bf16()
    precision = args.precision if args.precision != "auto" else "bf16" if native else "fp32"
    os.environ.update(CHILD_ENV)
    res: dict[str, Any] = {
        "bench": "finetune",
        "mode": "quick" if args.quick else "full",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "config": {
            "model": {"kind": "llama", **MODEL}, "block_size": BLOCK,
            "global_batch_size": GLOBAL_BATCH, "ranks": WORKERS, "steps": steps,
            "warmup_steps_skipped": warmup, "precision": precision,
            "cpu_native_bf16": native, "grad_clip": GRAD_CLIP,
            "eval_fraction": EVAL_FRACTION, "modes": {m: MODES[m] for m in modes},
            "threads_per_rank": 1, "device": "cpu, gloo on 127.0.0.1",
        },
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "raymesh": raymesh.__version__,
            "cpus": os.cpu_count(),
        },
        "runs": {},
    }  # fmt: skip
    for name in ("accelerate", "peft", "ray"):
        try:
            res["versions"][name] = __import__(name).__version__
        except ImportError:
            pass
    timeout = 300.0 + 20.0 * steps
    with tempfile.TemporaryDirectory(prefix="bench_finetune_", ignore_cleanup_errors=True) as t:
        td = Path(t)
        prepared = prepare(td, modes, steps)
        for i, mode in enumerate(modes):
            prep = prepared[mode]
            run: dict[str, Any] = {k: prep[k] for k in ("blocks", "parameters", "trainable")}
            sides = ["hf_trainer", "raymesh"] if i % 2 == 0 else ["raymesh", "hf_trainer"]
            sides = [s for s in sides if args.side in (None, s)]
            for side in sides:
                spec = {
                    "mode": mode, "side": side, "steps": steps, "warmup": warmup,
                    "global_batch": GLOBAL_BATCH, "precision": precision,
                    "params": prep["params"], "model": prep["params"]["model"],
                    "data": prep["data"], "init": prep["init"], "dir": str(td),
                    "out": str(td / f"{side}_{mode}"), "timeout": timeout,
                    "report_every": min(5, steps),
                }  # fmt: skip
                log(f"{mode}: {side} ...")
                try:
                    run[side] = run_side(side, spec)
                    run[side]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
                    s = run[side]
                    log(f"{mode}: {side}: {s['tokens_per_s']} tokens/s, peak RSS "
                        f"{s['peak_rss_mb']} MB, eval loss {s['eval_loss']}")  # fmt: skip
                except Exception as e:  # keep the other side's figures
                    run[side + "_error"] = f"{type(e).__name__}: {e}"
                    log(f"{mode}: {side} failed: {e}")
            if "hf_trainer" in run and "raymesh" in run:
                run["compare"] = compare(run["hf_trainer"], run["raymesh"])
            res["runs"][mode] = run
        if (
            not args.heal_only
            and not args.no_fits
            and args.side in (None, "raymesh")
            and not args.only
        ):
            try:
                res["fits"] = fits_run(td, steps, warmup, precision, timeout)
                f = res["fits"]
                log(f"fits: plan {f['reason']}; peak growth {f['peak_growth_mb']} MB = "
                    f"{f['peak_growth_over_budget']}x the {f['budget_mb']} MB budget")  # fmt: skip
            except Exception as e:
                res["fits_error"] = f"{type(e).__name__}: {e}"
                log(f"fits failed: {e}")
        if not args.fits_only and args.side in (None, "raymesh") and not args.only:
            try:
                res["heal"] = heal_run(td, timeout)
                log(f"heal: bf16 + LoRA + checkpointing / fp32: {res['heal']['ratio']}x")
            except Exception as e:
                res["heal_error"] = f"{type(e).__name__}: {e}"
                log(f"heal failed: {e}")
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(res, indent=2)
    print(text)
    if args.save:
        (ROOT / "bench" / "results" / "finetune.json").write_text(text + "\n")
    log("\n" + table(res))
    log(f"load average: {res['loadavg_start']} at the start, {res['loadavg_end']} at the end")


if __name__ == "__main__":
    main()
