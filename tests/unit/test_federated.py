"""raymesh.federated's parts without Ray: partitions, strategies, secure aggregation, DP, the
checks on every answer, the edge server's limits, and whole rounds on clients in this process
(tests.federated.helpers.LocalFederation)."""

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
from raymesh.federated.protocol.secagg import PART_BYTES, default_degree, neighbours

SIZE = 257


def secure_sum(
    updates: dict[int, np.ndarray],
    *,
    drop=(),
    degree=8,
    threshold=5,
    round_=3,
    unshared=(),
    tamper=None,
):
    """Runs one round of the protocol as the server sees it; returns (sum, server, masked).
    `unshared` clients advertise but their shares never reach the server; `tamper(answers)`
    may change the survivors' step-4 answers before the server sees them."""
    fp = FixedPoint()
    clients = {u: SecAggClient(u, round_) for u in updates}
    server = SecAggServer(round_, SIZE, threshold=threshold)
    graph = neighbours(updates, degree, seed=round_)
    peers = server.advertised([c.advertise() for c in clients.values()], graph)
    outgoing = {u: c.share(peers[u], threshold) for u, c in clients.items() if u not in unshared}
    inbox = server.route(outgoing)
    for u, c in clients.items():
        c.receive(inbox.get(u, {}))
    masked = {}
    for u, c in clients.items():
        if u not in drop and u not in unshared:
            masked[u] = c.mask(fp.encode(updates[u]))
            server.add([u], masked[u])
    answers = {u: clients[u].unmask(server.dropped) for u in server.survivors}
    if tamper is not None:
        tamper(answers)
    return server.finish(answers), server, masked


def exact(updates: dict[int, np.ndarray], counted) -> np.ndarray:
    fp = FixedPoint()
    out = np.zeros(SIZE, np.uint64)
    for u in counted:
        out += fp.encode(updates[u])
    return out


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


def test_too_many_dropouts_raise_and_a_client_skips_a_share_it_cannot_decrypt():
    ups = {u: np.ones(SIZE) for u in range(6)}
    with pytest.raises(SecAggError, match="too many clients dropped"):
        secure_sum(ups, drop={0, 1, 2, 3}, degree=8, threshold=4)
    a, b, c = SecAggClient(0, 1), SecAggClient(1, 1), SecAggClient(2, 1)
    ads = {0: a.advertise(), 1: b.advertise(), 2: c.advertise()}
    to_b = a.share(ads, 1)[1]
    from_c = c.share(ads, 1)[1]
    b.share(ads, 1)
    b.receive({0: to_b[:-1] + bytes([to_b[-1] ^ 1]), 2: from_c})
    # The forged share is skipped (its reason kept), the good one still revealed.
    assert list(b.unmask(dropped=[0, 2])) == [2]
    assert "does not decrypt" in b.skipped[0]
    # Asked later for the other seed of a peer, a client skips it instead of failing.
    assert b.unmask(dropped=[]) == {} and "both seeds" in b.skipped[2]
    server = SecAggServer(1, SIZE, threshold=1)
    with pytest.raises(SecAggError, match="shared no seeds"):
        server.add([5], np.zeros(SIZE, np.uint64))
    with pytest.raises(SecAggError, match="fixed point"):
        FixedPoint().encode(np.array([1e20]))


def test_a_client_that_advertised_but_never_shared_is_in_nobodys_masks():
    """Its shares were refused (or its proc died) after its keys went out: the others mask
    only with the neighbours whose shares reached them, so the sum is still exact."""
    rng = np.random.default_rng(5)
    ups = {u: rng.normal(0, 1, SIZE) for u in range(7)}
    total, server, _ = secure_sum(ups, unshared={2}, drop={5}, degree=8, threshold=3)
    assert server.dropped == [5] and 2 not in server.survivors
    assert np.array_equal(total, exact(ups, [0, 1, 3, 4, 6]))


