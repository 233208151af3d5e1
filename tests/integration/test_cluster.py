"""Connecting to an existing Ray cluster, several hosts, and the `raymesh` command."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

import raymesh
from raymesh._src import backend

from ..scripts import run_cluster_script, run_python

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_version_and_info_on_an_existing_cluster():
    env = dict(os.environ, RAYMESH_ADDRESS=backend.address())
    assert run_python(["-m", "raymesh.cli.main", "--version"], env).strip() == (
        f"raymesh {raymesh.__version__}"
    )
    info = json.loads(run_python(["-m", "raymesh.cli.main", "info", "--json"], env))
    assert info["raymesh"] == raymesh.__version__
    assert info["address"] == backend.address()  # joined this session's cluster, started none
    [host] = info["hosts"]
    assert host["cpu_slots"] >= 8 and host["cores"] == len(os.sched_getaffinity(0))
    text = run_python(["-m", "raymesh.cli.main", "info"], env)
    row = next(line for line in text.splitlines() if line.startswith(host["hostname"][:20]))
    assert row.split()[2:4] == [str(host["cores"]), f"{host['cpu_slots']:g}"], text
    if host["cpu_slots"] > host["cores"]:  # the embedded Ray: slots are not cores, said once
        assert "Size a job by cores, not slots" in text, text


MULTI_HOST = textwrap.dedent(
    """
    import dataclasses, json, os, subprocess, sys
    from ray.cluster_utils import Cluster
    # A head without CPUs (a cluster's usual head) and two hosts of 4: one a machine made a
    # host by its own command (Monarch's bootstrap), named as Monarch names workers. (One: two
    # `ray start` nodes on one machine collide on a port of Ray's.)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=4)
    workers = ["tcp://host-a:26600"]
    code = ("import sys; from raymesh.actor import run_worker_loop_forever as run; "
            "run(address=sys.argv[1], ca='trust_all_connections', num_cpus=4)")
    env = dict(os.environ, RAYMESH_ADDRESS=cluster.address)
    machines = [subprocess.Popen([sys.executable, "-c", code, w], env=env) for w in workers]
    import ray
    ray.init(address=cluster.address)
    head = ray.get_runtime_context().get_node_id()  # the driver runs on the head
    from raymesh import Actor, endpoint, host_mesh
    from raymesh.actor import PlacementError, attach_to_workers
    import ray as _ray

    attached = attach_to_workers(workers=workers, ca="trust_all_connections", timeout=120)
    try:  # a worker that never joins: no mesh, an error naming it
        attach_to_workers(workers=[workers[0], "tcp://host-c:1"], ca="trust_all_connections",
                          timeout=1)
        unknown = None
    except TimeoutError as e:
        unknown = str(e)

    class Where(Actor):
        @endpoint
        def node(self):
            return _ray.get_runtime_context().get_node_id()

    hosts, everything = host_mesh(), host_mesh(all_hosts=True)
    procs = hosts.spawn_procs(per_host={"procs": 2})
    nodes = procs.spawn("where", Where).node.call().get(timeout=120)
    procs.stop()
    try:  # the head is a host of all_hosts, where no proc fits
        everything.spawn_procs(per_host={"procs": 1}, timeout=10)
        error = None
    except PlacementError as e:
        error = str(e)

    # Training across the two hosts, 2 ranks each, with a budget that DDP exceeds: auto weighs
    # HSDP (a shard group per host) against FSDP over all 4 with the planner's estimate.
    import logging
    from raymesh import train
    from raymesh.examples import mlp

    said = []  # what the controller logged about placement and strategy, to explain a failure

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage()[:400])

    logging.getLogger("raymesh").addHandler(Keep())
    logging.getLogger("raymesh").setLevel(logging.INFO)
    import torch
    from raymesh.train.estimate import estimate
    config = train.TrainConfig(
        workers=4, steps=4, global_batch_size=16, cpus_per_worker=2, activation_bytes=0
    )
    task = mlp.build(train.Context(rank=0, world_size=4, local_rank=0, local_world_size=2,
                                   device=torch.device("cpu"), seed=0, config=config))
    est = estimate(task.model, task.optimizer, activation_bytes=0)  # what each rank measures
    budget = (est.ddp_bytes() + est.fsdp_bytes(2)) / 2 / 0.8 / 2**30
    seen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local")
    os.makedirs(seen, exist_ok=True)

    def build(ctx):  # each rank says where it sits on its host, as the context and env have it
        with open(os.path.join(seen, str(ctx.rank)), "w") as f:
            json.dump([_ray.get_runtime_context().get_node_id(), ctx.local_rank,
                       ctx.local_world_size, os.environ["LOCAL_RANK"],
                       os.environ["LOCAL_WORLD_SIZE"]], f)
        return mlp.build(ctx)

    hsdp = train.fit(build, dataclasses.replace(config, memory_budget_gb=budget))
    local = {int(r): json.load(open(os.path.join(seen, r))) for r in os.listdir(seen)}
    print("RESULT", json.dumps({
        "head": head, "all": everything.node_ids, "error": error,
        "sizes": procs.sizes,
        "host_ids": hosts.node_ids,
        "by_point": [[dict(p), n] for p, n in nodes.items()],
        "decision": [hsdp.decision.strategy, hsdp.decision.shard_size, hsdp.decision.reason],
        "placement": hsdp.placement,
        "losses": [h["loss"] for h in hsdp.history],
        "local": [local[r] for r in sorted(local)],
        "said": said,
        "attached": [attached.node_ids, attached.sizes], "unknown": unknown,
    }))
    for m in machines:
        m.terminate()  # ends each machine's node with it
        m.wait(timeout=60)
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.mark.timeout(300)  # a cluster of 3 nodes and a training run, on 2 cores
def test_host_mesh_spans_every_node_leaves_out_a_head_without_cpus_and_pins_procs(tmp_path):
    """Hosts joined by `run_worker_loop_forever`, picked by `attach_to_workers`."""
    out = run_cluster_script(tmp_path / "multi.py", MULTI_HOST, timeout=300)
    assert out["sizes"] == {"hosts": 2, "procs": 2}
    hosts, head = out["host_ids"], out["head"]
    # host_mesh() leaves out a head without CPUs; all_hosts=True includes it, and a proc on
    # every one of its hosts cannot be placed.
    assert head not in hosts and out["all"][0] == head and set(out["all"]) == {head, *hosts}
    assert out["error"] and "CPU" in out["error"], out["error"]
    for point, node in out["by_point"]:
        assert node == hosts[point["hosts"]], out
    strategy, shard_size, reason = out["decision"]
    assert (strategy, shard_size) == ("hsdp", 2), reason
    assert "estimated communication" in reason and "vs ddp" in reason, "\n".join(out["said"])
    assert out["placement"].startswith("hsdp 2x2 on 4 CPU procs of 2 host(s)"), out["placement"]
    assert len(out["losses"]) == 4 and all(x == x for x in out["losses"])
    # LOCAL_RANK is the rank among the host's ranks (ranks 0,1 on one host, 2,3 on the other).
    local = out["local"]
    nodes = [n for n, *_ in local]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes) == set(hosts), local
    assert [x[1:] for x in local] == [[0, 2, "0", "2"], [1, 2, "1", "2"]] * 2, local
    # attach_to_workers: exactly the named machine's host; a worker never seen fails closed.
    attached, sizes = out["attached"]
    assert len(attached) == 1 and attached[0] in hosts and sizes == {"hosts": 1}, out["attached"]
    assert "workers ['tcp://host-c:1'] did not join the cluster" in out["unknown"], out["unknown"]


