"""The GRPO learner's step in this process (no Ray): the rank's task (`GRPOTask`) on the loop's
samples (`completion_samples`): its batched log-probabilities, its KL term to the initial
policy, and the tokens that count."""

from __future__ import annotations

import torch

from raymesh import rl
from raymesh.rl.buffer import Rollout
from raymesh.rl.learner import GRPOTask, collate_completions, completion_logp, completion_samples
from raymesh.rl.sampling import Completions, sample_group
from raymesh.train import Context


class Learner:
    """A one-rank learner in this process: the rank's task, stepped as a rank steps it."""

    def __init__(self, policy: str, algorithm: rl.GRPO) -> None:
        ctx = Context.alone()
        torch.manual_seed(0)
        self.task = GRPOTask(policy, algorithm)(ctx)
        self.model = self.task.model
        self.version = 0

    def learn(self, rollouts: list[Rollout]) -> dict:
        samples, figures = completion_samples(rollouts, self.version)
        loss, stats = self.task.loss_fn(self.model, self.task.collate_fn(samples))
        self.task.optimizer.zero_grad()
        loss.backward()
        self.task.optimizer.step()
        self.version += 1
        return {**stats, **figures}


POLICY = "tests.rl.rewards:build"  # a one-block TinyGPT


def _rollouts(learner: Learner, prompts: list[bytes], max_tokens: int = 6) -> list[Rollout]:
    out = []
    for key, prompt in enumerate(prompts):
        seeds = [rl.sample_seed(0, 0, key, i) for i in range(4)]
        tokens, logp = sample_group(
            learner.model, torch.tensor(list(prompt)), seeds, max_tokens=max_tokens, temperature=1.0
        )
        rewards = torch.tensor([float(i) for i in range(4)], dtype=torch.float64)
        out.append(Rollout(key=key, version=0, data=Completions(prompt, tokens, logp, rewards)))
    return out


def test_the_batched_log_probabilities_are_each_rows_own_forward_whatever_the_prompt_lengths():
    learner = Learner(POLICY, rl.GRPO(group_size=4))
    prompts = [b"def ", b"x", b"import os"]
    rollouts = _rollouts(learner, prompts)
    samples, _ = completion_samples(rollouts, 0)
    with torch.no_grad():
        batched = completion_logp(learner.model, collate_completions(samples), 1.0)
        for i, sample in enumerate(samples):
            alone = completion_logp(learner.model, collate_completions([sample]), 1.0)
            torch.testing.assert_close(batched[i : i + 1], alone, rtol=1e-5, atol=1e-5)
    # and the sampler recorded the same values: a fresh policy's ratio is 1
    torch.testing.assert_close(
        batched, torch.cat([r.data.logp for r in rollouts]), atol=1e-4, rtol=1e-4
    )


def test_a_kl_weight_keeps_the_initial_policy_and_reports_the_divergence_from_it():
    plain = Learner(POLICY, rl.GRPO(group_size=4))
    assert plain.task.loss_fn.reference is None
    assert "kl" not in plain.learn(_rollouts(plain, [b"def "]))

    learner = Learner(POLICY, rl.GRPO(group_size=4, kl=0.5))
    first = learner.learn(_rollouts(learner, [b"def ", b"for "]))
    assert first["kl"] == 0.0  # the first step is taken at the reference itself
    second = learner.learn(_rollouts(learner, [b"def ", b"for "]))
    assert second["kl"] > 0.0  # one update later the policy has moved away from it
    reference = dict(learner.task.loss_fn.reference.named_parameters())
    assert all(not p.requires_grad for p in reference.values())
    assert any(not torch.equal(p, reference[n]) for n, p in learner.model.named_parameters())


def test_a_completion_ends_with_its_first_end_of_text_token_and_a_byte_policy_never_ends():
    from raymesh.rl.generator import _lengths

    tokens = torch.tensor([[5, 9, 2, 9], [9, 1, 1, 1], [1, 2, 3, 4]])
    assert _lengths(tokens, eos=9).tolist() == [2, 1, 4]
    assert _lengths(tokens, eos=None).tolist() == [4, 4, 4]


def test_the_tokens_after_the_end_of_text_token_take_no_part_in_the_loss():
    learner = Learner(POLICY, rl.GRPO(group_size=4))
    rollouts = _rollouts(learner, [b"def "])
    data = rollouts[0].data
    # Ended after its first token, completion 0's other tokens are anything: the same step.
    ended = torch.tensor([1, 6, 6, 6])
    varied = data.tokens.clone()
    varied[0, 1:] = (varied[0, 1:] + 7) % 256
    twins = [Learner(POLICY, rl.GRPO(group_size=4)) for _ in range(2)]
    for twin, tokens in zip(twins, (data.tokens, varied)):
        completions = Completions(data.prompt, tokens, data.logp, data.rewards, lengths=ended)
        twin.learn([Rollout(key=0, version=0, data=completions)])
    a, b = (dict(t.model.named_parameters()) for t in twins)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_loss_is_the_token_level_mean_of_the_whole_step_however_the_ranks_split_it():
    # Completions of unequal lengths (end-of-text at 1, 3, 6 tokens...): a rank's mean over its
    # own tokens would weigh a short completion's tokens more on a rank with fewer tokens.
    learner = Learner(POLICY, rl.GRPO(group_size=4))
    rollouts = _rollouts(learner, [b"def ", b"import "])
    lengths = torch.tensor([1, 3, 6, 2])
    for r in rollouts:
        r.data.lengths = lengths
    samples, _ = completion_samples(rollouts, 0)
    with torch.no_grad():
        whole, _ = learner.task.loss_fn(learner.model, collate_completions(samples))
        batch = collate_completions(samples)
        logp = completion_logp(learner.model, batch, 1.0)
        reference, _ = rl.grpo_loss(logp, batch["old"], batch["advantage"], batch["mask"], clip=0.2)
        torch.testing.assert_close(whole, reference)
        # Split 3 : 5 over two ranks, each weighed by its share as a rank's loss is, then
        # averaged as DDP averages the ranks' gradients: the same loss.
        parts = [samples[:3], samples[3:]]
        shares = [
            learner.task.loss_fn(learner.model, collate_completions(p))[0] * len(p) * 2 / 8
            for p in parts
        ]
        torch.testing.assert_close(sum(shares) / 2, whole)