def test_low_order_and_malformed_public_keys_are_refused_at_advert_time():
    from raymesh.federated.protocol.checks import BadUpdate, Checks
    from raymesh.federated.protocol.messages import Advertise, Adverts
    from raymesh.federated.protocol.secagg import KeyAdvert, advert_problem, key_problem

    low_order = [
        bytes(32),
        (1).to_bytes(32, "little"),
        bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
        bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
        (2**255 - 20).to_bytes(32, "little"),  # p - 1, of order 2
    ]
    for raw in low_order:
        assert "low-order" in key_problem(raw), raw.hex()
    assert "canonical" in key_problem((2**255 - 1).to_bytes(32, "little"))
    assert "32 bytes" in key_problem(b"short") and "not str" in key_problem("k" * 32)
    good = SecAggClient(7, 1).advertise()
    assert advert_problem(good) is None and key_problem(good.c_public) is None
    bad = KeyAdvert(7, good.c_public, low_order[2], good.b_commit)
    assert "s_public: a public key is a low-order point" in advert_problem(bad)
    assert "b_commit" in advert_problem(KeyAdvert(7, good.c_public, good.s_public, b"x"))
    check = Checks(SIZE, 100)
    with pytest.raises(BadUpdate, match="low-order"):
        check(Advertise(1, (7,)), [7], Adverts(1, (bad,)))
    # A client handed a bad neighbour key fails to share: one client, not its proc.
    with pytest.raises(SecAggError, match="neighbour 7"):
        SecAggClient(8, 1).share({7: bad}, 1)


def test_a_wrong_share_is_skipped_and_never_trusted():
    """A holder reveals wrong bytes for a survivor's self-mask seed and for a dropped client's
    key seed: each rebuilt seed is verified (the key against its advert, the self-mask seed
    against its commitment), the sets with a wrong share fail, one without it is found, and
    the sum is exact. With every share of a seed wrong, the round fails rather than sum."""
    rng = np.random.default_rng(3)
    ups = {u: rng.normal(0, 1, SIZE) for u in range(7)}

    def liar(answers):
        for owner, (which, idx, _) in list(answers[4].items()):
            answers[4][owner] = (which, idx, bytes(PART_BYTES))

    total, server, _ = secure_sum(ups, drop={6}, degree=8, threshold=3, tamper=liar)
    assert np.array_equal(total, exact(ups, range(6)))
    assert server.ignored == {}  # well-formed: only verification tells them apart

    def all_wrong_for_0(answers):
        for holder in answers:
            if 0 in answers[holder]:
                which, idx, _ = answers[holder][0]
                answers[holder][0] = (which, idx, bytes(PART_BYTES))

    with pytest.raises(SecAggError, match="client 0's b seed verifies"):
        secure_sum(ups, drop={6}, degree=8, threshold=3, tamper=all_wrong_for_0)


def test_shares_of_the_wrong_seed_index_or_holder_are_left_out_with_the_reason():
    rng = np.random.default_rng(4)
    ups = {u: rng.normal(0, 1, SIZE) for u in range(6)}

    def mixed(answers):
        (owner, (which, idx, share)), *_ = answers[1].items()
        answers[1][owner] = ("s" if which == "b" else "b", idx, share)  # the other seed
        (owner, (which, idx, share)), *_ = answers[2].items()
        answers[2][owner] = (which, idx + 1, share)  # another holder's index
        answers[3][99] = ("b", 1, bytes(PART_BYTES))  # a client it holds nothing of
        spared = {next(iter(answers[1])), next(iter(answers[2]))}  # each keeps >= 3 shares
        o4 = next(o for o in answers[4] if o not in spared)
        o5 = next(o for o in answers[5] if o not in spared and o != o4)
        which, idx, share = answers[4][o4]
        answers[4][o4] = (which, idx, b"\xff\xff\xff\xff" + share[4:])  # not a field element
        which, idx, share = answers[5][o5]
        answers[5][o5] = (which, idx, share[:16])  # a 16-byte share, as PyCryptodome's were

    total, server, _ = secure_sum(ups, degree=8, threshold=3, tamper=mixed)
    assert np.array_equal(total, exact(ups, range(6)))
    assert "not the seed asked for" in server.ignored[1]
    assert "not this holder's" in server.ignored[2]
    assert "holds none" in server.ignored[3]
    assert "a value at or above the prime 2**31 - 1" in server.ignored[4]
    assert f"a share must be {PART_BYTES} bytes, not 16" in server.ignored[5]


