"""bench/chaos.py's rl suite: GRPO runs (raymesh.rl.run) with generators, reward actors and the
controller SIGKILLed at random, at max_staleness 0 and 1, each checked against its promise.

The policy is tests.rl.rewards:build (a 1-layer byte-level TinyGPT), 6 steps of 4 prompts x 8
completions (32 samples a step), 2 generators. A kill lands at a seeded call number of the reward
(`tests.rl.chaos_faults`), so mid-rollout for a generator and mid-score for a reward actor. The
cases and their promises (docs/rl.md):
- generators, staleness 0: 1-2 generators SIGKILLed: each replaced, its keys made again; 32
  samples every step; the final weights bitwise the fault-free run's with the same seed.
- generators, staleness 1: 1-2 generators SIGKILLed: each replaced; 32 samples every step (none
  lost, none twice); no rollout more than 1 version stale.
- reward actors: a mesh of 4, 1-2 SIGKILLed in the first half of the run: the run ends, every
  step trained on some samples, only the samples in flight on a dead actor dropped (the last
  step has all 32: choose() no longer picks a dead actor).
- controller: `raymesh rl JOB` (staleness 0, a checkpoint every step) SIGKILLed after 1-4 steps,
  0-200 ms after a step's line, then `raymesh rl JOB --resume`: the final weights bitwise the
  uninterrupted run's, one metrics line per step.
- learner ranks: the learner a train job of 2 ranks, DDP or FSDP (a checkpoint every step),
  1-2 of its ranks SIGKILLed mid-step at random steps: each healed under the loop (the job's
  failures say so), 32 samples every step, the final weights bitwise the fault-free run's
  with the same learner.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS, PROMPTS_PER_STEP, GROUP = 6, 4, 8
SAMPLES = PROMPTS_PER_STEP * GROUP
PROMPTS = ["def ", "x = ", "import ", "class "]


def _run(reward: Any, staleness: int, **kw: Any) -> Any:
    from raymesh import rl

    return rl.run(
        policy="tests.rl.rewards:build",
        prompts=PROMPTS,
        reward=reward,
        algorithm=rl.GRPO(group_size=GROUP, max_tokens=8),
        steps=STEPS,
        prompts_per_step=PROMPTS_PER_STEP,
        generators=2,
        max_staleness=staleness,
        seed=3,
        timeout_s=120,
        **kw,
    )


def _differing(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def _kills(r: random.Random, last_call: int) -> tuple[int, ...]:
    return tuple(sorted(r.sample(range(2, last_call), r.randint(1, 2))))


def _generators(run: Any, r: random.Random, staleness: int, tmp: str, reference: Any) -> None:
    from tests.rl import chaos_faults

    # Calls before the last two steps' samples: past them, a generator running ahead (staleness
    # 1) may be making samples no step takes, and the run can end before its replacement.
    at = _kills(r, (STEPS - 2) * SAMPLES)
    run.faults = [f"SIGKILL the generator making reward call {n}" for n in at]
    reward = functools.partial(chaos_faults.es_killing_at, counter=f"{tmp}/calls", at=at)
    result = _run(reward, staleness)
    samples = [row["samples"] for row in result.history]
    run.failures = run.healed = result.replaced
    run.lost_steps = len(result.remade)
    problems = []
    if samples != [SAMPLES] * STEPS:
        problems.append(f"samples per step {samples}")
    if result.replaced != len(at):
        problems.append(f"replaced {result.replaced} of {len(at)} killed")
    if staleness == 0:
        if differ := _differing(reference.weights, result.weights):
            problems.append(f"tensors differing from the fault-free run: {differ[:4]}")
    elif max(row.get("staleness_max", row["staleness_mean"]) for row in result.history) > 1:
        problems.append("a rollout more stale than max_staleness")
    run.held, run.detail = not problems, "; ".join(problems)


def _reward_actors(run: Any, r: random.Random, tmp: str) -> None:
    from raymesh.actor import this_host
    from tests.rl import chaos_faults

    at = _kills(r, STEPS * SAMPLES // 2)
    run.faults = [f"SIGKILL the reward actor scoring call {n}" for n in at]
    procs = this_host().spawn_procs(per_host={"procs": 4})
    try:
        mesh = procs.spawn("rewards", chaos_faults.KillableRewardModel, f"{tmp}/calls", at)
        result = _run(mesh, 0, reward_timeout_s=30.0)
        dead = sum(procs.slice(procs=i).failure is not None for i in range(4))
    finally:
        procs.stop().get(timeout=60)
    samples = [row["samples"] for row in result.history]
    run.failures = dead
    run.lost_steps = sum(SAMPLES - s for s in samples)  # samples dropped, not steps
    problems = []
    if dead != len(at):
        problems.append(f"{dead} reward procs dead, {len(at)} killed")
    if len(samples) != STEPS or min(samples) < 1 or samples[-1] != SAMPLES:
        problems.append(f"samples per step {samples}")
    run.held, run.detail = not problems, "; ".join(problems)


CONTROLLER_JOB = """
policy = "tests.rl.rewards:build"
reward = "tests.rl.rewards:es"
prompts = {prompts}
steps = {steps}
prompts_per_step = {per_step}
generators = 2
max_staleness = 0
seed = 3
checkpoint = "{out}"
checkpoint_every = 1
run_dir = "{out}/run"
[grpo]
group_size = {group}
max_tokens = 8
"""


def _job(tmp: str, name: str) -> Path:
    out = Path(tmp) / name
    path = Path(tmp) / f"{name}.toml"
    path.write_text(
        CONTROLLER_JOB.format(
            prompts=json.dumps(PROMPTS),
            steps=STEPS,
            per_step=PROMPTS_PER_STEP,
            group=GROUP,
            out=out,
        )
    )
    return path


def _controller(run: Any, r: random.Random, tmp: str, address: str) -> None:
    from raymesh.train.export import rebuild

    after, delay = r.randint(1, 4), r.uniform(0.0, 0.2)
    run.faults = [f"SIGKILL the controller {delay * 1000:.0f} ms after step {after}'s line"]
    env = dict(os.environ, RAYMESH_ADDRESS=address, RAYMESH_WARM_PROCS="0")
    cli = [sys.executable, "-m", "raymesh.cli.main", "rl"]
    quiet = {"cwd": ROOT, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run([*cli, str(_job(tmp, "whole"))], check=True, timeout=600, **quiet)
    metrics = Path(tmp) / "killed" / "run" / "metrics.jsonl"
    controller = subprocess.Popen([*cli, str(_job(tmp, "killed"))], **quiet)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
            if controller.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        time.sleep(delay)
        controller.send_signal(signal.SIGKILL)
    finally:
        controller.kill()
        controller.wait(timeout=60)
    run.failures = 1
    resumed = subprocess.run(
        [*cli, str(_job(tmp, "killed")), "--resume"], timeout=600, **quiet
    ).returncode
    steps = [json.loads(line)["step"] for line in metrics.open()]
    whole = rebuild(Path(tmp) / "whole").model.state_dict()
    mine = rebuild(Path(tmp) / "killed").model.state_dict()
    problems = []
    if resumed != 0:
        problems.append(f"--resume exited {resumed}")
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"metrics steps {steps}")
    if differ := _differing(whole, mine):
        problems.append(f"tensors differing from the uninterrupted run: {differ[:4]}")
    run.healed = int(not problems)
    run.held, run.detail = not problems, "; ".join(problems)


def _learner(run: Any, r: random.Random, tmp: str, references: dict[str, Any]) -> None:
    from raymesh.testing import kill

    strategy = r.choice(["ddp", "fsdp"])
    steps = sorted(r.sample(range(1, STEPS + 1), r.randint(1, 2)))
    faults = [kill(rank=r.randint(0, 1), at_step=s) for s in steps]
    run.faults = [f"SIGKILL {strategy} learner rank {f.rank} in step {f.at_step}" for f in faults]
    learner = {"workers": 2, "strategy": strategy}
    if strategy not in references:
        references[strategy] = _run(
            "tests.rl.rewards:es", 0, trainer=learner, checkpoint=f"{tmp}/clean", checkpoint_every=1
        )
    result = _run(
        "tests.rl.rewards:es",
        0,
        trainer={**learner, "faults": faults},
        checkpoint=f"{tmp}/ckpt",
        checkpoint_every=1,
    )
    lost = [(f.rank, f.step) for f in result.learner_failures if f.kind == "died"]
    run.failures = run.healed = len(lost)
    run.lost_steps = sum(f.steps_recomputed or 0 for f in result.learner_failures)
    problems = []
    if [s for _, s in lost] != steps:
        problems.append(f"learner ranks lost at steps {lost}, killed at {steps}")
    if [row["samples"] for row in result.history] != [SAMPLES] * STEPS:
        problems.append(f"samples per step {[row['samples'] for row in result.history]}")
    if differ := _differing(references[strategy].weights, result.weights):
        problems.append(f"tensors differing from the fault-free run: {differ[:4]}")
    run.held, run.detail = not problems, "; ".join(problems)


CASES = (
    "generators, staleness 0",
    "generators, staleness 1",
    "reward actors",
    "controller",
    "learner ranks",
)


def rl_runs(seed: int, count: int, replay: int | None, make_run: Any) -> Iterator[Any]:
    """`count` runs, each case in turn; a run's case and faults follow from its seed alone."""
    from raymesh import cluster

    rng = random.Random(seed)
    reference = None
    learners: dict[str, Any] = {}  # the fault-free run of each learner strategy
    for i in range(count):
        # The case is the seed's (so a replay runs it again); the campaign draws seeds until
        # each case has its turn.
        run_seed = replay if replay is not None else rng.randrange(1 << 30)
        while replay is None and run_seed % len(CASES) != i % len(CASES):
            run_seed = rng.randrange(1 << 30)
        r = random.Random(run_seed)
        case = CASES[run_seed % len(CASES)]
        run = make_run("rl", case, run_seed, [])
        print(f"[chaos] rl seed={run_seed}: {case}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="raymesh-chaos-rl-") as tmp:
            try:
                if case.startswith("generators"):
                    staleness = int(case[-1])
                    if staleness == 0 and reference is None:
                        reference = _run("tests.rl.rewards:es", 0)
                    _generators(run, r, staleness, tmp, reference)
                elif case == "reward actors":
                    _reward_actors(run, r, tmp)
                elif case == "learner ranks":
                    _learner(run, r, tmp, learners)
                else:
                    _controller(run, r, tmp, cluster.address())
            except Exception as e:  # a run that raised broke its promise: say how
                run.held, run.detail = False, f"{type(e).__name__}: {e}"
        run.seconds = round(time.monotonic() - t0, 2)
        yield run
