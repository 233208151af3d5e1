"""RL benchmark, language: GRPO on the README's TinyGPT, raymesh.rl against TRL's GRPOTrainer,
with the same model, prompts, reward, group size, learning rate and number of policy updates.

    python bench/grpo.py            # 3 seeds, each side in a process of its own (~5 min)
    python bench/grpo.py --save     # also write bench/results/grpo.json

Issue 36's target: the same mean reward within noise, in at most 0.5x TRL's wall time. Both sides:
- the policy: `raymesh.examples.tinygpt:build` (TinyGPT, 0.12M parameters, its AdamW at lr
  3e-3, betas (0.9, 0.99), weight decay 0.01), from its seeded initial weights; TRL gets the
  same module inside a `PreTrainedModel` (`TinyGPTForTRL`) and a byte tokenizer (a token is a
  byte, as TinyGPT's), so both sample from the same model with the same vocabulary.
- STEPS policy updates of PROMPTS_PER_STEP prompts x GROUP completions of MAX_TOKENS bytes at
  temperature 1 (no top-k or top-p; no end-of-text stop), group-relative advantages (a reward's
  z-score in its group), clip 0.2, no KL, a token-level mean loss (TRL's "dapo"), no gradient
  clipping, a constant learning rate, one optimizer step per generation (TRL's
  `num_iterations=1`).
- the reward: the share of the completion's bytes that are lowercase ASCII letters, which a
  freshly initialised TinyGPT can learn in tens of updates.
- prompts: 4-byte Python openings (one length, so TRL's left padding, which TinyGPT does not
  mask, never happens).
- timed from the training call (Ray up; the procs, the model and the trainer built inside the
  timing: `rl.run`'s whole call; TRL's `GRPOTrainer(...)` and `train()`); "final reward": the
  mean of the last 5 updates' mean reward.
raymesh runs 2 generator procs and one learner proc. Its rows: `raymesh`, one version behind
(`max_staleness=1`, the asynchronous loop), with the warm procs ready before the call (as a
runtime that stays up, issue 37, keeps them for every program); `raymesh_sync`, the same
synchronous (`max_staleness=0`); `raymesh_cold`, asynchronous right after Ray's start, while
the pool's procs are still importing torch (today's first program on a machine). Issue 52's
rows: `raymesh_fsdp2`, the asynchronous loop with the learner a raymesh.train job sharding the
policy over 2 ranks (FSDP), against `trl_2proc`, TRL's GRPOTrainer under `accelerate launch
--cpu --num_processes 2` (data parallel over gloo, each process half the batch: TRL has no
FSDP on a CPU). Sides alternate order per seed.
Prints one JSON object (and the load average at start and end).
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

STEPS = 40
PROMPTS_PER_STEP = 4
GROUP = 8
MAX_TOKENS = 32
PROMPTS = ["def ", "for ", "if x", "x = ", "y = ", "try:", "with", "del "]
POLICY = "raymesh.examples.tinygpt:build"
EOS = "<eos>"
LAST = 5  # the final reward: mean over the last LAST updates
# raymesh's rows: (max_staleness, warm procs ready before the call); and TRL's
SIDES: dict[str, tuple[int, bool]] = {
    "raymesh": (1, True),
    "raymesh_sync": (0, True),
    "raymesh_cold": (1, False),
    "trl": (0, False),
    "raymesh_fsdp2": (1, True),
    "trl_2proc": (0, False),
}
# Issue 52's rows: the learner sharded over 2 ranks (a raymesh.train job, FSDP), and TRL under
# `accelerate launch` with 2 processes (data parallel over gloo; CPU: no FSDP for TRL here)
TRAINERS: dict[str, dict[str, Any]] = {"raymesh_fsdp2": {"workers": 2, "strategy": "fsdp"}}
PROCESSES = {"trl_2proc": 2}


def reward_bytes(prompt: bytes, completion: bytes) -> float:
    """The share of lowercase ASCII letters in the completion."""
    return sum(97 <= b <= 122 for b in completion) / max(1, len(completion))


def raymesh_side(
    seed: int, staleness: int, warm: bool, trainer: dict[str, Any] | None = None
) -> dict[str, Any]:
    from raymesh import cluster, rl
    from raymesh._src.backend import pool

    cluster.ensure_ray()
    if warm:  # the warm procs ready, as a runtime that stays up (issue 37) keeps them
        pool.wait_ready(120.0)
    start = time.perf_counter()
    first: list[float] = []
    result = rl.run(
        policy=POLICY,
        prompts=PROMPTS,
        reward=reward_bytes,
        algorithm=rl.GRPO(group_size=GROUP, max_tokens=MAX_TOKENS, clip=0.2, temperature=1.0),
        steps=STEPS,
        prompts_per_step=PROMPTS_PER_STEP,
        generators=2,
        max_staleness=staleness,
        seed=seed,
        trainer=trainer,
        progress=lambda _: first or first.append(time.perf_counter() - start),
    )
    wall = time.perf_counter() - start
    rewards = [row["reward_mean"] for row in result.history]
    steps = [row["step_s"] for row in result.history[1:]]
    return {
        "wall_s": wall,
        "first_step_s": first[0],
        "step_s_median": statistics.median(steps),
        "rewards": rewards,
        "final_reward": statistics.fmean(rewards[-LAST:]),
    }


def trl_side(seed: int, processes: int = 1) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import (
        GenerationMixin,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizer,
        TrainerCallback,
    )
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput
    from trl import GRPOConfig, GRPOTrainer

    from raymesh.examples import tinygpt

    class ByteTokenizer(PreTrainedTokenizer):
        """A token is a byte (TinyGPT's vocabulary); text is bytes read as latin-1. Its
        end-of-text token is id 256, which TinyGPT (256 logits) never samples: completions
        run to MAX_TOKENS, as raymesh's do."""

        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(pad_token=EOS, eos_token=EOS, **kwargs)

        @property
        def vocab_size(self) -> int:
            return 257

        def get_vocab(self) -> dict[str, int]:
            return {**{chr(i): i for i in range(256)}, EOS: 256}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return list(text)

        def _convert_token_to_id(self, token: str) -> int:
            return 256 if token == EOS else ord(token)

        def _convert_id_to_token(self, index: int) -> str:
            return EOS if index == 256 else chr(index)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return "".join(tokens)

        def save_vocabulary(self, *args: Any, **kwargs: Any) -> tuple[str, ...]:
            return ()

    class TinyGPTConfig(PretrainedConfig):
        model_type = "raymesh-tinygpt"

    class Backbone(torch.nn.Module):
        """TinyGPT up to its final LayerNorm (TRL applies the head itself, fused)."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> BaseModelOutput:
            m = self.inner
            ids = input_ids[:, -m.block_size :]
            x = m.drop(m.tok_emb(ids) + m.pos_emb(torch.arange(ids.shape[1])))
            for block in m.blocks:
                x = block(x)
            return BaseModelOutput(last_hidden_state=m.ln_f(x))

    class TinyGPTForTRL(PreTrainedModel, GenerationMixin):
        """The same TinyGPT module, shaped as transformers' causal LMs are (a backbone and an
        output embedding), which TRL's GRPOTrainer needs."""

        config_class = TinyGPTConfig
        base_model_prefix = "backbone"

        def __init__(self, config: TinyGPTConfig, inner: torch.nn.Module) -> None:
            super().__init__(config)
            self.backbone = Backbone(inner)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.backbone.inner.lm_head

        def forward(
            self, input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any
        ) -> CausalLMOutput:
            # TinyGPT masks nothing but the future: the prompts are one length (no padding)
            hidden = self.backbone(input_ids).last_hidden_state
            return CausalLMOutput(logits=self.get_output_embeddings()(hidden))

        def prepare_inputs_for_generation(
            self, input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any
        ) -> dict:
            return {"input_ids": input_ids}

    torch.manual_seed(seed)  # raymesh seeds torch with the run's seed before `build`, too
    task = tinygpt.build(None)  # type: ignore[arg-type]
    config = TinyGPTConfig(
        vocab_size=256,
        num_hidden_layers=tinygpt.N_LAYER,
        use_cache=False,
        pad_token_id=256,
        eos_token_id=256,
        bos_token_id=None,
    )
    model = TinyGPTForTRL(config, task.model)
    rewards: list[float] = []

    def reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [
            reward_bytes(p.encode("latin-1"), c.encode("latin-1"))
            for p, c in zip(prompts, completions)
        ]

    step_times: list[float] = []

    class Rewards(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                step_times.append(float(logs["step_time"]))

    n = STEPS * PROMPTS_PER_STEP
    data = Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})
    args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-grpo-trl-{seed}"),
        use_cpu=True,
        bf16=False,  # fp32, as raymesh's side (TRL's default is bf16, emulated on this CPU)
        seed=seed,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP // processes,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=tinygpt.LR,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.01,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        shuffle_dataset=False,
        disable_dropout=True,
        gradient_checkpointing=False,
    )
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=ByteTokenizer(),
        callbacks=[Rewards()],
    )
    trainer.train()
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "step_s_median": statistics.median(step_times[1:]),
        "rewards": rewards,
        "final_reward": statistics.fmean(rewards[-LAST:]),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "trl", "transformers", "accelerate", "ray"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _side(name: str, seed: int) -> dict[str, Any]:
    """One side in a fresh process (no state carried over from the other side)."""
    launch = [sys.executable]
    if name in PROCESSES:  # accelerate's launcher starts the processes (torchrun, gloo)
        launch += ["-m", "accelerate.commands.launch", "--cpu", "--num_machines", "1"]
        launch += ["--num_processes", str(PROCESSES[name]), "--mixed_precision", "no"]
        launch += ["--dynamo_backend", "no"]
    out = subprocess.run(
        [*launch, __file__, "--side", name, "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--save", action="store_true", help="write bench/results/grpo.json")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is not None:
        if args.side.startswith("trl"):
            result = trl_side(args.seed, PROCESSES.get(args.side, 1))
        else:
            staleness, warm = SIDES[args.side]
            result = raymesh_side(args.seed, staleness, warm, TRAINERS.get(args.side))
        if os.environ.get("RANK", "0") == "0":  # one line, from the first of TRL's processes
            print(json.dumps(result))
        return
    load_start = os.getloadavg()
    sides = list(SIDES)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for seed in range(args.seeds):
        order = sides if seed % 2 == 0 else sides[::-1]
        for side in order:
            r = _side(side, seed)
            print(
                f"{side} seed {seed}: {r['wall_s']:.1f} s, final reward {r['final_reward']:.3f}",
                file=sys.stderr,
            )
            runs[side].append(r)
    wall = {s: statistics.median(r["wall_s"] for r in runs[s]) for s in sides}
    final = {s: statistics.fmean(r["final_reward"] for r in runs[s]) for s in sides}
    out = {
        "bench": "GRPO on TinyGPT: raymesh.rl vs TRL GRPOTrainer",
        "steps": STEPS,
        "prompts_per_step": PROMPTS_PER_STEP,
        "group_size": GROUP,
        "max_tokens": MAX_TOKENS,
        "seeds": args.seeds,
        "median_wall_s": {s: round(v, 2) for s, v in wall.items()},
        "vs_trl": {s: round(wall[s] / wall["trl"], 2) for s in sides},
        "median_step_s": {
            s: round(statistics.median(r["step_s_median"] for r in runs[s]), 4) for s in sides
        },
        "final_reward_mean": {s: round(v, 3) for s, v in final.items()},
        "final_reward_by_seed": {s: [round(r["final_reward"], 3) for r in runs[s]] for s in sides},
        "target": "raymesh wall <= 0.5x TRL, final reward within noise",
        "target_2_ranks": "raymesh_fsdp2 wall <= 1.0x trl_2proc, final reward within noise",
        "versions": _versions(),
        "runs": runs,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    print(json.dumps(out, indent=1))
    if args.save:
        Path(__file__).with_name("results").joinpath("grpo.json").write_text(
            json.dumps(out, indent=1)
        )


if __name__ == "__main__":
    main()