def test_a_seed_rebuilt_with_a_wrong_share_is_not_trusted():
    """finish() rebuilds every seed from its first `threshold` shares in one pass and uses
    one only once verified; a seed whose first set holds a wrong share is searched for."""
    rng = np.random.default_rng(6)
    ups = {u: rng.normal(0, 1, SIZE) for u in range(5)}
    clients = {u: SecAggClient(u, 2) for u in ups}
    server = SecAggServer(2, SIZE, threshold=2)
    peers = server.advertised([c.advertise() for c in clients.values()], neighbours(ups, 8, 2))
    inbox = server.route({u: c.share(peers[u], 2) for u, c in clients.items()})
    for u, c in clients.items():
        c.receive(inbox[u])
        server.add([u], c.mask(FixedPoint().encode(ups[u])))
    answers = {u: c.unmask([]) for u, c in clients.items()}
    first = server.needed(answers)[("b", 0)][0]  # the first share of client 0's self-mask seed
    holder = next(h for h, got in answers.items() if got.get(0, ())[1:2] == (first[0],))
    answers[holder][0] = ("b", first[0], bytes(PART_BYTES))
    assert np.array_equal(server.finish(answers), exact(ups, range(5)))
    assert not server.verify(("b", 0), bytes(16)) and not server.verify(("s", 0), bytes(16))


def test_shares_are_routed_along_the_neighbour_graph_only():
    from raymesh.federated.protocol.checks import BadUpdate, Checks
    from raymesh.federated.protocol.messages import Shares, ShareSeeds
    from raymesh.federated.protocol.secagg import SHARE_BYTES

    clients = {u: SecAggClient(u, 1) for u in range(12)}
    server = SecAggServer(1, SIZE, threshold=2)
    graph = neighbours(range(12), 4, seed=1)
    peers = server.advertised([c.advertise() for c in clients.values()], graph)
    stranger = next(v for v in range(12) if v not in graph[0] and v != 0)
    outgoing = {0: {**clients[0].share(peers[0], 2), stranger: bytes(SHARE_BYTES)}}
    inbox = server.route(outgoing)
    assert sorted(inbox) == graph[0] and stranger not in inbox
    msg = ShareSeeds(1, 2, {0: peers[0]})
    with pytest.raises(BadUpdate, match="not to its neighbours"):
        Checks(SIZE, 100)(msg, [0], Shares(1, outgoing, {}))
    partial = {0: dict(list(clients[0].share(peers[0], 2).items())[1:])}
    with pytest.raises(BadUpdate, match="not to its neighbours"):
        Checks(SIZE, 100)(msg, [0], Shares(1, partial, {}))


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
    noise = acc.noise((20000,))
    assert noise.std() == pytest.approx(0.8, rel=0.03)
    with pytest.raises(ValueError, match="delta=2"):
        DP(delta=2)


def test_messages_round_trip_through_json_and_strangers_are_refused():
    import json

    from raymesh.federated.protocol.client import Layout
    from raymesh.federated.protocol.messages import Fit, Fitted, decode, encode

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
    # Whatever arrives, decode raises ValueError and nothing else.
    deep: list = []
    for _ in range(200):
        deep = [deep]
    for junk in (
        deep,
        {"$": ["unhashable"]},
        {"$": "Fitted", "round": 1},
        {"$": "Fit", "config": 5},
        {"$a": 5, "dtype": "float32", "shape": [1]},
        {"$a": "AAAA", "dtype": "uint64", "shape": "x"},
        {"$b": "not base64!"},
        {"$d": [[1]]},
        {"$d": [[{"a": 1}, 2]]},
        {"$d": 7},
    ):
        with pytest.raises(ValueError):
            decode(junk)


