"""torchrun-style SPMD on real procs (`raymesh.spmd`, Monarch's names): torchrun's environment
on each proc, an `env://` process group that rendezvous at rank 0's kept store and reduces, a
script run unchanged as `__main__` with its argv, and a script that exits non-zero on one
rank failing that rank's call by name."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from raymesh import ActorError, this_host
from raymesh.actor import Actor, endpoint
from raymesh.spmd import SPMDActor, setup_torch_elastic_env

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(120)]

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_NAME")


class Peer(Actor):
    """Code written for torchrun: reads the environment, joins the group by `env://`."""

    @endpoint
    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in NAMES}

    @endpoint
    def reduce(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env://, as a torchrun script does
        try:
            x = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(x)
            return float(x)
        finally:
            dist.destroy_process_group()


SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist

out, code = sys.argv[1], int(sys.argv[2])
if __name__ != "__main__":
    raise SystemExit("not run as __main__")
if code and os.environ["RANK"] == "1":
    sys.exit(code)  # before any collective: its peer is not left waiting
if not code:
    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    dist.destroy_process_group()
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump({"sum": float(x), "argv": sys.argv[1:]}, f)
"""


def test_a_torchrun_program_runs_on_a_mesh_unchanged(tmp_path):
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="spmd")
    try:
        kept = setup_torch_elastic_env(procs)  # holds rank 0's rendezvous store
        peers = procs.spawn("peers", Peer)
        envs = peers.env.call().get(timeout=30)
        assert [e for _, e in envs.items()] == [
            {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "GROUP_RANK": "0", "ROLE_NAME": "rank"}
            for r in (0, 1)
        ]  # fmt: skip
        assert [s for _, s in peers.reduce.call().get(timeout=60).items()] == [3.0, 3.0]
        del kept

        # A script, unchanged, as __main__ with its argv, on each rank of a new rendezvous.
        script = tmp_path / "train.py"
        script.write_text(textwrap.dedent(SCRIPT))
        spmd = procs.spawn("spmd", SPMDActor)
        addr, port = spmd.slice(procs=0).get_host_port.call_one(None).get(timeout=30)
        out = str(tmp_path / "out")
        done = spmd.main.call(addr, port, [str(script), out, "0"]).get(timeout=60)
        assert [v for _, v in done.items()] == [True, True]
        for rank in (0, 1):
            got = json.loads((tmp_path / f"out.{rank}").read_text())
            assert got == {"sum": 3.0, "argv": [out, "0"]}
        # One rank exits with status 3: its call fails naming it, the other's returns.
        calls = [spmd.slice(procs=r).main.call_one(addr, port, [str(script), out, "3"])
                 for r in (0, 1)]  # fmt: skip
        assert calls[0].get(timeout=60) is True
        with pytest.raises(ActorError, match=r"train\.py .* exited with status 3 on rank 1"):
            calls[1].get(timeout=60)
        with pytest.raises(ActorError, match=r"script_args=\[\]: give the script"):
            spmd.slice(procs=0).main.call_one(addr, port, []).get(timeout=30)
    finally:
        procs.stop()
