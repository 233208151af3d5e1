"""raymesh.federated.run on the session's Ray: real client procs, a real SIGKILL, an edge
client in a process of its own over HTTPS, DP with Poisson sampling, the CLI. (Rogue clients,
the edge server's limits and DP's arithmetic need no Ray: test_rogue.py, test_edge_server.py,
tests/unit/test_federated.py.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from raymesh import federated as fl
from raymesh.examples import fedmlp
from raymesh.federated import Tls
from raymesh.federated.federation import Federation
from raymesh.federated.protocol.client import Layout
from tests.certs import self_signed
from tests.federated import helpers

REPO = Path(__file__).resolve().parents[2]


def _final(result: fl.Result) -> np.ndarray:
    return Layout.of(result.state_dict()).flatten(result.state_dict()).astype(np.float64)


def test_one_round_is_the_weighted_average_by_hand_with_and_without_secure_aggregation(
    ray_cluster,
):
    everyone = fl.FedAvg(fraction=1.0, min_clients=2)
    kw = dict(clients=6, rounds=1, hosts=2, evaluate_fn=fedmlp.evaluate)
    plain = fl.run(fedmlp.client_fn, everyone, **kw)
    secure = fl.run(fedmlp.client_fn, everyone, secure_aggregation=True, **kw)
    expected = helpers.by_hand(list(range(6)))
    np.testing.assert_allclose(_final(plain), expected, atol=1e-6)
    # Fixed point with 24 fractional bits: each weight within 2**-24 of the exact mean.
    np.testing.assert_allclose(_final(secure), expected, atol=1e-6)
    for r in (plain, secure):
        (rec,) = r.history
        assert (rec.sampled, rec.responded, rec.dropped, rec.applied) == (6, 6, {}, True)
        assert rec.metrics["accuracy"] > 0.1 and rec.metrics["loss"] > 0


def test_failing_clients_are_dropped_and_the_secure_sum_is_still_exact(ray_cluster):
    """A client that raises and one that sends NaN are dropped after sharing their seeds;
    the masks are removed from the survivors' shares and the mean is theirs exactly."""
    result = fl.run(
        helpers.faulty,
        fl.FedAvg(fraction=1.0, min_clients=2),
        clients=6,
        rounds=1,
        hosts=2,
        secure_aggregation=True,
    )
    (rec,) = result.history
    assert sorted(rec.dropped) == [helpers.RAISES, helpers.NAN]
    assert "data loader broke" in rec.dropped[helpers.RAISES]
    assert "NaN" in rec.dropped[helpers.NAN]
    assert rec.responded == 4 and rec.applied
    np.testing.assert_allclose(_final(result), helpers.by_hand([0, 1, 2, 4]), atol=1e-6)


def test_a_proc_sigkilled_mid_round_drops_its_clients_and_is_replaced(ray_cluster):
    """Client KILLS SIGKILLs the proc it runs on in round 2: that proc's three clients drop
    after sharing their seeds, the six others' sum is recovered, and round 3 runs all nine on
    a replacement proc."""
    records: list[fl.RoundRecord] = []
    result = fl.run(
        helpers.killer,
        fl.FedAvg(fraction=1.0, min_clients=2),
        clients=9,
        rounds=3,
        hosts=3,
        secure_aggregation=True,
        on_round=records.append,
    )
    assert result.history == records
    one, two, three = result.history
    on_killed = [c for c in range(9) if c % 3 == helpers.KILLS % 3]
    assert one.dropped == {} and one.replaced_hosts == 0
    assert sorted(two.dropped) == on_killed
    assert all("its proc failed" in two.dropped[c] for c in on_killed)
    assert "SIGKILL" in two.dropped[helpers.KILLS]
    assert two.applied and two.responded == 6 and two.replaced_hosts == 1
    assert three.dropped == {} and three.responded == 9 and three.applied


def test_a_client_that_hangs_past_the_timeout_drops_its_proc_for_the_round(ray_cluster):
    """A hung train_fn cannot be interrupted inside its proc: the proc misses the step's
    timeout, its clients drop for the round (the others' secure sum is recovered), and it is
    replaced; the next round runs everyone."""
    started = time.monotonic()
    one, two = fl.run(
        helpers.hanger,
        fl.FedAvg(fraction=1.0, min_clients=2),
        clients=9,
        rounds=2,
        hosts=3,
        secure_aggregation=True,
        timeout_s=4.0,
    ).history
    on_stuck = [c for c in range(9) if c % 3 == helpers.HANGS % 3]
    assert sorted(one.dropped) == on_stuck and one.applied and one.replaced_hosts == 1
    assert all("TimeoutError" in one.dropped[c] for c in on_stuck), one.dropped
    assert two.dropped == {} and two.responded == 9
    assert time.monotonic() - started < 60  # the hung proc was not waited for