def test_run_config_and_job_file_errors_name_the_field_and_the_fix(tmp_path):
    from raymesh.federated import RunConfig
    from raymesh.federated.jobfile import load_job

    with pytest.raises(ValueError, match="rounds=0: give an integer >= 1"):
        RunConfig(clients=10, rounds=0)
    with pytest.raises(ValueError, match="clients=0: give simulated clients, or edge clients"):
        RunConfig(clients=0, rounds=1)
    with pytest.raises(ValueError, match="rounds=True: give an integer >= 1"):  # no count
        RunConfig(clients=10, rounds=True)
    from raymesh.federated import EdgeConfig

    with pytest.raises(ValueError, match=r"edge\.max_clients=True: give a count >= 1"):
        EdgeConfig(max_clients=True)

    # The edge server's token check is every server's (BearerAuth's), here at construction.
    with pytest.raises(ValueError, match=r"edge\.token=.*give at least 16") as e:
        EdgeConfig(token="fifteen-chars-x")
    assert "fifteen" not in str(e.value)
    with pytest.raises(ValueError, match=r"edge\.max_body_bytes=512: give bytes >= 1024, or None"):
        EdgeConfig(max_body_bytes=512)
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
    from raymesh.federated.protocol.client import Layout
    from raymesh.federated.protocol.messages import Advertise, Fit, Participant, ShareSeeds, Unmask

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


# --- every field of every answer -----------------------------------------------------------


