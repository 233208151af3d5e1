"""raymesh.federated's parts without Ray: partitions, strategies, secure aggregation, DP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from raymesh.federated import (
    DP,
    FedAdam,
    FedAvg,
    FedProx,
    FedYogi,
    FixedPoint,
    PrivacyAccountant,
    SecAggClient,
    SecAggError,
    SecAggServer,
    Update,
    clip_update,
    dirichlet_partition,
)
from raymesh.federated.secagg import default_degree, neighbours

SIZE = 257


def secure_sum(updates: dict[int, np.ndarray], *, drop=(), degree=8, threshold=5, round_=3):
    """Runs one round of the protocol as the server sees it; returns (sum, server, masked)."""
    fp = FixedPoint()
    clients = {u: SecAggClient(u, round_) for u in updates}
    server = SecAggServer(round_, SIZE, threshold=threshold)
    graph = neighbours(updates, degree, seed=round_)
    peers = server.advertised([c.advertise() for c in clients.values()], graph)
    inbox = server.route({u: c.share(peers[u], threshold) for u, c in clients.items()})
    for u, c in clients.items():
        c.receive(inbox.get(u, {}))
    masked = {}
    for u, c in clients.items():
        if u not in drop:
            masked[u] = c.mask(fp.encode(updates[u]))
            server.add([u], masked[u])
    answers = {u: clients[u].unmask(server.dropped) for u in server.survivors}
    return server.finish(answers), server, masked


def test_dirichlet_partition_covers_every_example_once_and_is_skewed():
    labels = np.random.default_rng(0).integers(0, 10, 5000)
    parts = dirichlet_partition(labels, 50, alpha=0.3, seed=1, min_size=5)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(5000))
    assert min(len(p) for p in parts) >= 5
    # Non-IID: a typical client's most common label holds far more than the IID 10 %.
    top = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    assert np.median(top) > 0.3
    again = dirichlet_partition(labels, 50, alpha=0.3, seed=1, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    with pytest.raises(ValueError, match="alpha=0"):
        dirichlet_partition(labels, 5, alpha=0)


def test_fedavg_is_the_example_weighted_average_by_hand():
    rng = np.random.default_rng(0)
    w = {
        "a": rng.normal(size=(3, 4)).astype(np.float32),
        "b": rng.normal(size=4).astype(np.float32),
    }
    local = [
        {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in w.items()} for _ in range(3)
    ]
    n = [10, 30, 60]
    ups = [Update(i, {k: local[i][k] - w[k] for k in w}, n[i]) for i in range(3)]
    got = FedAvg().aggregate(w, ups)
    for k in w:
        by_hand = (10 * local[0][k] + 30 * local[1][k] + 60 * local[2][k]) / 100
        np.testing.assert_allclose(got[k], by_hand, rtol=1e-5, atol=1e-6)
        assert got[k].dtype == np.float32


def test_strategies_sample_configure_and_step():
    s = FedAvg(fraction=0.1, min_clients=8)
    picked = s.sample(4, list(range(1000)))
    assert len(picked) == 100 and picked == s.sample(4, list(range(1000)))
    assert picked != s.sample(5, list(range(1000)))
    assert len(FedAvg(fraction=0.01, min_clients=8).sample(1, list(range(100)))) == 8
    assert FedProx(mu=0.1).client_config(1)["proximal_mu"] == 0.1
    w = {"a": np.zeros(3, np.float32)}
    d = {"a": np.array([1.0, -2.0, 0.0])}
    adam, yogi = FedAdam(server_lr=0.1), FedYogi(server_lr=0.1)
    a1 = adam.apply(w, d)["a"]
    # Adam's first step moves each coordinate by about server_lr in the delta's direction.
    np.testing.assert_allclose(np.sign(a1), [1, -1, 0])
    assert np.all(np.abs(a1) <= 0.1 + 1e-6)
    y1 = yogi.apply(w, d)["a"]
    assert np.all(np.sign(y1) == np.sign(a1))
    with pytest.raises(ValueError, match="fraction=0"):
        FedAvg(fraction=0)
    with pytest.raises(ValueError, match="beta1"):
        FedAdam(beta1=1.0)


def test_secure_sum_is_exact_and_matches_the_plain_sum():
    rng = np.random.default_rng(1)
    ups = {u: rng.normal(0, 0.5, SIZE) for u in range(20)}
    total, server, _ = secure_sum(ups)
    fp = FixedPoint()
    exact = np.zeros(SIZE, np.uint64)
    for x in ups.values():
        exact += fp.encode(x)
    assert np.array_equal(total, exact)
    np.testing.assert_allclose(fp.decode(total), sum(ups.values()), atol=20 * 2**-24)
    assert server.dropped == []


def test_no_single_masked_update_reveals_the_update():
    ups = {u: np.full(SIZE, 0.25 * (u + 1)) for u in range(12)}
    _, _, masked = secure_sum(ups)
    fp = FixedPoint()
    for u, y in masked.items():
        plain = fp.encode(ups[u])
        # What the server holds is the update plus a uniform mask: about half the top bits set,
        # nothing like the constant input, and no coordinate equal to it.
        assert 0.3 < np.mean(y >> np.uint64(63)) < 0.7
        assert not np.any(y == plain)
        assert np.std(fp.decode(y)) > 1e9
    # Nor does the difference of two clients' masked updates cancel their masks.
    diff = masked[0] - masked[1]
    assert not np.any(diff == fp.encode(ups[0]) - fp.encode(ups[1]))


def test_dropped_clients_masks_are_removed_exactly():
    rng = np.random.default_rng(2)
    ups = {u: rng.normal(0, 1, SIZE) for u in range(30)}
    drop = {3, 11, 17}
    total, server, _ = secure_sum(ups, drop=drop, degree=8, threshold=4)
    assert server.dropped == sorted(drop)
    fp = FixedPoint()
    exact = np.zeros(SIZE, np.uint64)
    for u, x in ups.items():
        if u not in drop:
            exact += fp.encode(x)
    assert np.array_equal(total, exact)


def test_too_many_dropouts_and_tampered_shares_raise():
    ups = {u: np.ones(SIZE) for u in range(6)}
    with pytest.raises(SecAggError, match="too many clients dropped"):
        secure_sum(ups, drop={0, 1, 2, 3}, degree=8, threshold=4)
    a, b = SecAggClient(0, 1), SecAggClient(1, 1)
    ads = {0: a.advertise(), 1: b.advertise()}
    to_b = a.share(ads, 1)[1]
    b.share(ads, 1)
    b.receive({0: to_b[:-1] + bytes([to_b[-1] ^ 1])})
    with pytest.raises(SecAggError, match="does not verify"):
        b.unmask(dropped=[0])
    server = SecAggServer(1, SIZE, threshold=1)
    with pytest.raises(SecAggError, match="shared no seeds"):
        server.add([5], np.zeros(SIZE, np.uint64))
    with pytest.raises(SecAggError, match="fixed point"):
        FixedPoint().encode(np.array([1e20]))


def test_neighbour_graph_is_symmetric_and_logarithmic():
    g = neighbours(range(1000), default_degree(1000), seed=4)
    assert all(u in g[v] for u in g for v in g[u])
    assert max(len(v) for v in g.values()) == default_degree(1000) == 20
    assert neighbours(range(5), 8, seed=0)[0] == [1, 2, 3, 4]


def test_dp_clipping_and_epsilon_match_opacus():
    d = {"a": np.array([3.0, 4.0]), "b": np.array([0.0])}
    clipped = clip_update(d, 1.0)
    np.testing.assert_allclose(clipped["a"], [0.6, 0.8])
    assert clip_update({"a": np.array([0.3])}, 1.0)["a"][0] == 0.3
    dp = DP(clip=1.0, noise_multiplier=0.8, delta=1e-5)
    acc = PrivacyAccountant(dp)
    assert acc.epsilon == 0.0
    eps = [acc.step(0.1) for _ in range(20)]
    ref = RDPAccountant()
    for _ in range(20):
        ref.step(noise_multiplier=0.8, sample_rate=0.1)
    assert eps[-1] == pytest.approx(ref.get_epsilon(delta=1e-5))
    assert all(a < b for a, b in itertools.pairwise(eps))
    noise = acc.noise((20000,), np.random.default_rng(0))
    assert noise.std() == pytest.approx(0.8, rel=0.03)
    with pytest.raises(ValueError, match="delta=2"):
        DP(delta=2)


def test_messages_round_trip_through_json_and_strangers_are_refused():
    import json

    from raymesh.federated.client import Layout
    from raymesh.federated.protocol import Fit, Fitted, decode, encode

    layout = Layout(("w", "b"), ((2, 3), (3,)))
    fit = Fit(
        round=4,
        clients=(7,),
        weights=np.arange(9, dtype=np.float32),
        layout=layout,
        config={"local_epochs": 2},
        secure=True,
        clip=None,
        budget_s=5.0,
        inbox={7: {3: b"\x00\xffcipher"}},
    )
    back = decode(json.loads(json.dumps(encode(fit))))
    assert back.layout == layout and back.inbox == fit.inbox and back.config == fit.config
    np.testing.assert_array_equal(back.weights, fit.weights)
    masked = np.array([1, 2**64 - 1], np.uint64)
    reply = decode(json.loads(json.dumps(encode(Fitted(4, {7: 10}, {7: {}}, {}, masked)))))
    assert reply.masked.dtype == np.uint64 and reply.masked.tolist() == masked.tolist()
    with pytest.raises(ValueError, match=r"unknown message type 'os\.system'"):
        decode({"$": "os.system"})
    with pytest.raises(ValueError, match="array dtype 'object'"):
        decode({"$a": "AAAA", "dtype": "object", "shape": [1]})
    with pytest.raises(ValueError, match="cannot reshape"):
        decode({"$a": "AAAAAAAAAAA=", "dtype": "float32", "shape": [5]})


def test_run_config_and_job_file_errors_name_the_field_and_the_fix(tmp_path):
    from raymesh.federated import RunConfig
    from raymesh.federated.jobfile import load_job

    with pytest.raises(ValueError, match="rounds=0: give an integer >= 1"):
        RunConfig(clients=10, rounds=0)
    with pytest.raises(ValueError, match="clients=0: give simulated clients, or edge clients"):
        RunConfig(clients=0, rounds=1)
    job = tmp_path / "job.toml"
    job.write_text(
        'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 2\n'
        "[strategy]\nfraction = 0.5\nmu = 0.1\n"
    )
    with pytest.raises(ValueError, match=r"\[strategy\] has unknown key\(s\) \['mu'\]"):
        load_job(job)
    job.write_text(
        'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 2\n'
        '[strategy]\nname = "fedprox"\nmu = 0.1\n[dp]\nclip = -1.0\n'
    )
    with pytest.raises(ValueError, match=r"\[dp\] clip=-1.0: give the L2 bound"):
        load_job(job)
    job.write_text(
        'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 2\nsecure = true\n'
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['secure'\]"):
        load_job(job)
    job.write_text(
        'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 2\n'
        '[strategy]\nname = "fedprox"\nmu = 0.1\n[edge]\nwait_for = 2\n'
    )
    loaded = load_job(job, rounds=5)
    assert loaded.strategy.mu == 0.1 and loaded.config.rounds == 5
    assert loaded.config.edge.wait_for == 2 and loaded.config.edge.host == "127.0.0.1"


def test_a_participant_drops_a_failing_client_and_masks_the_others():
    """The client side alone: one client's train_fn raises, the proc's sum is the others'."""
    import torch

    from raymesh.federated import Client
    from raymesh.federated.client import Layout
    from raymesh.federated.protocol import Advertise, Fit, Participant, ShareSeeds, Unmask

    def train(model, data, config):
        if config["client"] == 2:
            raise OSError("disk gone")
        with torch.no_grad():
            model.weight.add_(float(config["client"]))
        return 10

    clients = {c: Client(torch.nn.Linear(2, 1, bias=False), None, train) for c in range(4)}
    p = Participant(clients.__getitem__)
    layout = Layout.of(clients[0].model.state_dict())
    start = np.zeros(layout.size, np.float32)
    server = SecAggServer(1, layout.size + 1, threshold=2)
    peers = server.advertised(
        p.handle(Advertise(1, (0, 1, 2, 3))).adverts, neighbours(range(4), 8, 1)
    )
    inbox = server.route(p.handle(ShareSeeds(1, 2, peers)).outgoing)
    fitted = p.handle(Fit(1, (0, 1, 2, 3), start, layout, {}, True, None, 10.0, inbox))
    assert list(fitted.examples) == [0, 1, 3] and "OSError: disk gone" in fitted.failed[2]
    server.add(fitted.examples, fitted.masked)
    total = FixedPoint().decode(server.finish(p.handle(Unmask(1, tuple(server.dropped))).answers))
    # Each client moved every weight by its cid, weighted by its 10 examples.
    np.testing.assert_allclose(total, [10 * (0 + 1 + 3)] * layout.size + [30])
