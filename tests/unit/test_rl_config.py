"""`rl.RLConfig`: one config that `rl.run` takes and a job file is, each section checking its
own fields on construction (no Ray, no procs)."""

from __future__ import annotations

import pytest

from raymesh import rl
from raymesh.rl.config import RolloutConfig, SaveConfig, TaskConfig

pytestmark = pytest.mark.timeout(30)

GRPO_RUN = dict(
    steps=2, policy="tests.rl.rewards:build", prompts=["def "], reward="tests.rl.rewards:es"
)


def test_the_sections_are_the_flat_fields_and_a_list_of_prompts_is_frozen():
    config = rl.RLConfig(**GRPO_RUN, generators=3, checkpoint="c", checkpoint_every=2)
    assert isinstance(config.algorithm, rl.GRPO) and config.prompts == ("def ",)
    assert config.rollout == RolloutConfig(
        prompts_per_step=4,
        generators=3,
        env_runners=2,
        max_staleness=0,
        timeout_s=300.0,
        reward_timeout_s=60.0,
    )
    assert config.save == SaveConfig(checkpoint="c", checkpoint_every=2, resume=False, run_dir=None)
    assert isinstance(config.task, TaskConfig) and config.task.reward == "tests.rl.rewards:es"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, r"^steps=0: give an integer >= 1"),
        ({"generators": 0}, r"^generators=0"),
        ({"max_staleness": -1}, r"^max_staleness=-1"),
        ({"timeout_s": 0}, r"^timeout_s=0"),
        ({"prompts": []}, r"^prompts=\[\]: give a non-empty list of strings"),
        ({"prompts": "def "}, r"^prompts='def ': give a non-empty list of strings"),
        ({"reward": 3}, r"^reward=3: name a function as 'module:function'"),
        ({"policy": None}, r"^policy=None: give a train build function"),
        ({"policy": "nocolon"}, r"^policy='nocolon': name a function"),
        ({"params": {"lr": 1}, "init": "runs/x"}, r"^params=.*init's checkpoint brings"),
        ({"resume": True}, r"^resume=True: give checkpoint= the folder"),
        ({"checkpoint_every": 3}, r"^checkpoint_every=3: give checkpoint= the folder"),
        ({"trainer": 2}, r"^trainer=2: give a dict of train.TrainConfig fields"),
        ({"algorithm": "grpo"}, r"^algorithm='grpo': give rl.GRPO"),
    ],
)
def test_a_bad_field_is_refused_by_name_with_its_value_and_the_fix(change, message):
    with pytest.raises(ValueError, match=message):
        rl.RLConfig(**{**GRPO_RUN, **change})


def test_ppo_takes_no_prompts_reward_or_init_and_needs_no_policy():
    cartpole = rl.PPO(env="CartPole-v1")
    assert rl.RLConfig(steps=1, algorithm=cartpole).task.policy is None
    for name, value in (("prompts", ["x"]), ("reward", "m:f"), ("init", "runs/x")):
        with pytest.raises(ValueError, match=rf"^{name}=.*environment RL \(rl\.PPO\) takes none"):
            rl.RLConfig(steps=1, algorithm=cartpole, **{name: value})


def test_run_refuses_a_keyword_that_is_no_field_before_anything_starts():
    with pytest.raises(TypeError, match=r"^rl.run: \['warp'\] are no rl.RLConfig fields"):
        rl.run(**GRPO_RUN, warp=1)
    with pytest.raises(TypeError, match=r"give an rl.RLConfig, not dict"):
        rl.run(GRPO_RUN)  # type: ignore[arg-type]
    # a config's fields replaced by keywords are checked as a new config's
    with pytest.raises(ValueError, match=r"^steps=0"):
        rl.run(rl.RLConfig(**GRPO_RUN), steps=0)


def test_a_job_file_is_an_rl_config(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \n\nclass \n")
    job = tmp_path / "job.toml"
    job.write_text(
        f'steps = 3\npolicy = "m:build"\nreward = "m:score"\nprompts_file = "{prompts}"\n'
        "[grpo]\ngroup_size = 4\n[trainer]\nworkers = 2\n[params]\nlr = 0.5\n"
    )
    config = rl.load_rl_job(job, steps=5, resume=None)
    assert config.steps == 5 and config.prompts == ("def ", "class ")
    assert config.algorithm == rl.GRPO(group_size=4)
    assert config.trainer == {"workers": 2} and config.params == {"lr": 0.5}
    for top, table, message in (
        ('prompts = ["x"]\n', "", r"prompts_file=.*give prompts or prompts_file, not both"),
        ('algorithm = "ppo"\n', "", r"algorithm='ppo': give a \[grpo\] or a \[ppo\] table"),
        ("", '[ppo]\nenv = "CartPole-v1"\n', r"give \[grpo\] or \[ppo\], not both"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(top + job.read_text() + table)
        with pytest.raises(ValueError, match=rf"^{bad}: .*{message}"):
            rl.load_rl_job(bad)


def test_a_job_files_keys_are_its_own_and_a_ppo_job_refuses_prompts_unread(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('steps = 1\nwarp = 2\n[ppo]\nenv = "CartPole-v1"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warp'\]; the keys are \[.*'grpo'"):
        rl.load_rl_job(job)
    job.write_text('steps = 1\nprompts_file = "/nonexistent"\n[ppo]\nenv = "CartPole-v1"\n')
    with pytest.raises(ValueError, match=r"prompts_file='/nonexistent': a \[ppo\] job takes none"):
        rl.load_rl_job(job)
    # a long value is summarised, not printed whole
    with pytest.raises(ValueError, match=r"^prompts='<list of 500>': environment RL"):
        rl.RLConfig(steps=1, algorithm=rl.PPO(env="CartPole-v1"), prompts=["def "] * 500)
