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
from raymesh.cli.main import main as cli_main
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


RESTARTED = """
import os, pathlib, sys
import torch
import torch.distributed as dist
import sibling  # beside the script, as `python train.py` finds it

out, mode = sys.argv[1], sys.argv[2]
flag = pathlib.Path(out + ".flag")
if os.environ["RANK"] == "1" and (mode == "always" or not flag.exists()):
    flag.touch()
    sys.exit(3)  # rank 0 waits for it in the rendezvous: the attempt ends both
dist.init_process_group("gloo")
x = torch.tensor([1.0])
dist.all_reduce(x)
dist.destroy_process_group()
pathlib.Path(out + "." + os.environ["RANK"]).write_text(str(float(x)))
"""


def test_raymesh_run_restarts_the_group_after_a_rank_fails_and_says_why_when_out_of_restarts(
    tmp_path, capsys, monkeypatch
):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RESTARTED))
    (tmp_path / "sibling.py").write_text("")
    out = str(tmp_path / "out")
    # Run from the script's folder, naming it and its output relatively, as one runs torchrun:
    # the ranks run in the launcher's folder, whatever folder their procs started in.
    monkeypatch.chdir(tmp_path)
    run = ["run", "--nproc_per_node", "2", "--max-restarts", "1", "train.py"]
    assert cli_main([*run, "out", "once"]) == 0
    assert "succeeded at attempt 2" in capsys.readouterr().out
    assert [(tmp_path / f"out.{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
    # Every attempt fails on rank 1: status 1, one line naming the rank and its exit status.
    assert cli_main(["run", "--nproc-per-node", "2", str(script), out, "always"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("raymesh run: ") and "failed in 1 attempt(s)" in said, said
    assert "rank 1: " in said and "exited with status 3 on rank 1" in said, said
    # torchrun's rendezvous flags are refused by name, with what to do instead.
    assert cli_main(["run", "--rdzv_endpoint", "h:29500", str(script)]) == 2
    assert "--rdzv-endpoint: raymesh rendezvous at rank 0's proc" in capsys.readouterr().err


IN_PLACE = """
import os, pathlib, signal, sys, time
import torch
import torch.distributed as dist

out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
rank, again = os.environ["RANK"], (out / "flag").exists()
(out / f"pid.{rank}.{int(again)}").write_text(str(os.getpid()))
if mode == "hang" and not again:
    if rank == "1":
        (out / "flag").touch()
        sys.exit(3)
    time.sleep(300)  # in no collective: it never learns of rank 1, and is replaced
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
if mode == "kill" and not again and rank == "2":
    (out / "flag").touch()
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(x)  # the survivors' collective fails: their peer is gone
(out / f"sum.{rank}").write_text(str(float(x)))
"""


def test_a_restart_replaces_only_the_lost_ranks_procs(tmp_path, monkeypatch):
    from raymesh import spmd

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(IN_PLACE))

    def pids(folder, rank):
        return [(folder / f"pid.{rank}.{a}").read_text() for a in (0, 1)]

    # 4 ranks, rank 2 SIGKILLed between two all-reduces: its proc is new in attempt 2, and the
    # three whose collective failed run the script again in the procs they ran it in.
    out = tmp_path / "kill"
    out.mkdir()
    attempts = spmd.launch([str(script), str(out), "kill"], nproc_per_node=4, max_restarts=1)
    assert len(attempts) == 2 and 2 in attempts[0].failures, attempts
    assert [(out / f"sum.{r}").read_text() for r in range(4)] == ["40.0"] * 4
    same = {r: len(set(pids(out, r))) == 1 for r in range(4)}
    assert same == {0: True, 1: True, 2: False, 3: True}, same
    # A survivor that never notices (it sleeps, in no collective) is killed and replaced once
    # its drain time is up, rather than keeping the restart waiting.
    monkeypatch.setattr(spmd, "_DRAIN_S", 1.0)
    out = tmp_path / "hang"
    out.mkdir()
    attempts = spmd.launch([str(script), str(out), "hang"], nproc_per_node=2, max_restarts=1)
    assert [sorted(a.failures) for a in attempts] == [[1], []], attempts
    assert [len(set(pids(out, r))) for r in (0, 1)] == [2, 1]
