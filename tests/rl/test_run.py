"""`rl.run` end to end on real procs: GRPO learns with 4 generators, 4 reward actors and a
learner of 2 ranks, and a run with the same seed whose generator was SIGKILLed mid-rollout
(replaced, its keys made again once) and whose learner lost a rank mid-step (healed under the
loop), or that resumed from a checkpoint, ends with bitwise-equal weights; a reward actor that
raises, hangs, returns no float or dies drops only its samples; a reward that never scores ends
the run; PPO learns CartPole through a SIGKILLed environment runner."""

from __future__ import annotations

import functools
import json
import logging
import shutil

import pytest
import torch

from raymesh import rl, train
from raymesh.actor import this_host
from raymesh.cli.main import main
from raymesh.rl.environments import ActorCritic
from raymesh.testing import kill
from tests.rl import policies, rewards

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

PROMPTS = ["def ", "x = ", "import ", "class "]
ALGORITHM = rl.GRPO(group_size=8, max_tokens=8)
LR = 0.1  # the policy's learning rate (the build's ctx.params["lr"]): es is learned in 4 steps


@pytest.fixture(scope="module")
def warm():
    """The module's learners start in procs that earlier runs' learners trained in
    (`rl.run(warm=...)`): runs with one seed still end with the same weights."""
    with train.WarmRanks() as ranks:
        yield ranks


def _run(reward, steps: int = 4, generators: int = 2, **kw):  # type: ignore[no-untyped-def]
    return rl.run(
        policy="tests.rl.rewards:build",
        prompts=kw.pop("prompts", PROMPTS),
        reward=reward,
        algorithm=ALGORITHM,
        steps=steps,
        prompts_per_step=4,
        generators=generators,
        seed=3,
        timeout_s=120,
        params={"lr": LR},
        **kw,
    )


def test_a_synchronous_run_learns_and_ends_the_same_after_a_generator_sigkill_or_with_reward_actors(
    tmp_path, kills, warm
):
    # Four reward actors, on procs this test watches itself: one is SIGKILLed below.
    procs = this_host().spawn_procs(per_host={"procs": 4}, escalate=False)
    try:
        # The reward as a mesh of reward actors (as a reward model would be); 4 generators;
        # the learner a train job of 2 DDP ranks.
        learner = {"workers": 2}
        scored = _run(
            procs.spawn("reward-model", rewards.RewardModel),
            generators=4,
            trainer=learner,
            warm=warm,
        )
        by_step = [row["reward_mean"] for row in scored.history]
        assert scored.version == 4 and len(scored.history) == 4
        assert all(
            row["staleness_mean"] == 0 and row["samples"] == 32 and row["dropped"] == 0
            for row in scored.history
        )
        # It learns: a random byte is an e 1 time in 256 (the first step's mean is 1/256),
        # and the 4th step's completions are mostly e; the seed is fixed, so a learner that
        # does nothing (LR = 0: about 0.01 at the 4th step) fails this every time.
        assert by_step[0] < 0.05 and by_step[-1] > 0.5, by_step
        # Another run with the seed, scored by the function where the samples are, by one
        # generator, which dies mid-rollout at a random version >= 1, so its replacement makes
        # the keys again (one that installed any version but the current one would make other
        # samples): the same weights. So a run is a function of its seed (with
        # max_staleness=0) whatever the number of generators, the fault changed nothing, and
        # the reward actors scored what the function does, whichever of them answered.
        # A learner rank is SIGKILLed mid-step too, at a random step: the job heals under the
        # loop and trains the step again on the same samples.
        after = kills.randint(33, 128)  # the generator scores 32 completions a version
        step = kills.randint(1, 4)
        flag = tmp_path / "killed"
        killed = _run(
            functools.partial(rewards.es_or_die, flag=str(flag), after=after),
            generators=1,
            checkpoint=str(tmp_path / "ckpt"),
            checkpoint_every=1,
            trainer={"workers": 2, "faults": [kill(rank=1, at_step=step)]},
            warm=warm,
        )
        assert flag.exists() and killed.replaced == 1, kills
        assert [(f.rank, f.step, f.kind) for f in killed.learner_failures] == [(1, step, "died")]
        # the dead generator's keys, made again: a version's keys are 4v .. 4v + 3
        assert killed.remade and len(killed.remade) <= 4 and min(killed.remade) >= 4, kills
        assert [r["samples"] for r in killed.history] == [32] * 4  # none lost, none twice
        differ = [k for k, v in scored.weights.items() if not torch.equal(killed.weights[k], v)]
        assert differ == [], (differ, kills)
        # Its run folder (the checkpoint folder) tells the roles and the replaced generator.
        events = [json.loads(line) for line in (tmp_path / "ckpt" / "events.jsonl").open()]
        roles = [(e["role"], e["count"]) for e in events if e["event"] == "role"]
        assert roles == [("generators", 1), ("learner", 2)], roles
        [replaced] = [e for e in events if e["event"] == "replaced"]
        assert (replaced["role"], replaced["index"], replaced["keys"]) == (
            "generators",
            0,
            killed.remade,
        )
        # Resumed from its checkpoint of version 3 (the newest, of version 4, dropped), the
        # run ends there again: the loop's position and the optimizer came back whole.
        shutil.rmtree(tmp_path / "ckpt" / "step-00000004")
        resumed = _run(
            rewards.es, checkpoint=str(tmp_path / "ckpt"), resume=True, trainer=learner, warm=warm
        )
        assert resumed.resumed_from == 3 and len(resumed.history) == 1
        differ = [k for k, v in scored.weights.items() if not torch.equal(resumed.weights[k], v)]
        assert differ == [], differ
        # A faulty reward mesh of 4: its first answers raise, hang, and return numbers no float
        # holds (10**400, such a Fraction), and one actor's proc is SIGKILLed mid-run. Each
        # drops only its own samples (the dead actor's in flight), no generator is lost, and
        # once the actor is dead it is chosen no more: the last step has every sample.
        faulty = procs.spawn("faulty-model", rewards.RewardModel, str(tmp_path), kill_after=12)
        dropped = _run(faulty, steps=3, generators=1, reward_timeout_s=2.0, warm=warm)
        # The learners after the first started in procs an earlier one trained in (the
        # killed run's 2, less the one that died; the last run's 1 rank).
        assert warm.served >= 5, warm.served
        assert all((tmp_path / f).exists() for f in (*rewards.FAULTS, "actor-killed"))
        assert dropped.replaced == 0 and dropped.remade == []
        counts = [(int(r["samples"]), int(r["dropped"])) for r in dropped.history]
        assert all(s + d == 32 for s, d in counts) and counts[-1] == (32, 0), counts
        # the 4 faults, and the dead actor's calls in flight (at most a group's 8)
        assert counts[0][1] >= 4 and 4 < sum(d for _, d in counts) <= 4 + 8, counts
    finally:
        procs.stop().get(timeout=60)


