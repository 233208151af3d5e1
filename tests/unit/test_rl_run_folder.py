"""raymesh.rl's run folder on a resume: each step keeps one metrics line."""

from __future__ import annotations

import json

import pytest

from raymesh.rl.run_folder import RunFolder


@pytest.mark.parametrize("start", [0, 1])
def test_a_run_starting_at_a_version_drops_the_lines_of_later_steps_and_a_torn_one(tmp_path, start):
    # The controller died after writing step 2's line (and half a line): the checkpoint it
    # resumes from is version `start` (0: it died before its first checkpoint).
    rows = [json.dumps({"step": s, "reward_mean": 0.5}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 3, "rew')
    folder = RunFolder(tmp_path, steps=4, algorithm="GRPO", start=start)
    for version in range(start + 1, 5):
        folder({"version": float(version), "reward_mean": 1.0})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]
