"""`raymesh rl job.toml` as a user runs it: a line per step, the post-trained policy saved as a
raymesh.train checkpoint that serving rebuilds; a bad job file is one line naming the field."""

from __future__ import annotations

import json
import os
import random
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
    # Within the staleness bound, and every sample of every step there (2 prompts x 4).
    assert all(0 <= float(s[s.index("staleness") + 1]) <= 1 for s in steps), steps
    assert all(s[s.index("samples") + 1] == "8" for s in steps), steps
    assert f"saved {tmp_path / 'out' / 'step-00000003'}" in out
    # A JSON line per step in the run folder, with the step's timing and what it learned.
    rows = [json.loads(line) for line in (tmp_path / "out" / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["step_s"] >= r["learn_s"] + r["sync_s"] > 0 and r["rollouts_per_s"] > 0, r
        assert r["samples"] == 8 and "reward_mean" in r, r
        # 8 completions of 6 tokens a step
        assert r["tokens_per_s"] == pytest.approx(48 / r["step_s"]), r
        assert r["samples_per_s"] == pytest.approx(8 / r["step_s"]), r
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


def test_a_controller_sigkilled_at_a_random_step_resumes_to_the_uninterrupted_runs_weights(
    tmp_path, capsys
):
    """The controller (`raymesh rl`, a process of its own on this session's Ray) is SIGKILLed
    after a random number of steps, mid-step or mid-save; `raymesh rl --resume` continues
    from its newest checkpoint and ends, synchronous, bitwise where the run that was not
    interrupted ends, with one metrics line per step."""
    from raymesh._src import backend

    def job(name: str) -> Path:
        path = tmp_path / f"{name}.toml"
        text = JOB.format(out=tmp_path / name).replace("steps = 3", "steps = 5")
        # a reward the policy learns from at once: the samples taken decide the weights
        text = text.replace("raymesh.examples.rewards:python_lines", "tests.rl.rewards:es")
        text = text.replace("max_staleness = 1", "max_staleness = 0\ncheckpoint_every = 1")
        path.write_text(text)
        return path

    assert main(["rl", str(job("whole"))]) == 0
    metrics = tmp_path / "killed" / "run" / "metrics.jsonl"
    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    controller = subprocess.Popen(
        [sys.executable, "-m", "raymesh.cli.main", "rl", str(job("killed"))],
        cwd=Path(__file__).parents[2],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        lines = random.randint(1, 3)
        deadline = time.monotonic() + 120
        saved = tmp_path / "killed"
        while not (
            metrics.exists()
            and len(metrics.read_text().splitlines()) >= lines
            and any(saved.glob("step-*"))
        ):
            assert controller.poll() is None, controller.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the controller made no steps"
            time.sleep(0.05)
        controller.send_signal(signal.SIGKILL)
    finally:
        controller.kill()
        controller.wait(timeout=60)
    capsys.readouterr()
    assert main(["rl", str(job("killed")), "--resume"]) == 0
    out = capsys.readouterr().out
    resumed = int(re.search(r"resumed from version (\d+)", out)[1])  # type: ignore[index]
    assert 1 <= resumed < 5, out
    assert [json.loads(line)["step"] for line in metrics.open()] == [1, 2, 3, 4, 5]
    whole = rebuild(tmp_path / "whole").model.state_dict()
    weights = rebuild(tmp_path / "killed").model.state_dict()
    assert all(torch.equal(whole[k], v) for k, v in weights.items())


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
    assert longest + job.grpo.max_tokens <= 64  # within tinygpt's context (block_size)
    from raymesh.examples.rewards import python_lines

    # 4 lines: one compiles with a word; a comment, a bare number and a syntax error do not.
    assert python_lines(b"def ", b"f(x): pass\n# a comment\n42\nx = \n") == 0.25