def _answers():
    """(message, clients, a valid answer, {what: a broken copy of the answer})."""
    from raymesh.federated.protocol.client import Layout
    from raymesh.federated.protocol.messages import (
        Advertise,
        Adverts,
        Fit,
        Fitted,
        Shares,
        ShareSeeds,
        Unmask,
        Unmasked,
    )
    from raymesh.federated.protocol.secagg import SHARE_BYTES, KeyAdvert

    good = SecAggClient(7, 1).advertise()
    keys = (good.c_public, good.s_public, good.b_commit)
    peer = SecAggClient(8, 1).advertise()
    advertise = Advertise(1, (7,))
    share = ShareSeeds(1, 1, {7: {8: peer}})
    box = {8: bytes(SHARE_BYTES)}
    layout = Layout(("w",), ((4,),))
    fit = Fit(1, (7,), np.zeros(4, np.float32), layout, {}, False, None, 5.0)
    secure_fit = Fit(1, (7,), np.zeros(4, np.float32), layout, {}, True, None, 5.0)
    delta = np.zeros(4, np.float32)
    masked = np.zeros(5, np.uint64)
    unmask = Unmask(1, ())
    share32 = bytes(PART_BYTES)

    def fitted(**kw):
        base = dict(round=1, examples={7: 10}, figures={7: {"loss": 0.5}}, failed={}, masked=None)
        base["deltas"] = {7: delta}
        return Fitted(**{**base, **kw})

    return [
        (
            advertise,
            Adverts(1, (good,)),
            {
                "another type": Shares(1, {}, {}),
                "another round": Adverts(2, (good,)),
                "a round that is not a number": Adverts("1", (good,)),
                "another client": Adverts(1, (peer,)),
                "twice": Adverts(1, (good, good)),
                "not a list": Adverts(1, 5),
                "not an advert": Adverts(1, ((7, b"k", b"k"),)),
                "a short key": Adverts(1, (KeyAdvert(7, b"k", *keys[1:]),)),
                "a key of text": Adverts(1, (KeyAdvert(7, "k" * 32, *keys[1:]),)),
                "a bool client": Adverts(1, (KeyAdvert(True, *keys),)),
            },
        ),
        (
            share,
            Shares(1, {7: box}, {}),
            {
                "another client": Shares(1, {8: box}, {}),
                "a non-neighbour": Shares(1, {7: {9: bytes(SHARE_BYTES)}}, {}),
                "too few": Shares(1, {7: {}}, {}),
                "a short share": Shares(1, {7: {8: bytes(SHARE_BYTES - 1)}}, {}),
                "a share of text": Shares(1, {7: {8: "x" * SHARE_BYTES}}, {}),
                "shares not a map": Shares(1, {7: [8]}, {}),
                "outgoing not a map": Shares(1, None, {}),
                "failed for another": Shares(1, {}, {9: "gone"}),
                "a failure not text": Shares(1, {}, {7: 5}),
                "both": Shares(1, {7: box}, {7: "gone"}),
            },
        ),
        (
            fit,
            fitted(),
            {
                "another round": fitted(round=0),
                "another client": fitted(examples={8: 10}, deltas={8: delta}, figures={}),
                "a zero count": fitted(examples={7: 0}),
                "a bool count": fitted(examples={7: True}),
                "a text count": fitted(examples={7: "10"}),
                "a float count": fitted(examples={7: 10.0}),
                "a huge count": fitted(examples={7: 10**12}),
                "a text figure": fitted(figures={7: {"loss": "low"}}),
                "a NaN figure": fitted(figures={7: {"loss": float("nan")}}),
                "an infinite figure": fitted(figures={7: {"loss": float("inf")}}),
                "a list figure": fitted(figures={7: {"loss": [1.0]}}),
                "a long name": fitted(figures={7: {"x" * 65: 1.0}}),
                "too many figures": fitted(figures={7: {f"f{i}": 1.0 for i in range(40)}}),
                "figures of another": fitted(figures={8: {"loss": 1.0}}),
                "figures not a map": fitted(figures=[1]),
                "a short update": fitted(deltas={7: np.zeros(3, np.float32)}),
                "a float64 update": fitted(deltas={7: np.zeros(4, np.float64)}),
                "a NaN update": fitted(deltas={7: np.full(4, np.nan, np.float32)}),
                "an update of text": fitted(deltas={7: "0000"}),
                "no update": fitted(deltas={}),
                "failed and answered": fitted(failed={7: "gone"}),
                "failed for another": fitted(failed={9: "gone"}),
            },
        ),
        (
            secure_fit,
            fitted(masked=masked, deltas={}),
            {
                "no masked vector": fitted(masked=None, deltas={}),
                "a short masked vector": fitted(masked=np.zeros(4, np.uint64), deltas={}),
                "a signed masked vector": fitted(masked=np.zeros(5, np.int64), deltas={}),
                "a huge count": fitted(masked=masked, deltas={}, examples={7: 10**7}),
            },
        ),
        (
            unmask,
            Unmasked(1, {7: {8: ("b", 1, share32)}}),
            {
                "another holder": Unmasked(1, {8: {7: ("b", 1, share32)}}),
                "another round": Unmasked(0, {7: {8: ("b", 1, share32)}}),
                "another seed kind": Unmasked(1, {7: {8: ("x", 1, share32)}}),
                "a text index": Unmasked(1, {7: {8: ("b", "1", share32)}}),
                "a short share": Unmasked(1, {7: {8: ("b", 1, share32[:5])}}),
                "a pair": Unmasked(1, {7: {8: ("b", 1)}}),
                "a text owner": Unmasked(1, {7: {"8": ("b", 1, share32)}}),
                "not a map": Unmasked(1, {7: [("b", 1, share32)]}),
            },
        ),
    ]


def test_every_field_of_every_answer_is_checked_and_only_badupdate_is_raised():
    from raymesh.federated.protocol.checks import BadUpdate, Checks

    check = Checks(4, max_examples=1000)
    for msg, valid, broken in _answers():
        check(msg, [7], valid)
        for what, reply in broken.items():
            with pytest.raises(BadUpdate) as got:
                check(msg, [7], reply)
            assert str(got.value), what
    # Not even a reply of some unforeseen form gets anything but BadUpdate out of it.
    from raymesh.federated.protocol.messages import Fit, Fitted

    msg = _answers()[2][0]
    assert isinstance(msg, Fit)
    odd = [
        None,
        5,
        object(),
        Fitted(1, {7: 10}, object(), {}, None, {7: None}),
        Fitted(np.ones(2), {7: 10}, {}, {}, None, {}),  # comparing the round raises ValueError
    ]
    for junk in odd:
        with pytest.raises(BadUpdate):
            check(msg, [7], junk)