def test_a_reward_that_never_scores_ends_the_run_at_its_first_step_naming_it(
    tmp_path, capsys, caplog
):
    # A str method on the bytes a reward is given raises TypeError on every completion; a
    # reward returning a word is no number. Either ends the run at step 1 (it used to train
    # on nothing and return normally), the run folder saying why.
    with pytest.raises(rl.RewardError, match=r"^rl\.run: no completion of step 1 .*") as e:
        _run(rewards.counts_a_str, steps=2, generators=1, run_dir=str(tmp_path))
    assert e.value.step == 1 and e.value.reward == "tests.rl.rewards:counts_a_str"
    assert "the reward raised TypeError: argument should be" in e.value.reason, e.value
    end = [json.loads(line) for line in (tmp_path / "events.jsonl").open()][-1]
    assert end["event"] == "end" and end["state"] == "Failed" and "RewardError" in end["reason"]
    assert not (tmp_path / "metrics.jsonl").exists()  # no step was taken
    # A prompt too long for the policy's context (32 tokens) with its completion: refused
    # before the learner's procs start, naming it and the fix (the learner failed on it at
    # every step).
    caplog.set_level(logging.INFO, logger="raymesh")
    caplog.clear()
    with pytest.raises(ValueError, match=r"^prompts\[1\]=b'xxx.*its 30 tokens and max_tokens=8 "):
        _run(rewards.es, prompts=["def ", "x" * 30], steps=1, generators=1)
    assert not [r for r in caplog.records if "-> Starting" in r.getMessage()]
    # `raymesh rl`: one line naming the reward and the reason, and exit status 1.
    job = tmp_path / "job.toml"
    job.write_text(
        'policy = "tests.rl.rewards:build"\nreward = "tests.rl.rewards:says_high"\n'
        'prompts = ["def "]\nsteps = 2\nprompts_per_step = 1\ngenerators = 1\n'
        "[grpo]\nmax_tokens = 8\n"
    )
    assert main(["rl", str(job)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(
        "raymesh rl: rl.run: no completion of step 1 could be scored by the reward "
        "tests.rl.rewards:says_high (all 8 dropped); the first: key 0 completion 0: the reward "
        "returned str 'high', not a number."
    ), err


def test_ppo_learns_cartpole_through_a_sigkilled_env_runner_and_resumes_from_a_checkpoint(
    tmp_path,
):
    # CartPole in the RL zoo's PPO settings, 2 runners x 8 envs x 32 steps = 512 steps a
    # version; one runner dies mid-segment, is replaced, and its segment is made again.
    algorithm = rl.PPO(
        env="CartPole-v1", gamma=0.98, lam=0.8, lr=1e-3, epochs=20, minibatches=2,
        rollout_steps=32, envs_per_runner=8,
    )  # fmt: skip
    flag = tmp_path / "killed"
    policy = functools.partial(
        policies.actor_critic_or_die, flag=str(flag), after=2 * algorithm.rollout_steps + 5
    )
    result = rl.run(
        policy=policy, algorithm=algorithm, steps=150, env_runners=2, seed=1, timeout_s=120,
        stop=lambda stats: stats["episode_return_mean"] >= 200, checkpoint=str(tmp_path / "ppo"),
    )  # fmt: skip
    assert flag.exists() and result.replaced == 1 and len(result.remade) == 1
    assert result.history[-1]["episode_return_mean"] >= 200, result.history[-1]  # it learned
    assert result.version == len(result.history) < 150
    assert all(row["env_steps"] == 512 and row["staleness_mean"] == 0 for row in result.history)
    ActorCritic(4, 2).load_state_dict(result.state_dict())  # the default policy's weights
    # PPO checkpoints as GRPO does (its learner is a train job too: a version is 40 of its
    # steps), and a run resumes there, the policy and its optimizer as they were.
    v = result.version
    assert result.checkpoint is not None and result.checkpoint.endswith(f"step-{40 * v:08d}")
    again = rl.run(
        algorithm=algorithm, steps=v + 1, env_runners=2, seed=1, timeout_s=120,
        checkpoint=str(tmp_path / "ppo"), resume=True,
    )  # fmt: skip
    assert again.resumed_from == v and again.version == v + 1 and len(again.history) == 1


def test_bad_arguments_are_refused_before_any_proc_starts():
    with pytest.raises(ValueError, match=r"^prompts=.*give a non-empty list"):
        rl.run(policy="tests.rl.rewards:build", prompts=[], reward=rewards.es, steps=1)
    with pytest.raises(ValueError, match=r"^max_staleness=-1"):
        _run(rewards.es, max_staleness=-1)
    with pytest.raises(ValueError, match=r"^reward='tests\.rl\.rewards:nope'"):
        _run("tests.rl.rewards:nope")
    cartpole = rl.PPO(env="CartPole-v1")
    with pytest.raises(ValueError, match=r"^prompts=.*environment RL \(rl\.PPO\) takes none"):
        rl.run(algorithm=cartpole, prompts=PROMPTS, steps=1)
    with pytest.raises(ValueError, match=r"^env='CartPole-v9'.*e\.g\. 'CartPole-v1'"):
        rl.run(algorithm=rl.PPO(env="CartPole-v9"), steps=1)
    with pytest.raises(ValueError, match=r"^env='Pendulum-v1'.*Discrete actions only"):
        rl.run(algorithm=rl.PPO(env="Pendulum-v1"), steps=1)
    with pytest.raises(ValueError, match=r"^env_runners=0"):
        rl.run(algorithm=cartpole, env_runners=0, steps=1)
    with pytest.raises(ValueError, match=r"^minibatches=0"):
        rl.PPO(env="CartPole-v1", minibatches=0)
    with pytest.raises(ValueError, match=r"^resume=True: give checkpoint= the folder"):
        _run(rewards.es, resume=True)
    with pytest.raises(ValueError, match=r"^checkpoint_every=2: give checkpoint= the folder"):
        _run(rewards.es, checkpoint_every=2)
    with pytest.raises(ValueError, match=r"^checkpoint_every=-1"):
        _run(rewards.es, checkpoint_every=-1)
    # The learner's train job: fields it does not have, or ones the loop owns.
    with pytest.raises(ValueError, match=r"^trainer=.*\['worker'\] are no train.TrainConfig"):
        _run(rewards.es, trainer={"worker": 2})
    with pytest.raises(ValueError, match=r"^trainer.run_dir='x': the RL loop sets it"):
        _run(rewards.es, trainer={"run_dir": "x"})
    with pytest.raises(ValueError, match=r"^trainer.global_batch_size=5: a GRPO step takes "):
        _run(rewards.es, trainer=train.TrainConfig(global_batch_size=5))
    with pytest.raises(ValueError, match=r"global_batch_size=32: gives some of the 33 workers"):
        _run(rewards.es, trainer={"workers": 33})
    with pytest.raises(ValueError, match=r"^trainer.global_batch_size=7: a PPO minibatch takes"):
        rl.run(algorithm=cartpole, steps=1, trainer=train.TrainConfig(global_batch_size=7))


def test_grpo_post_trains_a_hugging_face_lora_policy_and_publishes_only_its_adapters(tmp_path):
    from raymesh.train import hf
    from raymesh.train.export import rebuild

    folder = hf.save_tiny_llama(tmp_path / "llama")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    params = {"model": str(folder), "lora_r": 4, "lr": 1e-2, "text": str(text)}
    result = rl.run(
        policy="raymesh.train.hf:build",
        params=params,
        prompts=PROMPTS,
        reward=rewards.ascii_share,
        algorithm=rl.GRPO(group_size=4, max_tokens=6),
        steps=2,
        prompts_per_step=2,
        generators=1,
        checkpoint=str(tmp_path / "grpo"),
        timeout_s=120,
    )
    assert [row["samples"] for row in result.history] == [8, 8]
    # Only what trains travels to the generators: the adapters, not the frozen base.
    assert result.weights and all("lora_" in k for k in result.weights), list(result.weights)
    # The checkpoint is a raymesh.train run of the PEFT model, as serve and export rebuild it.
    model = rebuild(tmp_path / "grpo").model
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in result.weights.items())
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in state.items() if "lora_B" in k)
