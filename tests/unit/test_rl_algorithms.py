"""raymesh.rl's learning rules and rollout buffer, with made-up numbers worked by hand (pure:
no Ray, no model)."""

from __future__ import annotations

import fractions
import math
import threading
import time
from typing import Any

import numpy
import pytest
import torch

from raymesh import rl


def test_a_groups_advantages_are_its_rewards_z_scores_and_an_even_group_teaches_nothing():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    got = rl.group_advantages(rewards, 4)
    # Group 1: mean 0.5, sample std sqrt(1/3); group 2: all equal; group 3: mean 0.75,
    # sample std sqrt((2.25**2 + 3 * 0.75**2) / 3) = 1.5.
    s = math.sqrt(1 / 3)
    want = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0, 1.5, -0.5, -0.5, -0.5]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    with pytest.raises(ValueError, match=r"do not split into groups of group_size=5"):
        rl.group_advantages(rewards, 5)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipped"),
    [
        (1.5, 1.0, -1.2, True),  # a gain beyond 1 + clip earns no more
        (1.5, -1.0, 1.5, False),  # a loss is never clipped away
        (0.5, 1.0, -0.5, False),
        (0.5, -1.0, 0.8, True),  # below 1 - clip, a bad action's loss stops growing
        (1.1, 2.0, -2.2, False),  # inside the band: the plain ratio
    ],
)
def test_the_clipped_surrogate_by_hand(ratio, advantage, loss, clipped):
    new, old = torch.tensor([math.log(ratio)]), torch.tensor([0.0])
    got, was_clipped = rl.clipped_surrogate(new, old, torch.tensor([advantage]), 0.2)
    assert got.item() == pytest.approx(loss) and bool(was_clipped) is clipped


def test_the_kl_estimate_is_zero_at_the_reference_and_positive_elsewhere():
    ref = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.equal(rl.kl_to_reference(ref, ref), torch.zeros(3))
    d = 0.3  # exp(d) - d - 1
    got = rl.kl_to_reference(ref, ref + d)
    assert torch.allclose(got, torch.full((3,), math.exp(d) - d - 1))


def test_grpo_loss_averages_every_real_token_once_and_adds_the_weighted_kl():
    # Two completions: the first 3 real tokens, the second 1 (then padding).
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.0, 1.1, 1.5], [0.5, 9.0, 9.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = rl.grpo_loss(new, old, advantages, mask, clip=0.2)
    # Token terms: -1.0, -1.1, -1.2 (clipped), then 0.8 (clipped below): mean over 4 tokens.
    assert loss.item() == pytest.approx((-1.0 - 1.1 - 1.2 + 0.8) / 4)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    ref = new.detach() + 0.1
    with_kl, stats = rl.grpo_loss(new, old, advantages, mask, clip=0.2, kl=0.5, logp_ref=ref)
    k3 = math.exp(0.1) - 0.1 - 1
    assert stats["kl"] == pytest.approx(k3, rel=1e-5)
    assert with_kl.item() == pytest.approx(loss.item() + 0.5 * k3, rel=1e-5)
    with pytest.raises(ValueError, match="logp_ref"):
        rl.grpo_loss(new, old, advantages, mask, clip=0.2, kl=0.1)


def test_gae_by_hand_with_and_without_an_episode_ending():
    rewards = torch.ones(3, 1)
    values = torch.full((4, 1), 0.5)
    # delta = 1 + 0.9 * 0.5 - 0.5 = 0.95 at every step; gamma * lam = 0.72.
    adv, ret = rl.gae(rewards, values, torch.zeros(3, 1), gamma=0.9, lam=0.8)
    a2 = 0.95
    a1 = 0.95 + 0.72 * a2
    a0 = 0.95 + 0.72 * a1
    assert torch.allclose(adv[:, 0], torch.tensor([a0, a1, a2]))
    assert torch.allclose(ret, adv + 0.5)
    # The episode ends at step 1: its delta does not bootstrap, and step 0 sees only it.
    dones = torch.tensor([[0.0], [1.0], [0.0]])
    adv, _ = rl.gae(rewards, values, dones, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, 0], torch.tensor([0.95 + 0.72 * 0.5, 0.5, 0.95]))
    with pytest.raises(ValueError, match="values one row longer"):
        rl.gae(rewards, values[:3], dones, gamma=0.9, lam=0.8)