FROM_A_THREAD = """
import json, threading, time
from raymesh.actor import Actor, endpoint, host_mesh, this_host


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


# The embedded Ray starts on a pool thread that then ends, as when a thread pool spawns the
# first meshes: Ray's node processes die with the thread that started them unless raymesh
# starts them from one that lives on.
starter = threading.Thread(target=host_mesh)
starter.start()
starter.join()
time.sleep(3)
procs = this_host().spawn_procs({"procs": 1}, timeout=60)
got = procs.spawn("echo", Echo).echo.call_one(7).get(timeout=60)
print("RESULT " + json.dumps({"echo": got}))
"""


def test_the_embedded_ray_outlives_the_thread_that_started_it(tmp_path):
    assert run_cluster_script(tmp_path / "thread.py", FROM_A_THREAD, timeout=120) == {"echo": 7}


JOB = """
import json, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from raymesh import Actor, cluster, endpoint, this_host

class Plus(Actor):
    @endpoint
    def plus(self, x):
        return x + 1

procs = this_host().spawn_procs(per_host={"procs": 2})
replies = list(procs.spawn("plus", Plus).plus.call(1).get(timeout=120).values())
print("RESULT " + json.dumps({"replies": replies, "address": cluster.address()}), flush=True)
procs.stop()
"""


@pytest.mark.timeout(300)
def test_a_program_submitted_with_ray_job_submit_runs_on_that_cluster(tmp_path):
    """`ray job submit -- python job.py` against a head started here (loopback only, Ray's
    token auth on): the job attaches to that cluster (RAY_ADDRESS), spawns and answers."""
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    import psutil

    from raymesh._common import free_port
    from raymesh._src.backend.local_runtime import stop_tree

    from ..waiting import wait_for

    gcs, dashboard, agent = (free_port("127.0.0.1") for _ in range(3))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAYMESH_"))}
    # No warm procs: the job spawns 2, and 8 more starting beside them would only slow it.
    env.update(RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAYMESH_WARM_PROCS="0")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [
            ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
            f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}", "--num-cpus=4", "--include-dashboard=true",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    work = tmp_path / "job"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    submit = [
        ray_cli, "job", "submit", f"--address=http://127.0.0.1:{dashboard}",
        f"--working-dir={work}", "--", "python", "job.py",
    ]  # fmt: skip
    try:

        def dashboard_up() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=5)
            except urllib.error.HTTPError:
                return True  # it answers (401: Ray's token is asked for)
            except OSError:
                return False
            return True

        wait_for(dashboard_up, 120, what="the head's dashboard", interval=0.5)

        def submitted() -> subprocess.CompletedProcess | None:
            out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=240)
            # Until the head's job agent is up, the submission is refused: try again.
            return None if "No available agent" in out.stderr + out.stdout else out

        out = wait_for(submitted, 240, what="the job submitted", interval=2)
        assert out.returncode == 0, out.stdout + out.stderr
        [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        result = json.loads(line[len("RESULT ") :])
        assert result == {"replies": [2, 2], "address": f"127.0.0.1:{gcs}"}, result
    finally:
        stop_tree(psutil.Process(head.pid), 30)
