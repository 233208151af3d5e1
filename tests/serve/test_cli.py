"""`raymesh serve job.toml`: the command a user runs, as a real subprocess on the session's Ray."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import torch

from tests.serve.helpers import Client, mlp_checkpoint, mlp_outputs


def test_raymesh_serve_serves_a_job_file_until_interrupted(ray_cluster, tmp_path):
    from raymesh._src import backend

    checkpoint = mlp_checkpoint(tmp_path / "ck", seed=1)
    job = tmp_path / "job.toml"
    job.write_text(
        f'build = "raymesh.examples.mlp:build"\n[checkpoint]\ndir = "{checkpoint}"\n'
        "[serve]\nreplicas = 1\nmax_batch_size = 8\n"
    )
    env = dict(
        os.environ,
        RAYMESH_ADDRESS=backend.address(),
        RAYMESH_WARM_PROCS="0",
        RAYMESH_SERVE_TOKEN="from-env",
    )
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raymesh.cli.main", "serve", str(job), "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"serving (http://\S+)", log.read_text())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        url = found.group(1)
        x = [0.1] * 32
        status, _, body = Client(url, "from-env").post("/v1/predict", {"x": x})
        assert status == 200, body
        expected = mlp_outputs(checkpoint, [x])[0]
        torch.testing.assert_close(torch.tensor(body["y"]), torch.tensor(expected))
        assert Client(url).post("/v1/predict", {"x": x})[0] == 401  # the token from the env
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_raymesh_serve_without_a_checkpoint_says_how_to_make_one(tmp_path, capsys):
    from raymesh.cli.main import main

    job = tmp_path / "job.toml"
    job.write_text(f'build = "raymesh.examples.mlp:build"\n[checkpoint]\ndir = "{tmp_path}/no"\n')
    assert main(["serve", str(job)]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint there" in err and "raymesh train" in err
    assert main(["serve", "reload"]) == 2
    assert "give --checkpoint NEW" in capsys.readouterr().err