def test_a_client_reporting_more_than_max_examples_is_dropped_by_its_participant():
    import torch

    from raymesh.federated import Client, RunConfig
    from raymesh.federated.protocol.client import Layout
    from raymesh.federated.protocol.messages import Fit, Participant

    def train(model, data, config):
        return 5000 if config["client"] == 1 else 10

    clients = {c: Client(torch.nn.Linear(2, 1), None, train) for c in range(2)}
    layout = Layout.of(clients[0].model.state_dict())
    msg = Fit(1, (0, 1), np.zeros(layout.size, np.float32), layout, {}, False, None, 10.0)
    fitted = Participant(clients.__getitem__).handle(Fit(**{**msg.__dict__, "max_examples": 1000}))
    assert list(fitted.examples) == [0] and "max_examples=1000" in fitted.failed[1]
    with pytest.raises(ValueError, match="max_examples=0: give the largest count"):
        RunConfig(clients=2, rounds=1, max_examples=0)


# --- whole rounds, on clients in this process ----------------------------------------------

DIM = 64  # the push clients' model: one 64 x 64 matrix, 4096 weights
UNIT = np.full((DIM, DIM), 1.0 / DIM, np.float32)  # L2 norm 1


def _push(cid):
    """A client whose update is 10 * UNIT (norm 10); client 4 raises."""
    import torch

    from raymesh.federated import Client

    def train(model, data, config):
        if config["client"] == 4:
            raise RuntimeError("client 4 fails on purpose")
        with torch.no_grad():
            model.weight.add_(torch.from_numpy(10 * UNIT))
        return 100

    model = torch.nn.Linear(DIM, DIM, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return Client(model, None, train)


class _NoSampling(FedAvg):
    def sample(self, round_, clients, seed=0):
        raise AssertionError("under DP the federation samples (Poisson), not the strategy")


def _dp_step(secure: bool, noise: float = 0.05, **kw) -> tuple[np.ndarray, object]:
    from tests.federated import helpers

    dp = DP(clip=1.0, noise_multiplier=noise, delta=1e-5)
    result = helpers.local_run(
        _push,
        _NoSampling(fraction=1.0, min_clients=2),
        clients=5,
        rounds=1,
        secure_aggregation=secure,
        dp=dp,
        **kw,
    )
    (rec,) = result.history
    return helpers.final(result).reshape(DIM, DIM), rec


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "plain"])
def test_a_dp_round_clips_sums_adds_noise_and_divides_by_the_expected_number_sampled(
    secure, monkeypatch
):
    """Five clients sampled (fraction 1), four answer with an update of norm 10, clipped to
    1: the step is (4 * UNIT + noise) / 5, dividing by the five expected whoever answered,
    with noise of std noise_multiplier * clip / 5 on every weight. Without secure aggregation
    the clients' clipping is switched off: the server's own clipping must hold."""
    if not secure:
        from raymesh.federated.protocol import messages as protocol

        monkeypatch.setattr(protocol, "clip_update", lambda delta, clip: dict(delta))
    step, rec = _dp_step(secure)
    assert rec.applied and rec.sampled == 5 and rec.responded == 4, rec
    assert "fails on purpose" in rec.dropped[4]
    along = float(np.sum(step * UNIT))  # the step's length along the updates' direction
    assert along == pytest.approx(4 / 5, abs=0.05)  # /4 (who answered) would give 1.0
    residual = step - along * UNIT
    assert residual.std() == pytest.approx(0.05 / 5, rel=0.1)  # no noise: ~0


def test_a_secure_dp_sum_longer_than_clipped_updates_can_add_up_to_is_not_applied(monkeypatch):
    """Secure aggregation hides each update, so under DP only the decoded sum can show a
    client that did not clip: four clients whose clipping is switched off mask updates of norm
    10 (clip 1), and their sum's norm, 40, is over four clipped updates' 4: the round is not
    applied and the model stays as it was. The bound is n * clip plus fixed point's rounding:
    a sum just within it passes, one just past it does not."""
    from raymesh.federated.protocol import messages as protocol
    from raymesh.federated.protocol.checks import sum_problem

    monkeypatch.setattr(protocol, "clip_update", lambda delta, clip: dict(delta))
    step, rec = _dp_step(True)
    assert rec.responded == 4 and not rec.applied, rec
    assert "norm 40 exceeds 4 clipped updates' 4" in rec.reason, rec.reason
    assert "a client did not clip" in rec.reason
    np.testing.assert_array_equal(step, 0)  # the model _push starts from

    within = np.append(UNIT.ravel() * 4.0, 4.0)  # four updates of norm 1, weight 1 each
    assert sum_problem(within, [100] * 4, clip=1.0) == ""
    past = np.append(UNIT.ravel() * 4.01, 4.0)
    assert "exceeds" in sum_problem(past, [100] * 4, clip=1.0)
    assert sum_problem(past, [1] * 4, clip=None) == ""  # without DP updates have no bound


