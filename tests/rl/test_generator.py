"""The generator role on a real mesh of procs: completions are a function of (seed, version,
key, index), whichever proc makes them, and a bad reward drops only its own sample."""

from __future__ import annotations

import pytest
import torch

from raymesh import rl, this_host
from raymesh.examples import tinygpt
from raymesh.rl.generator import Generator
from raymesh.rl.sampling import sample_group, sample_seed
from tests.rl import rewards

pytestmark = pytest.mark.usefixtures("ray_cluster")

ALGORITHM = rl.GRPO(group_size=4, max_tokens=6)
ITEMS = [(3, b"def "), (8, b"import")]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return tinygpt.TinyGPT().state_dict()


def test_two_generators_make_the_same_rollouts_and_each_version_its_own():
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="generators")
    try:
        gens = procs.spawn(
            "gen", Generator, "raymesh.examples.tinygpt:build", rewards.spaces, ALGORITHM, seed=7
        )
        v0 = _weights(0)
        assert list(gens.load.call(0, v0).get(timeout=60).values()) == [0, 0]
        first, second = gens.sample.call(ITEMS).get(timeout=60).values()
        for a, b in zip(first, second, strict=True):  # made on two procs: the same
            assert (a.key, a.version) == (b.key, b.version)
            assert torch.equal(a.data.tokens, b.data.tokens)
            assert torch.equal(a.data.logp, b.data.logp)
            assert torch.equal(a.data.rewards, b.data.rewards)
        # ...and what this process makes with the same weights and seeds.
        model = tinygpt.TinyGPT()
        model.load_state_dict(v0)
        seeds = [sample_seed(7, 0, 3, i) for i in range(4)]
        tokens, logp = sample_group(
            model.eval(), torch.tensor(list(b"def ")), seeds, max_tokens=6, temperature=1.0
        )
        assert torch.equal(first[0].data.tokens, tokens) and torch.allclose(
            first[0].data.logp, logp
        )
        want = [bytes(r.tolist()).count(b" ") / 6 for r in tokens]
        assert first[0].data.rewards.tolist() == want and not first[0].data.dropped
        # A group's completions differ from each other, and a new version makes new ones.
        assert len({bytes(r.tolist()) for r in tokens}) > 1
        gens.load.call(1, _weights(1)).get(timeout=60)
        [again] = gens.slice(procs=0).sample.call(ITEMS[:1]).get(timeout=60).values()
        assert again[0].version == 1 and not torch.equal(again[0].data.tokens, tokens)
    finally:
        procs.stop()
