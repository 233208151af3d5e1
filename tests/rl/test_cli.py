"""`raymesh rl job.toml` as a user runs it: a line per step, the post-trained policy saved as a
raymesh.train checkpoint that serving rebuilds; a bad job file is one line naming the field."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raymesh import rl
from raymesh.cli.main import main
from raymesh.dashboard.runs import Runs
from raymesh.train.export import rebuild

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

JOB = """
policy = "tests.rl.rewards:build"
reward = "raymesh.examples.rewards:python_lines"
prompts = ["def ", "x = "]
steps = 3
prompts_per_step = 2
generators = 1
max_staleness = 1
checkpoint = "{out}"
run_dir = "{out}/run"
[grpo]
group_size = 4
max_tokens = 6
"""


def test_raymesh_rl_runs_an_asynchronous_job_and_saves_a_checkpoint_serving_rebuilds(
    tmp_path, capsys
):
    job = tmp_path / "grpo.toml"
    job.write_text(JOB.format(out=tmp_path / "out"))
    assert main(["rl", str(job)]) == 0
    out, err = capsys.readouterr()
    steps = [line.split() for line in err.splitlines() if line.startswith("step ")]
    assert [s[1] for s in steps] == ["1/3", "2/3", "3/3"]
    # Asynchronous: one generator samples the next step's keys while the learner learns, with
    # the version it has, so steps 2 and 3 learn from samples one version late (a synchronous
    # run shows 0 at every step). Every sample of every step is there (2 prompts x 4).
    assert [s[s.index("staleness") + 1] for s in steps] == ["0.00", "1.00", "1.00"], steps
    assert all(s[s.index("samples") + 1 : s.index("dropped") + 2] == ["8", "dropped", "0"]
               for s in steps), steps  # fmt: skip
    assert f"saved {tmp_path / 'out' / 'step-00000003'}" in out
    # The run folder is the learner job's, as a train job writes it: a JSON line per step,
    # the learner's figures (loss, world size, each rank's) and the loop's (reward, samples).
    rows = [json.loads(line) for line in (tmp_path / "out" / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["samples"] == 8 and r["dropped"] == 0 and "reward_mean" in r, r
        assert r["world_size"] == 1 and len(r["rank_loss"]) == 1 and r["loss"] == r["loss"], r
        # 8 completions of 6 tokens a step, over the loop's cycle
        assert r["tokens"] == 48 and r["tokens_per_s"] > 0, r
    events = [json.loads(line) for line in (tmp_path / "out" / "run" / "events.jsonl").open()]
    states = [e["state"] for e in events if e["event"] == "state"]
    assert states == ["Starting", "Running", "Finishing", "Finished"], states
    roles = [(e["role"], e["count"]) for e in events if e["event"] == "role"]
    assert roles == [("generators", 1), ("learner", 1)], roles
    # The dashboard reads the run folder as a job's: finished, at step 3, with its reward.
    run = Runs(tmp_path / "out").get("run")
    assert run is not None
    summary = run.summary()
    assert summary["status"] == "finished" and summary["kind"] == "rl", summary
    assert summary["step"] == summary["steps"] == 3 and summary["reward"] == rows[-1]["reward_mean"]
    task = rebuild(tmp_path / "out")  # what `raymesh serve --checkpoint` and export do
    assert task.model.vocab == 256
    # Started from the build's weights, three GRPO steps later they moved.
    torch.manual_seed(0)
    fresh = rebuild(None, build="tests.rl.rewards:build", seed=0).model.state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in task.model.state_dict().items())


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.toml"


def _example(tmp_path: Path, name: str, init: Path) -> Path:
    """examples/grpo.toml with its own settings (TinyGPT from a checkpoint, 8 prompts, 4 a step,
    8 completions of 40 bytes each, 2 generators one version behind, seed 0), but: its init
    made here at once (not after the README's 300 steps), 5 steps, a checkpoint every step
    under tmp_path with a run folder, and its reward slowed for half the prompts."""
    text = EXAMPLE.read_text()
    out = tmp_path / name
    for old, new in (
        ('init = "runs/tinygpt"', f'init = "{init}"'),
        ('checkpoint = "runs/tinygpt-grpo"', f'checkpoint = "{out}"\nrun_dir = "{out / "run"}"'),
        ("steps = 30", "steps = 5"),
        ("checkpoint_every = 10", "checkpoint_every = 1"),
        ("raymesh.examples.rewards:python_lines", "tests.rl.rewards:slow_lines"),
    ):
        assert old in text, f"examples/grpo.toml changed ({old!r}): change this test with it"
        text = text.replace(old, new)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _out_of_order(step: Path) -> bool:
    """Whether the checkpoint `step` took keys out of order (False once it is rotated away)."""
    try:
        return bool(_position(step)["taken"])
    except OSError:
        return False


def _position(step: Path) -> dict:
    """The RL position saved in the checkpoint `step` (its manifest's extra["rl"])."""
    return json.loads((step / "manifest.json").read_text())["extra"]["rl"]


def test_the_example_job_sigkilled_resumes_asynchronously_taking_each_sample_once(
    tmp_path, capsys, kills
):
    """examples/grpo.toml's settings, asynchronous with 2 generators, from an `init`
    checkpoint. Half the prompts score slowly, so one generator falls behind and a step takes
    keys out of order. The controller (`raymesh rl`, a process of its own on this session's
    Ray) is SIGKILLed after a random checkpoint >= 2, one whose position holds keys taken out
    of order; `raymesh rl --resume` makes the keys not taken, and only those: its final
    checkpoint has taken each of the 5 steps' 20 keys once, and the dashboard a row per step.
    Then a hostile manifest (its position edited) is refused, naming the field."""
    from raymesh import train
    from raymesh._src import backend
    from raymesh.train.checkpoint import Checkpointer

    # The example's policy from a raymesh.train run (one step, seeded unlike the RL run), as
    # the README's `raymesh train` makes it.
    init = tmp_path / "init"
    ckpt = train.CheckpointConfig(dir=str(init))
    config = train.TrainConfig(steps=1, global_batch_size=4, seed=1, checkpoint=ckpt)
    train.fit("raymesh.examples.tinygpt:build", config)
    # A policy of another size than init's model is refused by name before the learner starts.
    with pytest.raises(
        ValueError,
        match=r"^the generators could not start: .*init='.*' does "
        r"not fit policy='tests.rl.rewards:build' \(init's job trained policy="
        r"'raymesh.examples.tinygpt:build'\).* of another shape",
    ):
        rl.run(
            policy="tests.rl.rewards:build",
            init=str(init),
            prompts=["def "],
            reward="tests.rl.rewards:es",
            steps=1,
            prompts_per_step=1,
            generators=1,
        )
    job = _example(tmp_path, "killed", init)
    saved = tmp_path / "killed"
    log = tmp_path / "controller.log"  # a file, not a pipe: nothing blocks the controller
    target = kills.randint(2, 4)  # the version whose checkpoint the kill follows
    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    with log.open("w") as stderr:
        controller = subprocess.Popen(
            [sys.executable, "-m", "raymesh.cli.main", "rl", str(job)],
            cwd=Path(__file__).parents[2],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 180
        # The kill follows the first checkpoint >= target whose position holds keys taken out
        # of order (the case under test; on a loaded machine an early one may hold none).
        while not any(int(p.name[5:]) >= target and _out_of_order(p) for p in saved.glob("step-*")):
            assert controller.poll() is None, f"{kills}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{kills}: no step {target}: {log.read_text()}"
            time.sleep(0.05)
        controller.send_signal(signal.SIGKILL)
    finally:
        controller.kill()
        controller.wait(timeout=60)
    latest = Checkpointer(saved).latest()
    assert latest is not None, kills
    before = _position(latest)
    # Keys taken past the first not taken: the out-of-order restore is what resumes here.
    assert before["taken"], f"{kills}: {latest.name} took its keys in order: {before}"
    missing = set(range(before["taken_below"], max(before["taken"]))) - set(before["taken"])
    capsys.readouterr()
    assert main(["rl", str(job), "--resume"]) == 0
    out = capsys.readouterr().out
    resumed = int(re.search(r"resumed from version (\d+)", out)[1])  # type: ignore[index]
    assert resumed == int(latest.name[5:]) >= target, (out, kills)
    # The run folder appends, as a train job's: a step made again after the kill has a
    # line again, and the dashboard keeps the newest from that step on.
    run = Runs(saved).get("run")
    assert run is not None and run.summary()["status"] == "finished"
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4, 5], kills
    rows = run.rows
    assert all(r["samples"] + r["dropped"] == 32 and r["staleness_mean"] <= 1 for r in rows)
    final = Checkpointer(saved).latest()
    assert final is not None and final.name == "step-00000005"
    after = _position(final)
    taken = set(range(after["taken_below"])) | set(after["taken"])
    # Each of the 20 keys once (a key taken twice would leave fewer), the missing ones among them.
    assert len(taken) == 20 and missing <= taken, (before, after, kills)
    # init= : the learner started from the init checkpoint, not from the build's own weights.
    torch.manual_seed(0)
    fresh = rebuild(None, build="raymesh.examples.tinygpt:build", seed=0).model.state_dict()
    start = rebuild(init).model.state_dict()
    end = rebuild(saved).model.state_dict()

    def distance(a: dict, b: dict) -> float:
        return sum(float((a[k].float() - b[k].float()).norm()) for k in a)

    assert distance(end, start) < distance(end, fresh), (distance(end, start), kills)
    # A hostile manifest: a position whose keys reach a trillion past the first not taken is
    # refused before it is expanded, naming the field (it used to be expanded, without bound).
    manifest = json.loads((final / "manifest.json").read_text())
    manifest["extra"]["rl"] = {"taken_below": 20, "taken": [10**12]}
    (final / "manifest.json").write_text(json.dumps(manifest))
    assert main(["rl", str(job), "--resume"]) == 2
    assert "extra.rl.taken=[1000000000000]: holds" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("reward = ", "reward = 3 #"), r"reward=3: name a function"),
        (("steps = 3", "steps = 0"), r"steps=0: give an integer >= 1"),
        (("group_size = 4", "group_size = 1"), r"group_size=1"),
        (('prompts = ["def ", "x = "]', "prompts = []"), r"prompts=\[\]: give a non-empty"),
        (("generators = 1", "generators = 1\nwarp = 9"), r"unknown key\(s\) \['warp'\]"),
    ],
)
def test_a_bad_job_file_names_the_file_and_the_field(tmp_path, capsys, change, message):
    job = tmp_path / "bad.toml"
    job.write_text(JOB.format(out=tmp_path / "out").replace(*change))
    with pytest.raises(ValueError, match=message):
        rl.load_rl_job(job)
    assert main(["rl", str(job)]) == 2
    assert str(job) in capsys.readouterr().err