def test_dp_noise_and_sampling_come_from_os_entropy_not_the_runs_seed(monkeypatch):
    from raymesh.federated.protocol import privacy

    first, _ = _dp_step(True, seed=3)
    second, _ = _dp_step(True, seed=3)
    assert not np.allclose(first, second)  # same seed, same clients: other noise
    monkeypatch.setattr(privacy, "_TEST_SEED", 11)
    again = [_dp_step(True, seed=s)[0] for s in (3, 4)]
    np.testing.assert_array_equal(*again)  # the test switch alone decides the draws
    rng = privacy.private_rng()
    counts = {len(privacy.poisson_sample(range(1000), 0.1, rng)) for _ in range(20)}
    assert len(counts) > 1 and all(50 < n < 150 for n in counts)
    monkeypatch.setattr(privacy, "_TEST_SEED", None)
    a, b = privacy.PrivacyAccountant(DP()), privacy.PrivacyAccountant(DP())
    assert not np.array_equal(a.noise((8,)), b.noise((8,)))


def test_a_secure_sum_whose_count_differs_from_the_reported_counts_is_not_applied():
    """A host reports one more example per client than it masked: the decoded count gives it
    away, and the round is not applied (the model is unchanged)."""
    import dataclasses

    from raymesh.federated.protocol.messages import Participant
    from tests.federated import helpers

    class Inflating(Participant):
        def _fit(self, msg):
            f = super()._fit(msg)
            return dataclasses.replace(f, examples={c: n + 1 for c, n in f.examples.items()})

    class Host(helpers.LocalHost):
        def __init__(self, index, client_fn):
            super().__init__(index, client_fn)
            if index == 0:
                self.participant = Inflating(client_fn)

    class Federation(helpers.LocalFederation):
        host = Host

    from raymesh.federated import RunConfig

    config = RunConfig(clients=4, rounds=1, hosts=2, secure_aggregation=True)
    fed = Federation(_push, FedAvg(fraction=1.0, min_clients=2), config)
    start = fed.weights.copy()
    (rec,) = fed.run().history
    assert not rec.applied and "decoded weight 400 is not the 402 examples reported" in rec.reason
    np.testing.assert_array_equal(fed.weights, start)


def test_a_proc_answer_that_fails_its_checks_drops_its_clients_not_the_proc():
    from raymesh.federated.protocol.messages import Fitted
    from tests.federated import helpers

    class Wrong(helpers.LocalHost):
        def send(self, msg):
            got = super().send(msg)
            if self.index == 1 and isinstance(got.value, Fitted):
                f = got.value  # figures the controller would average: text, not numbers
                got.value = Fitted(f.round, f.examples, {1: {"loss": "x"}}, {}, None, f.deltas)
            return got

    class Federation(helpers.LocalFederation):
        host = Wrong

    from raymesh.federated import RunConfig

    fed = Federation(_push, FedAvg(fraction=1.0, min_clients=2), RunConfig(clients=4, rounds=1))
    (rec,) = fed.run().history
    assert rec.applied and rec.replaced_hosts == 0 and rec.responded == 2
    assert sorted(rec.dropped) == [1, 3] and "'loss' is x, not a finite" in rec.dropped[1]