def test_ppo_loss_adds_the_value_error_and_subtracts_the_entropy_bonus():
    logp = torch.zeros(2)
    loss, stats = rl.ppo_loss(
        logp,
        logp,
        torch.tensor([1.0, -1.0]),  # ratio 1: the surrogate's mean is 0
        torch.tensor([1.0, 2.0]),
        torch.tensor([0.0, 0.0]),  # squared errors 1 and 4
        torch.tensor([0.7, 0.3]),
        clip=0.2,
        value_coef=0.5,
        entropy_coef=0.1,
    )
    assert loss.item() == pytest.approx(0.0 + 0.5 * 2.5 - 0.1 * 0.5)
    assert stats == pytest.approx(
        {"policy_loss": 0.0, "value_loss": 2.5, "entropy": 0.5, "clip_fraction": 0.0}
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: rl.GRPO(group_size=1), r"^group_size=1: give an integer >= 2"),
        (lambda: rl.GRPO(clip=1.5), r"^clip=1\.5: give a fraction"),
        (lambda: rl.GRPO(kl=-1), r"^kl=-1: give a weight >= 0"),
        (lambda: rl.GRPO(temperature=0), r"^temperature=0: give a number > 0"),
        (lambda: rl.GRPO(max_tokens=0), r"^max_tokens=0"),
        (lambda: rl.PPO(env=""), r"^env='': give a gymnasium environment id"),
        (lambda: rl.PPO(env="CartPole-v1", gamma=float("nan")), r"^gamma=nan"),
        (lambda: rl.PPO(env="CartPole-v1", epochs=0), r"^epochs=0"),
    ],
)
def test_bad_settings_name_the_field_the_value_and_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _r(key: int, version: int) -> rl.Rollout:
    return rl.Rollout(key=key, version=version, data=f"rollout {key}")


def test_the_buffer_hands_out_smallest_keys_first_and_each_key_once():
    buffer = rl.RolloutBuffer(capacity=8, max_staleness=0)
    for key in (5, 2, 7, 1):  # generators finish in any order
        assert buffer.put(_r(key, 0), timeout_s=1)
    assert not buffer.put(_r(2, 0), timeout_s=1)  # a replaced generator's remake: refused
    assert [r.key for r in buffer.take(3, version=0, timeout_s=1)] == [1, 2, 5]
    assert not buffer.put(_r(1, 0), timeout_s=1)  # taken already: still refused
    assert [r.key for r in buffer.take(1, version=0, timeout_s=1)] == [7]


def test_stale_rollouts_are_dropped_reported_and_welcome_again():
    buffer = rl.RolloutBuffer(capacity=8, max_staleness=1)
    for key, version in ((1, 3), (2, 4), (3, 5), (4, 5)):
        buffer.put(_r(key, version), timeout_s=1)
    # At version 5 with max_staleness 1, version 3 is too old: key 1 is dropped.
    assert [r.key for r in buffer.take(2, version=5, timeout_s=1)] == [2, 3]
    assert buffer.stale() == [1] and buffer.stale() == []
    assert buffer.put(_r(1, 5), timeout_s=1)  # made again by a fresh policy
    assert [r.key for r in buffer.take(2, version=5, timeout_s=1)] == [1, 4]


def test_a_full_buffer_holds_the_generators_back_and_every_wait_times_out():
    buffer = rl.RolloutBuffer(capacity=2, max_staleness=0)
    buffer.put(_r(1, 0), timeout_s=1)
    buffer.put(_r(2, 0), timeout_s=1)
    with pytest.raises(TimeoutError, match=r"full \(2 rollouts\)"):
        buffer.put(_r(3, 0), timeout_s=0.1)
    done = threading.Event()

    def generator() -> None:  # blocks until the trainer takes one
        buffer.put(_r(3, 0), timeout_s=5)
        done.set()

    thread = threading.Thread(target=generator)
    thread.start()
    time.sleep(0.1)
    assert not done.is_set()
    assert [r.key for r in buffer.take(1, version=0, timeout_s=1)] == [1]
    thread.join(5)
    assert done.is_set() and len(buffer) == 2
    with pytest.raises(TimeoutError, match=r"2 of 3 rollouts"):
        buffer.take(3, version=0, timeout_s=0.1)
    assert len(buffer) == 2  # nothing taken by a take that timed out


class _Unfloatable(float):  # a Real whose conversion is the user's code, and raises
    def __float__(self) -> float:
        raise ArithmeticError("no float for this one")

    def __repr__(self) -> str:
        return "Unfloatable()"


