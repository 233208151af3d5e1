"""`raymesh serve job.toml`: the command a user runs, as a real subprocess on the session's Ray."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import torch

from tests.serve.helpers import Client, mlp_checkpoint, mlp_outputs
from tests.waiting import wait_for


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
        RAYMESH_SERVE_TOKEN="from-env-token-0123",
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

        def serving() -> re.Match[str] | None:
            assert proc.poll() is None, log.read_text()  # it died: say why, do not wait on
            return re.search(r"serving (http://\S+)", log.read_text())

        url = wait_for(serving, 120, what="raymesh serve's URL", interval=0.2).group(1)
        x = [0.1] * 32
        status, _, body = Client(url, "from-env-token-0123").post("/v1/predict", {"x": x})
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


def test_raymesh_serve_refuses_an_admin_token_without_a_root_and_half_a_tls_pair(
    tmp_path, capsys, monkeypatch
):
    from raymesh.cli.main import main
    from raymesh.serve.config import ADMIN_TOKEN_ENV

    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    job = tmp_path / "job.toml"
    job.write_text(f'build = "raymesh.examples.mlp:build"\n[checkpoint]\ndir = "{checkpoint}"\n')
    assert main(["serve", str(job), "--admin-token", "admin-token-0123456"]) == 2  # nothing starts
    assert "checkpoint_root=None: an admin token" in capsys.readouterr().err
    assert main(["serve", str(job), "--tls-cert", str(job)]) == 2
    assert "tls_key is missing" in capsys.readouterr().err
    argv = ["serve", "reload", "--checkpoint", str(checkpoint)]
    assert main(argv) == 2
    assert ADMIN_TOKEN_ENV in capsys.readouterr().err
    assert (
        main([*argv, "--admin-token", "admin-token-0123456", "--tls-cert", str(job)]) == 2
    )  # an http:// URL
    assert "give its https:// URL" in capsys.readouterr().err