def test_a_job_files_edge_tls_and_the_clis_tls_flags_and_token(tmp_path, monkeypatch, capsys):
    import argparse
    import os
    from pathlib import Path

    from raymesh.cli import federated as cli
    from raymesh.federated import Tls
    from raymesh.federated.jobfile import load_job

    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    job = tmp_path / "job.toml"
    head = 'client_fn = "raymesh.examples.fedmlp:client_fn"\nclients = 4\nrounds = 1\n'
    job.write_text(head + '[edge]\nwait_for = 1\n[edge.tls]\ncert = "c.pem"\nkey = "k.pem"\n')
    edge = load_job(job).config.edge  # paths are the job file's, not the working folder's
    assert edge.tls == Tls(cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"))
    job.write_text(head + '[edge.tls]\ncert = "c.pem"\nkey = "missing.pem"\n')
    with pytest.raises(ValueError, match=r"\[edge.tls\] tls.key=.*missing.pem' is not a file"):
        load_job(job)
    job.write_text(head)
    flags = Tls(cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"))
    with pytest.raises(ValueError, match=r"--tls-key are for edge clients: add \[edge\]"):
        load_job(job, tls=flags)
    job.write_text(head + "[edge]\nwait_for = 1\n")
    assert load_job(job, tls=flags).config.edge.tls == flags
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["federated", "client", "--ca-file", "ca.pem", "--device", "d1"])
    assert (args.ca_file, args.device, args.tls_cert) == ("ca.pem", "d1", None)
    # The CLI's edge token: the job's, else $RAYMESH_FL_TOKEN, else a new one in a 0600 file.
    config = load_job(job).config
    monkeypatch.setenv("RAYMESH_FL_TOKEN", "from-the-environment")
    assert cli._with_token(config).edge.token == "from-the-environment"
    monkeypatch.delenv("RAYMESH_FL_TOKEN")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    token = cli._with_token(config).edge.token
    said = capsys.readouterr().err
    path = said.split("token generated into ")[1].split()[0]
    assert Path(path).read_text().strip() == token and token not in said
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_the_edge_clients_token_comes_from_a_file_or_the_environment_and_plain_http_warns(
    tmp_path, monkeypatch, caplog
):
    """--token-file or $RAYMESH_FL_TOKEN, as `raymesh federated client` and edge/device.py parse
    them; --token still works but warns (the process list is public), and so does a token
    sent over plain http to another host, once per client."""
    import argparse

    from raymesh.cli import federated as cli
    from raymesh.federated.edge import device as edge

    caplog.set_level("WARNING", logger="raymesh.federated.edge")
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    standalone = argparse.ArgumentParser()
    edge.add_arguments(standalone)
    file = tmp_path / "token"
    file.write_text("from-the-file\nignored\n")

    def token(*flags: str) -> str | None:
        got = {
            edge.token_from(parser.parse_args(["federated", "client", *flags])),
            edge.token_from(standalone.parse_args(["--server", "u", "--client", "m:f", *flags])),
        }
        assert len(got) == 1, got  # the two front doors agree
        return got.pop()

    monkeypatch.setenv("RAYMESH_FL_TOKEN", "from-the-environment")
    assert token() == "from-the-environment"
    assert token("--token-file", str(file)) == "from-the-file"
    assert caplog.text == ""
    assert token("--token", "on-the-line") == "on-the-line"
    assert "process list" in caplog.text and "--token-file" in caplog.text
    assert "on-the-line" not in caplog.text
    with pytest.raises(ValueError, match="not both"):
        token("--token", "x", "--token-file", str(file))
    file.write_text("\n")
    with pytest.raises(ValueError, match="first line holds no token"):
        token("--token-file", str(file))
    monkeypatch.delenv("RAYMESH_FL_TOKEN")
    assert token() is None

    caplog.clear()
    for here in ("http://127.0.0.1:1", "http://localhost:1", "http://[::1]:1", "https://10.0.0.7"):
        edge.EdgeClient(here, "secret-token", lambda cid: None)
    assert caplog.text == ""
    edge.EdgeClient("http://10.0.0.7:8765", "secret-token", lambda cid: None)
    (record,) = caplog.records
    assert "10.0.0.7:8765 is plain http" in record.getMessage()
    assert "secret-token" not in caplog.text
