"""Monarch's docs examples, as raymesh runs them (examples/monarch/): they run as a script,
and must finish and print what Monarch's do.

They spawn `gpus` axes, which on this GPU-less machine are only names (CPU procs), as in
Monarch's own CPU runs of them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ..scripts import run_python

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "monarch"

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _cpu_spmd_example(into: Path) -> Path:
    """spmd_ddp.py beside a copy of Monarch's train.py made for CPUs: gloo for NCCL, no
    `.cuda()`. The copy is made by exact substitutions that must each apply, so a change to
    train.py fails here rather than running something else."""
    script = (EXAMPLES / "train.py").read_text()
    for gpu, cpu in (
        ('init_process_group("nccl")', 'init_process_group("gloo")'),
        ("    torch.cuda.set_device(local_rank)\n", ""),
        ("nn.Linear(10, 1).cuda()", "nn.Linear(10, 1)"),
        ("torch.randn(4, 10).cuda()", "torch.randn(4, 10)"),
    ):
        assert script.count(gpu) == 1, gpu
        script = script.replace(gpu, cpu)
    (into / "train.py").write_text(script)
    shutil.copy(EXAMPLES / "spmd_ddp.py", into / "spmd_ddp.py")
    return into / "spmd_ddp.py"


def _run_all(*examples: Path) -> str:
    """The examples, one after the other, in one script process that joins this session's
    Ray cluster (as `RAYMESH_ADDRESS=<head> python example.py` would): a Ray of their own per
    example would cost ~20 s more each on a 2-core machine."""
    from raymesh._src import backend

    env = dict(
        os.environ, RAYMESH_ADDRESS=backend.address(), RAY_DEDUP_LOGS="0", RAYMESH_WARM_PROCS="0"
    )
    run = "; ".join(f"runpy.run_path({str(path)!r}, run_name='__main__')" for path in examples)
    return run_python(["-c", f"import runpy; {run}"], env, timeout=380)


@pytest.mark.timeout(400)
def test_monarchs_docs_examples_run_with_only_their_imports_changed(
    tmp_path: Path,
):
    names = ("ping_pong.py", "getting_started.py", "rdma.py")
    out = _run_all(*(EXAMPLES / name for name in names), _cpu_spmd_example(tmp_path))
    # ping_pong: the actors' prints reach the script's stdout (forwarded by Ray, prefixed by
    # proc; some after the script's own last line)
    assert "Example completed successfully!" in out.splitlines()
    assert "Identity: " in out and "msg='hey there, from script!!'" in out
    assert "Pong!, Receiver (actor_1:" in out  # (actor_0's come last: not waited for)
    # getting_started
    assert "Counter value: 0" in out
    assert "Trainer " in out and " taking a step." in out
    assert "Step with data <fake data 1> and input = None" in out
    assert "It didn't say hello" in out
    assert "Actor rank: " in out
    # rdma: the worker's read_into returned (a failed read raises, and the script with it);
    # the bytes it moves are checked in test_rdma.py. spmd_ddp: 4 ranks trained 5 DDP steps
    assert "DDP example completed successfully!" in out.splitlines()
    for rank in range(4):
        assert f"[Rank {rank}] Step 0 loss=" in out, rank


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4,
    reason="Monarch's SPMD example as written spawns 4 procs that each take a GPU (NCCL)",
)
@pytest.mark.timeout(300)
def test_monarchs_spmd_example_runs_unchanged_on_four_gpus():
    out = _run_all(EXAMPLES / "spmd_ddp.py")
    assert "DDP example completed successfully!" in out.splitlines()


@pytest.mark.timeout(330)
def test_monarchs_debugging_example_runs_its_debugger_session_driven_by_the_script():
    """16 actors pause at breakpoint(); the script's own thread types Monarch's walk-through
    at `raymesh debug`'s prompt; the ranks that raise pause post-mortem; the final `get()`
    raises, as Monarch's does (status 1)."""
    import subprocess
    import sys

    from raymesh._src import backend

    env = dict(os.environ, RAYMESH_ADDRESS=backend.address(), RAYMESH_WARM_PROCS="0")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "debugging.py"), "--drive"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1 and "ValueError: bad rank" in done.stderr, out + done.stderr
    assert out.count("debugging.py:59  breakpoint") >= 16  # the first `list`
    assert "(Pdb) rank\n13\n(Pdb) detach\nDetached from debugee[13]; it stays paused" in out
    assert "--- rank 4 ---\n--Call--" in out  # cast ranks(2:7:2) s
    assert out.count("post-mortem: ValueError: bad rank") == 4  # ranks 10, 14; then 2, 6
    assert "resumed: debugee[2], debugee[6]" in out