def test_a_reward_that_raises_or_returns_no_number_drops_only_that_completion():
    scores = {
        b"a": 1.5,
        b"b": float("nan"),
        b"c": "high",
        b"d": True,
        b"e": 2,
        # Reals that float() cannot convert: the conversion raises inside the reward's own
        # try, so only these completions drop (it used to fail the generator's whole call).
        b"g": 10**400,
        b"h": fractions.Fraction(10**400, 3),
        b"i": _Unfloatable(1.0),
        b"j": fractions.Fraction(1, 4),
        # What a reward model hands back: numbers too.
        b"k": numpy.float32(0.5),
        b"l": torch.tensor(0.75),
        b"m": torch.tensor([1.25]),
        b"n": float("inf"),
        b"o": torch.tensor([1.0, 2.0]),
        b"q": torch.tensor(True),
    }

    def unruly(prompt: bytes, completion: bytes) -> Any:  # what a user may return
        if completion not in scores:
            raise RuntimeError("no score for this one")
        return scores[completion]

    answers = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"i", b"j"]
    answers += [b"k", b"l", b"m", b"n", b"o", b"q"]
    rewards, dropped = rl.score(unruly, b"p", answers)
    assert rewards[0] == 1.5 and rewards[4] == 2.0 and rewards[9] == 0.25
    assert rewards[10:13].tolist() == [0.5, 0.75, 1.25]
    assert "inf, not a finite number" in dropped[13]
    assert "returned Tensor tensor([1., 2.]), not a number" in dropped[14]
    assert "returned Tensor tensor(True), not a number" in dropped[15]
    assert all(math.isnan(rewards[i]) for i in (1, 2, 3, 5, 6, 7, 8))
    assert "nan, not a finite number" in dropped[1]
    assert "returned str 'high', not a number" in dropped[2]
    assert "returned bool True, not a number" in dropped[3]
    assert "raised RuntimeError: no score for this one" in dropped[5]
    assert "returned int 1000" in dropped[6] and "OverflowError" in dropped[6]
    assert len(dropped[6]) < 200, dropped[6]  # the 401 digits are cut: a reason is logged
    assert "returned Fraction" in dropped[7] and "OverflowError" in dropped[7]
    assert "Unfloatable()" in dropped[8] and "ArithmeticError: no float" in dropped[8]
    assert set(dropped) == {1, 2, 3, 5, 6, 7, 8, 13, 14, 15}


def test_a_completion_is_a_function_of_its_seed_and_each_seed_draws_its_own():
    # Across procs, tests/rl/test_run.py checks it: a generator's rollouts remade by another
    # proc after a SIGKILL leave the run's weights bitwise equal.
    from raymesh.examples.tinygpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(block_size=32, n_layer=1, n_head=2, n_embd=32).eval()
    prompt = torch.tensor(list(b"def "))
    seeds = [rl.sample_seed(7, 0, 3, i) for i in range(4)]
    tokens, logp = rl.sampling.sample_group(model, prompt, seeds, max_tokens=6, temperature=1.0)
    again, logp_again = rl.sampling.sample_group(
        model, prompt, seeds, max_tokens=6, temperature=1.0
    )
    assert torch.equal(tokens, again) and torch.equal(logp, logp_again)
    assert tokens.shape == (4, 6) and bool((logp <= 0).all())
    assert len({bytes(r.tolist()) for r in tokens}) > 1  # a group's completions differ
    # Alone, row 2 draws what it drew in the group: a row depends on its seed, not its place.
    [row] = rl.sampling.sample_group(model, prompt, seeds[2:3], max_tokens=6, temperature=1.0)[0]
    assert torch.equal(row, tokens[2])
    other = [rl.sample_seed(7, 1, 3, i) for i in range(4)]  # policy version 1
    assert len(set(seeds) | set(other)) == 8


def test_log_prob_and_entropy_are_the_categorical_distributions():
    from raymesh.rl.environments import log_prob_and_entropy

    logits = torch.tensor([[0.0, 1.0, -2.0], [3.0, 3.0, 3.0], [-1.0, 0.5, 0.0]])
    actions = torch.tensor([1, 0, 2])
    logp, entropy = log_prob_and_entropy(logits, actions)
    categorical = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(logp, categorical.log_prob(actions))
    assert torch.allclose(entropy, categorical.entropy())
    assert torch.isclose(entropy[1], torch.log(torch.tensor(3.0)))  # uniform: log 3
