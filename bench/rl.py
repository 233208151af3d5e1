"""RL benchmark, first part: weight sync of a ~10M-parameter policy to 4 generators.

    python bench/rl.py                 # 5 rounds, median (~1 min on 2 cores)
    python bench/rl.py --save          # also write bench/results/rl.json
    python bench/rl.py --learner 1:ddp # the learner job's ranks and strategy (default 2:fsdp)
    python bench/rl.py --overhead      # the second part: the learner's step, driven job vs proc
    python bench/rl.py --heal          # the third: time lost to a learner rank SIGKILLed

Issue 52's target: publishing a version of a 2-rank FSDP learner's policy to 4 generators
within 1.3x the cost of one `ray.put` of its state dict and 4 `ray.get`s of it (issue 36's:
1.2x from a one-proc learner). Measured, in one run on one machine:
  raymesh_rl      what rl.run does per step: the learner job's `weights()` (rank 0 gathers the
                  sharded state once and stores it once in the object store, as a
                  `raymesh.Shared`: the controller gets a reference), then
                  `load(version, shared)` on each of 4 generators (one proc mesh each), until
                  every generator has installed it
  raymesh_shared  the controller's state as `Shared(state)`, then the same 4 loads: the
                  anchor's work through raymesh's calls
  ray_put_get     the anchor: `ray.put(state)` in the controller, then 4 plain Ray actors each
                  `ray.get` it and `load_state_dict` it (the same work as a generator's load)
The policy is a byte-level TinyGPT of 12 blocks, width 256 (9.6M parameters, 38 MB fp32).
Each round runs the three once, in that order; figures are medians over rounds. Prints one
JSON object (and the load average at start and end).

`--overhead`, issue 52's target: a GRPO step of the learner as a one-rank train job the loop
drives (`train.drive`: its samples stored once and sent to the rank, the step's seeding,
metrics and reporting) within 1.05x of the same step in one actor proc, as the learner was
before it was a train job (the samples in the call, collate, loss, backward, AdamW). The
policy is examples/grpo.toml's (TinyGPT, 0.12M parameters), 4 prompts x 8 completions of 32
tokens a step, both with one intra-op thread; the two alternate in blocks of 10 steps (a
step's aftermath, freeing its objects, lands in its own side's time), medians over
`--rounds` steps of each after 3 to warm up.

`--heal`, issue 52's target: a learner rank SIGKILLed mid-run at `max_staleness=0` costs at
most 2 steps' time, the weights bitwise the run's without the kill. GRPO as the rl test suite
runs it (tests.rl.rewards' 1-layer TinyGPT, 4 prompts x 8 completions of 8 tokens, 2
generators), 12 steps, the learner a 2-rank DDP train job, without a spare and with one warm
spare (`spares=1`, on both sides); the faulted run SIGKILLs rank 1 in step 6
(`raymesh.testing.kill`). Each of `--rounds` rounds runs both, alternating which goes
first; "lost" is the faulted run's wall time over the clean one's of the same round, in
seconds and in the clean run's median steps; `recovery_s` is the job's own (detection to the
first step trained after the heal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

GENERATORS = 4


def big(ctx: Any) -> Any:
    """The policy: a TinyGPT of ~10M parameters (a train build function)."""
    from raymesh.examples.tinygpt import TinyGPT, lm_loss
    from raymesh.train import Task

    model = TinyGPT(block_size=64, n_layer=12, n_head=4, n_embd=256)
    return Task(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), dataset=[0], loss_fn=lm_loss
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--save", action="store_true", help="write bench/results/rl.json")
    p.add_argument("--learner", default="2:fsdp", help="the learner job's RANKS:STRATEGY")
    p.add_argument("--overhead", action="store_true", help="the learner's step, job vs proc")
    p.add_argument("--heal", action="store_true", help="time lost to a learner rank's SIGKILL")
    args = p.parse_args()
    if args.overhead:
        return overhead(args.rounds, args.save)
    if args.heal:
        return heal(args.rounds, args.save)
    ranks, strategy = args.learner.split(":")

    import ray

    from raymesh import Shared as rl_shared
    from raymesh import cluster, rl, this_host, train
    from raymesh.rl.learner import GRPOTask, TrainedLearner

    load_start = os.getloadavg()
    cluster.ensure_ray()
    policy = big  # shipped by value to the procs (a __main__ function)
    algorithm = rl.GRPO()
    config = train.TrainConfig(
        workers=int(ranks), strategy=strategy, global_batch_size=int(ranks), activation_bytes=0
    )
    learner = TrainedLearner(train.drive(GRPOTask(policy, algorithm), config))
    meshes = [
        this_host().spawn_procs(per_host={"procs": 1}, name=f"bench-gen{i}")
        for i in range(GENERATORS)
    ]
    gens = [m.spawn("gen", rl.Generator, policy, _reward, algorithm, seed=0) for m in meshes]

    @ray.remote(num_cpus=0)
    class Plain:
        def __init__(self) -> None:
            self.model = big(None).model

        def load(self, refs: list[Any]) -> int:
            self.model.load_state_dict(ray.get(refs[0]))
            return 0

    plains = [Plain.remote() for _ in range(GENERATORS)]
    ray.get([p.load.remote([ray.put(big(None).model.state_dict())]) for p in plains])
    params = sum(t.numel() for t in big(None).model.parameters())

    times: dict[str, list[float]] = {"raymesh_rl": [], "raymesh_shared": [], "ray_put_get": []}
    state = big(None).model.state_dict()
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        version, shared = learner.weights()
        for f in [g.load.call_one(version, shared) for g in gens]:
            f.get(timeout=120)
        times["raymesh_rl"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        shared = rl_shared(state)
        for f in [g.load.call_one(version, shared) for g in gens]:
            f.get(timeout=120)
        times["raymesh_shared"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = ray.put(state)
        ray.get([p.load.remote([ref]) for p in plains], timeout=120)
        times["ray_put_get"].append(time.perf_counter() - t0)
    for m in meshes:
        m.stop().get(timeout=60)
    learner.job.stop()
    median = {k: statistics.median(v) for k, v in times.items()}
    anchor = median["ray_put_get"]
    out = {
        "bench": "rl weight sync",
        "parameters": params,
        "state_mb": round(sum(t.numel() * t.element_size() for t in state.values()) / 1e6, 1),
        "generators": GENERATORS,
        "learner": {"ranks": int(ranks), "strategy": strategy},
        "rounds": args.rounds,
        "median_s": {k: round(v, 4) for k, v in median.items()},
        "vs_ray_put_get": {k: round(v / anchor, 2) for k, v in median.items()},
        "target": "raymesh_rl <= 1.3x ray_put_get (2-rank FSDP learner)",
        "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    _report(out, "rl.json", args.save)


def _reward(prompt: bytes, completion: bytes) -> float:
    return 0.0


class OneProc:
    """The learner as it was: the GRPO task's step in one actor (made an Actor in `overhead`,
    where raymesh is imported)."""

    def __init__(self, policy: str, algorithm: Any) -> None:
        from raymesh.rl.learner import GRPOTask
        from raymesh.train import Context

        torch.set_num_threads(1)  # as a train rank of cpus_per_worker=1
        torch.manual_seed(0)
        ctx = Context.alone()
        self.task = GRPOTask(policy, algorithm)(ctx)

    def learn(self, samples: list[dict]) -> float:
        task = self.task
        loss, _ = task.loss_fn(task.model, task.collate_fn(samples))
        task.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        task.optimizer.step()
        return float(loss)


def overhead(rounds: int, save: bool) -> None:
    from raymesh import Actor, cluster, endpoint, rl, this_host, train
    from raymesh.rl.buffer import Rollout
    from raymesh.rl.learner import GRPOTask, completion_samples
    from raymesh.rl.sampling import Completions

    load_start = os.getloadavg()
    cluster.ensure_ray()
    policy, algorithm = "raymesh.examples.tinygpt:build", rl.GRPO(group_size=8, max_tokens=32)
    g = torch.Generator().manual_seed(0)
    rollouts = [
        Rollout(
            key=k,
            version=0,
            data=Completions(
                prompt,
                torch.randint(0, 256, (8, 32), generator=g),
                torch.full((8, 32), -5.0),
                torch.rand(8, generator=g, dtype=torch.float64),
            ),
        )
        for k, prompt in enumerate([b"def ", b"import ", b"class ", b"for "])
    ]
    samples, _ = completion_samples(rollouts, 0)
    warm = 3
    config = train.TrainConfig(steps=rounds + warm, global_batch_size=len(samples))
    job = train.drive(GRPOTask(policy, algorithm), config, example=samples)

    class Proc(OneProc, Actor):
        learn = endpoint(OneProc.learn)

    procs = this_host().spawn_procs(per_host={"procs": 1}, name="bench-one-proc")
    one = procs.spawn("learner", Proc, policy, algorithm)
    times: dict[str, list[float]] = {"driven_job": [], "one_proc": []}
    sides = {
        "driven_job": lambda: job.step(samples),
        "one_proc": lambda: one.learn.call_one(samples).get(timeout=120),
    }
    for block in range(0, rounds + warm, 10):
        for name, step in sides.items():
            for i in range(block, min(block + 10, rounds + warm)):
                t0 = time.perf_counter()
                step()
                if i >= warm:
                    times[name].append(time.perf_counter() - t0)
    job.stop()
    procs.stop().get(timeout=60)
    median = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "bench": "rl learner step overhead",
        "policy": policy,
        "samples": len(samples),
        "rounds": rounds,
        "median_s": {k: round(v, 5) for k, v in median.items()},
        "driven_vs_one_proc": round(median["driven_job"] / median["one_proc"], 3),
        "target": "driven_job <= 1.05x one_proc",
        "all_s": {k: [round(x, 5) for x in v] for k, v in times.items()},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    _report(out, "rl_overhead.json", save)


def heal(rounds: int, save: bool) -> None:
    import sys

    import torch

    from raymesh import cluster, rl
    from raymesh.testing import kill

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.rl.rewards
    load_start = os.getloadavg()
    cluster.ensure_ray()
    steps, at = 12, 6

    def run(faults: list[Any], spares: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        result = rl.run(
            policy="tests.rl.rewards:build",
            prompts=["def ", "x = ", "import ", "class "],
            reward="tests.rl.rewards:es",
            algorithm=rl.GRPO(group_size=8, max_tokens=8),
            steps=steps,
            prompts_per_step=4,
            generators=2,
            seed=3,
            params={"lr": 0.1},
            trainer={"workers": 2, "spares": spares, "faults": faults},
        )
        return time.perf_counter() - t0, result

    out_rounds = []
    for i in range(2 * rounds):
        spares = i % 2  # without a spare, then with one
        sides = ["clean", "faulted"] if i % 4 < 2 else ["faulted", "clean"]
        got = {
            side: run([kill(rank=1, at_step=at)] if side == "faulted" else [], spares)
            for side in sides
        }
        (clean_s, clean), (faulted_s, faulted) = got["clean"], got["faulted"]
        step_s = statistics.median(row["step_s"] for row in clean.history)
        failures = [f for f in faulted.learner_failures if f.kind == "died"]
        bitwise = all(torch.equal(clean.weights[k], faulted.weights[k]) for k in clean.weights)
        out_rounds.append(
            {
                "spares": spares,
                "clean_s": round(clean_s, 3),
                "faulted_s": round(faulted_s, 3),
                "lost_s": round(faulted_s - clean_s, 3),
                "step_s": round(step_s, 4),
                "lost_steps": round((faulted_s - clean_s) / step_s, 2),
                "recovery_s": [round(f.recovery_s or 0.0, 3) for f in failures],
                "steps_recomputed": [f.steps_recomputed for f in failures],
                "bitwise": bitwise,
            }
        )
        print(json.dumps(out_rounds[-1]), file=sys.stderr)
    out = {
        "bench": "rl learner heal",
        "steps": steps,
        "killed": f"rank 1 of a 2-rank DDP learner in step {at}",
        "rounds": out_rounds,
        **{f"spares_{n}": _medians([r for r in out_rounds if r["spares"] == n]) for n in (0, 1)},
        "target": "time lost <= 2 steps, weights bitwise",
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    _report(out, "rl_heal.json", save)


def _medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """--heal's medians over `rounds` (recovery_s: over every failure of them)."""
    out = {k: statistics.median(r[k] for r in rounds) for k in ("lost_s", "lost_steps", "step_s")}
    out["recovery_s"] = statistics.median(x for r in rounds for x in r["recovery_s"])
    return {k: round(v, 3) for k, v in out.items()}


def _report(out: dict[str, Any], name: str, save: bool) -> None:
    """Print `out`, and with `save` write it to bench/results/`name` too."""
    text = json.dumps(out, indent=1)
    print(text)
    if save:
        Path(__file__).with_name("results").joinpath(name).write_text(text)


if __name__ == "__main__":
    main()
