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
    assert host["cpus"] >= 8 and host["gpus"] == 0


MULTI_HOST = textwrap.dedent(
    """
    import json
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    import ray
    ray.init(address=cluster.address)
    from raymesh import Actor, endpoint, host_mesh
    import ray as _ray

    class Where(Actor):
        @endpoint
        def node(self):
            return _ray.get_runtime_context().get_node_id()

    hosts = host_mesh()
    procs = hosts.spawn_procs(per_host={"procs": 2})
    nodes = procs.spawn("where", Where).node.call().get(timeout=120)
    print("RESULT", json.dumps({
        "sizes": procs.sizes,
        "host_ids": hosts.node_ids,
        "by_point": [[dict(p), n] for p, n in nodes.items()],
    }))
    procs.stop()
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_host_mesh_spans_every_node_and_pins_procs_to_their_host(tmp_path):
    out = run_cluster_script(tmp_path / "multi.py", MULTI_HOST, timeout=300)
    assert out["sizes"] == {"hosts": 2, "procs": 2}
    hosts = out["host_ids"]
    for point, node in out["by_point"]:
        assert node == hosts[point["hosts"]], out