def test_the_readmes_rl_job_file_reads_as_a_valid_job():
    from pathlib import Path

    job = rl.load_rl_job(Path(__file__).resolve().parents[2] / "examples" / "grpo.toml")
    assert job.policy == "raymesh.examples.tinygpt:build" and job.init == "runs/tinygpt"
    assert job.checkpoint == "runs/tinygpt-grpo" and job.max_staleness == 1
    longest = max(len(p.encode()) for p in job.prompts)
    assert isinstance(job.algorithm, rl.GRPO)
    assert longest + job.algorithm.max_tokens <= 64  # within tinygpt's context (block_size)
    from raymesh.examples.rewards import python_lines

    # 4 lines: one compiles with a word; a comment, a bare number and a syntax error do not.
    assert python_lines(b"def ", b"f(x): pass\n# a comment\n42\nx = \n") == 0.25
    # lines that compile with a warning (a str called, an invalid escape) warn nobody
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert python_lines(b"x = ", b'"a"()\ny = "\\d"\n') == 1.0
    assert caught == []


PPO_JOB = """
steps = 2
env_runners = 1
checkpoint = "{out}"
[ppo]
env = "CartPole-v1"
epochs = 2
minibatches = 2
rollout_steps = 16
envs_per_runner = 2
[trainer]
workers = 1
"""


