"""RL benchmark, environments: PPO on CartPole-v1 to a mean return of 450, raymesh.rl against
Ray RLlib's PPO, with the same hyperparameters and the same number of env runners.

    python bench/ppo.py            # 3 seeds, each side in a process of its own (~5 min)
    python bench/ppo.py --save     # also write bench/results/ppo.json

Issue 36's target: wall time to a mean return of 450 at most 0.7x RLlib's. Both sides:
- 2 env runner procs (RLlib's `num_env_runners=2`), 8 environments each, 32 steps per runner
  per update (a batch of 512 steps), 20 epochs of 2 minibatches of 256, Adam at lr 1e-3,
  gamma 0.98, GAE lambda 0.8, clip 0.2, value weight 0.5, no entropy bonus, gradients clipped
  to norm 0.5 (RL Baselines3 Zoo's CartPole settings); an MLP of two tanh layers of 64 for
  the policy and another for the value; RLlib's KL term and value clipping off (raymesh has
  neither).
- "mean return": over the last 100 finished episodes, measured the same way on both sides.
  RLlib's own `episode_return_mean` is not that (it reached 450 after 12k env steps, when
  100 episodes of 450 would take 45k): an RLlib callback writes each finished episode's
  whole return (all its chunks) with its time, and the driver takes the last 100.
- timed from the training call (Ray already up, the policy and runners built inside the
  timing: `rl.run`'s whole call; RLlib's `build_algo()` and `train()` calls) to the update at
  which the mean first reaches 450, with at most 300 updates (a side that does not reach it
  reports its time and `"reached": false`). The whole process's wall time is recorded too.
Sides alternate order per seed. Prints one JSON object (and the load average at start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET = 450.0
MAX_UPDATES = 300
RUNNERS = 2
HYPER = {
    "envs_per_runner": 8,
    "rollout_steps": 32,
    "epochs": 20,
    "minibatches": 2,
    "lr": 1e-3,
    "gamma": 0.98,
    "lam": 0.8,
    "clip": 0.2,
    "value_coef": 0.5,
    "entropy_coef": 0.0,
    "max_grad_norm": 0.5,
}


def raymesh_side(seed: int) -> dict[str, Any]:
    from raymesh import cluster, rl

    cluster.ensure_ray()
    start = time.perf_counter()
    result = rl.run(
        algorithm=rl.PPO(env="CartPole-v1", **HYPER),
        env_runners=RUNNERS,
        steps=MAX_UPDATES,
        seed=seed,
        stop=lambda s: s["episode_return_mean"] >= TARGET,
    )
    last = result.history[-1]
    return {
        "seconds": time.perf_counter() - start,
        "updates": len(result.history),
        "env_steps": int(sum(r["env_steps"] for r in result.history)),
        "episodes": int(sum(r["episodes"] for r in result.history)),
        "return_mean": last["episode_return_mean"],
        "reached": last["episode_return_mean"] >= TARGET,
    }


def rllib_side(seed: int) -> dict[str, Any]:
    import tempfile

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    class Episodes(RLlibCallback):  # type: ignore[misc]
        """Each finished episode's return, with its time, in a file per env runner."""

        def on_episode_end(self, *, episode: Any, prev_episode_chunks: Any = None, **_: Any):
            chunks = [*(prev_episode_chunks or []), episode]
            total = sum(c.get_return() for c in chunks)
            path = Path(os.environ["PPO_BENCH_EPISODES"]) / f"{os.getpid()}.txt"
            with path.open("a") as f:
                f.write(f"{time.time()} {total}\n")

    folder = tempfile.mkdtemp(prefix="ppo_bench_")
    os.environ["PPO_BENCH_EPISODES"] = folder
    ray.init(
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PPO_BENCH_EPISODES": folder}},
    )

    def last_100() -> tuple[float, int]:
        rows = []
        for f in Path(folder).glob("*.txt"):
            rows += [tuple(map(float, line.split())) for line in f.read_text().splitlines()]
        rows.sort()
        tail = [r for _, r in rows[-100:]]
        return (sum(tail) / len(tail) if tail else float("nan")), len(rows)

    start = time.perf_counter()
    batch = RUNNERS * HYPER["envs_per_runner"] * HYPER["rollout_steps"]
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(
            num_env_runners=RUNNERS,
            num_envs_per_env_runner=HYPER["envs_per_runner"],
            rollout_fragment_length=HYPER["rollout_steps"],
        )
        .training(
            lr=HYPER["lr"],
            gamma=HYPER["gamma"],
            lambda_=HYPER["lam"],
            clip_param=HYPER["clip"],
            vf_loss_coeff=HYPER["value_coef"],
            entropy_coeff=HYPER["entropy_coef"],
            grad_clip=HYPER["max_grad_norm"],
            grad_clip_by="global_norm",
            num_epochs=HYPER["epochs"],
            train_batch_size_per_learner=batch,
            minibatch_size=batch // HYPER["minibatches"],
            use_kl_loss=False,
            vf_clip_param=1e9,
        )
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[64, 64], fcnet_activation="tanh", vf_share_layers=False
            )
        )
        .callbacks(Episodes)
        .debugging(seed=seed)
    )
    algo = config.build_algo()
    updates, mean, steps = 0, float("nan"), 0
    while updates < MAX_UPDATES:
        out = algo.train()
        updates += 1
        mean, episodes = last_100()
        steps = int(out["env_runners"].get("num_env_steps_sampled_lifetime", 0))
        rllib_mean = float(out["env_runners"].get("episode_return_mean", float("nan")))
        if mean >= TARGET:
            break
    seconds = time.perf_counter() - start
    algo.stop()
    return {
        "seconds": seconds,
        "updates": updates,
        "env_steps": steps,
        "episodes": episodes,
        "return_mean": mean,
        "rllib_episode_return_mean": rllib_mean,
        "reached": mean >= TARGET,
    }


def _side(name: str, seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--side", name, "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} (seed {seed}) failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--save", action="store_true", help="write bench/results/ppo.json")
    p.add_argument("--side", choices=["raymesh", "rllib"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        fn = raymesh_side if args.side == "raymesh" else rllib_side
        print(json.dumps(fn(args.seed)), flush=True)
        os._exit(0)  # the runtime's teardown is not what is measured

    load_start = os.getloadavg()
    rows: dict[str, list[dict[str, Any]]] = {"raymesh": [], "rllib": []}
    for seed in range(args.seeds):
        order = ["raymesh", "rllib"] if seed % 2 == 0 else ["rllib", "raymesh"]
        for name in order:
            rows[name].append(_side(name, seed))
            print(name, seed, json.dumps(rows[name][-1]), file=sys.stderr, flush=True)
    median = {k: statistics.median(r["seconds"] for r in v) for k, v in rows.items()}
    result = {
        "bench": "ppo_cartpole_450",
        "hyperparameters": HYPER,
        "env_runners": RUNNERS,
        "runs": rows,
        "median_seconds": median,
        "ratio_raymesh_over_rllib": median["raymesh"] / median["rllib"],
        "all_reached": all(r["reached"] for v in rows.values() for r in v),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    if args.save:
        path = Path(__file__).parent / "results" / "ppo.json"
        path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