def test_thousands_of_clients_on_two_procs_with_dp_report_the_accountants_epsilon(ray_cluster):
    """Under DP each client is sampled on its own with probability fraction (Poisson), so a
    round's count varies about 30; the accountant steps at that rate every round."""
    dp = fl.DP(clip=0.5, noise_multiplier=1.1, delta=1e-5)
    result = fl.run(
        fedmlp.client_fn,
        fl.FedAvg(fraction=0.01, min_clients=5),
        clients=3000,
        rounds=3,
        hosts=2,
        dp=dp,
        secure_aggregation=True,
    )
    acc = RDPAccountant()
    for rec in result.history:
        assert 5 <= rec.sampled == rec.responded <= 70 and rec.applied, rec
        acc.step(noise_multiplier=1.1, sample_rate=0.01)
        assert rec.epsilon == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    assert result.epsilon == result.history[-1].epsilon > result.history[0].epsilon > 0
    assert np.all(np.isfinite(_final(result)))


def test_an_edge_client_without_ray_joins_the_simulated_ones_over_https(ray_cluster, tmp_path):
    """The edge client runs as a plain file, in a process where `import ray` fails, and trusts
    the server's self-signed certificate through --ca-file. The server binds port 0: the
    client is started once the port is known, so no other process can take it first."""
    cert, key = self_signed(tmp_path)
    token = "edge-test-token-16"  # every server's tokens are 16 characters at least
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    config = fl.RunConfig(
        clients=3,
        rounds=1,
        hosts=1,
        secure_aggregation=True,
        edge=fl.EdgeConfig(
            token=token, wait_for=1, join_timeout_s=60, tls=Tls(cert=str(cert), key=str(key))
        ),
    )
    fed = Federation(fedmlp.client_fn, fl.FedAvg(fraction=1.0, min_clients=2), config)
    assert fed.edge is not None and fed.edge.url.startswith("https://")
    log = open(tmp_path / "edge.log", "w")  # noqa: SIM115 (the child writes to it)
    script = (
        "import sys, runpy; sys.modules['ray'] = None; "
        f"sys.argv = ['device.py', '--server', '{fed.edge.url}', '--token-file', '{token_file}', "
        f"'--ca-file', '{cert}', '--client', 'raymesh/examples/fedmlp.py:client_fn']; "
        "runpy.run_path('raymesh/federated/edge/device.py', run_name='__main__')"
    )
    edge = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=log, stderr=log)
    try:
        result = fed.run()
        assert edge.wait(timeout=30) == 0
    finally:
        edge.kill()
        log.close()
    out = (tmp_path / "edge.log").read_text()
    assert "edge client 3: answered 4 messages" in out, out  # advertise, share, fit, unmask
    assert "process list" not in out and "plain http" not in out and token not in out
    (rec,) = result.history
    assert (rec.sampled, rec.responded, rec.dropped) == (4, 4, {})
    # The edge client built fedmlp's client 3 on its side: the mean is all four's, by hand.
    np.testing.assert_allclose(_final(result), helpers.by_hand([0, 1, 2, 3]), atol=1e-6)


def test_the_cli_runs_a_job_file_with_a_line_per_round(ray_cluster, tmp_path):
    from raymesh._src import backend

    job = tmp_path / "job.toml"
    job.write_text(
        "hosts = 1\n"
        + (REPO / "examples" / "federated.toml").read_text().replace("rounds = 10", "rounds = 2")
        + "\n[edge]\npoll_s = 1.0\n"  # no device joins: the run serves them HTTPS all the same
    )
    cert, key = self_signed(tmp_path)
    env = {**os.environ, "RAYMESH_ADDRESS": backend.address(), "RAYMESH_WARM_PROCS": "0"}
    env.pop("RAYMESH_FL_TOKEN", None)
    env["TMPDIR"] = str(tmp_path)  # where the generated token's folder goes
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    out = subprocess.run(
        [sys.executable, "-m", "raymesh.cli.main", "federated", str(job), "--clients", "20", *tls],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "round 2/2 [####################] clients 8/8 dropped 0 accuracy" in out.stderr
    assert "done: 2/2 rounds applied, accuracy" in out.stdout
    assert "--server https://127.0.0.1:" in out.stderr  # the edge server spoke TLS
    token_file = Path(out.stderr.split("token generated into ")[1].split()[0])
    token = token_file.read_text().strip()
    assert len(token) >= 24 and token not in out.stdout + out.stderr
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    job.write_text(
        'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 1\n'
        '[strategy]\nname = "fedsgd"\n'
    )
    bad = subprocess.run(
        [sys.executable, "-m", "raymesh.cli.main", "federated", str(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 2
    assert "strategy.name='fedsgd': choose one of ['fedadam', 'fedavg'" in bad.stderr