def test_a_ppo_job_file_runs_prints_its_lines_and_checkpoints(tmp_path, capsys):
    job = tmp_path / "ppo.toml"
    job.write_text(PPO_JOB.format(out=tmp_path / "out"))
    assert main(["rl", str(job)]) == 0
    out, err = capsys.readouterr()
    lines = [line.split() for line in err.splitlines() if line.startswith("step ")]
    assert [s[1] for s in lines] == ["1/2", "2/2"] and all(s[2] == "return" for s in lines)
    assert all(s[s.index("env_steps") + 1] == "32" for s in lines), lines
    # a version is 2 epochs x 2 minibatches: 4 train steps of the learner job
    assert f"saved {tmp_path / 'out' / 'step-00000008'}" in out
    for change, message in (
        (("[ppo]", 'reward = "x:y"\n[ppo]'), r"reward='x:y': environment RL \(rl\.PPO\)"),
        (("[ppo]", "[grpo]\n[ppo]"), r"give \[grpo\] or \[ppo\], not both"),
        (('env = "CartPole-v1"', 'env = "CartPole-v1"\nwarp = 1'), r"\[ppo\] has unknown"),
    ):
        job.write_text(PPO_JOB.format(out=tmp_path / "out").replace(*change))
        with pytest.raises(ValueError, match=message):
            rl.load_rl_job(job)
