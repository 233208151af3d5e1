"""Rogue edge clients against a secure run: whatever they send, the run completes and its
model is the honest clients' FedAvg, computed here independently.

The simulated clients live in this process (LocalFederation: the same Participant a proc runs,
each message pickled as Ray would send it), so the suite needs no Ray; the edge server, an
honest edge client and two rogues speak real HTTP. After each round the driver waits
(`on_round`) until each rogue has done what it does between rounds, so that a replay lands when
no message waits for it, whatever the timing. (An answer after the driver gave up on it is
refused the same way: test_federated's unit test of the edge server shows it, without
spending a step's timeout here.) The second test is a rogue that tries to stall the server
instead: a wide body, and answers sent at once.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from raymesh import federated as fl
from raymesh.examples import fedmlp
from raymesh.federated.edge.device import EdgeClient
from raymesh.federated.protocol.messages import (
    Advertise,
    Adverts,
    Done,
    Fit,
    Fitted,
    Participant,
    Shares,
    ShareSeeds,
    Unmask,
    Unmasked,
    encode,
)
from raymesh.federated.protocol.secagg import PART_BYTES, SHARE_BYTES, KeyAdvert
from tests.federated import helpers
from tests.waiting import wait_for

TOKEN = "rogue-suite-token"
ROUNDS = 6
LOW_ORDER = bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800")


class Rogue(threading.Thread):
    """An edge client that runs `scripts[r](self)` in round r, then `after[r](self)` once the
    round is over; what the server answered is in `seen[(r, what)]`."""

    def __init__(
        self,
        edge: helpers.RawEdge,
        scripts: dict[int, Callable[[Rogue], None]],
        after: dict[int, Callable[[Rogue], None]],
        finished: list[threading.Event],
    ) -> None:
        super().__init__(daemon=True)
        self.edge, self.scripts, self.after, self.finished = edge, scripts, after, finished
        self.ready = [threading.Event() for _ in range(ROUNDS + 1)]
        self.honest = Participant(fedmlp.client_fn)  # what it would answer if it were honest
        self.seen: dict[tuple[int, str], tuple[int, Any]] = {}
        self.kept: dict[str, Any] = {}
        self.errors: list[str] = []
        self.round = 0

    def run(self) -> None:
        for r in range(1, ROUNDS + 1):
            self.round = r
            try:
                self.scripts.get(r, Rogue.honestly)(self)
                self.finished[r].wait(60)
                self.after.get(r, lambda _: None)(self)
            except BaseException:
                self.errors.append(f"round {r}: {traceback.format_exc()}")
            self.ready[r].set()

    def note(self, what: str, answer: tuple[int, Any]) -> tuple[int, Any]:
        self.seen[(self.round, what)] = answer
        return answer

    def step(self, expected: type) -> Any:
        """The next message, which must be of type `expected`, and the honest answer to it."""
        msg = self.edge.next()
        assert type(msg) is expected, (self.round, msg)
        return msg, self.honest.handle(msg)

    def honestly(self) -> None:
        """The four steps answered as an honest client would."""

        for kind in (Advertise, ShareSeeds, Fit, Unmask):
            _, answer = self.step(kind)
            assert self.edge.reply(answer)[0] == 200


# --- rogue A's rounds --------------------------------------------------------------------------


def a_low_order_key(r: Rogue) -> None:
    _, adverts = r.step(Advertise)
    (mine,) = adverts.adverts
    bad = KeyAdvert(mine.client, LOW_ORDER, mine.s_public, mine.b_commit)
    r.note("advert", r.edge.reply(Adverts(adverts.round, (bad,))))


def a_cut_share(r: Rogue) -> None:
    _, adverts = r.step(Advertise)
    assert r.edge.reply(adverts)[0] == 200
    _, shares = r.step(ShareSeeds)
    boxes = dict(shares.outgoing[r.edge.cid])
    first = min(boxes)
    boxes[first] = boxes[first][:-1]  # one byte short
    bad = Shares(shares.round, {r.edge.cid: boxes}, {})
    r.note("shares", r.edge.reply(bad))


def a_bad_figures(r: Rogue) -> None:
    for kind in (Advertise, ShareSeeds):
        _, answer = r.step(kind)
        assert r.edge.reply(answer)[0] == 200
    _, fitted = r.step(Fit)
    figures = {r.edge.cid: {"loss": "low", "note": [1, 2]}}
    bad = Fitted(fitted.round, fitted.examples, figures, {}, fitted.masked)
    r.note("figures", r.edge.reply(bad))


def a_oversized(r: Rogue) -> None:
    r.step(Advertise)
    path = f"/v1/reply?client={r.edge.cid}"
    r.note("oversized", r.edge.call("POST", path, raw=b" " * (256 << 10)))


def a_bad_unmask(r: Rogue) -> None:
    """Trains honestly (its update counts), then reveals shares in no valid form."""
    for kind in (Advertise, ShareSeeds, Fit):
        _, answer = r.step(kind)
        assert r.edge.reply(answer)[0] == 200
    _, unmasked = r.step(Unmask)
    owners = unmasked.answers[r.edge.cid]
    bad = {r.edge.cid: {o: ("x", "one", share[:5]) for o, (_, _, share) in owners.items()}}
    r.note("unmask", r.edge.reply(Unmasked(unmasked.round, bad)))


def a_deep(r: Rogue) -> None:
    r.step(Advertise)
    deep = b'{"reply": ' + b"[" * 40 + b"]" * 40 + b"}"
    r.note("deep", r.edge.call("POST", f"/v1/reply?client={r.edge.cid}", raw=deep))


# --- rogue B's rounds --------------------------------------------------------------------------


def b_pretends(r: Rogue, other: helpers.RawEdge) -> None:
    """Knocks on every door it should not, then advertises keys as another client."""
    msg, adverts = r.step(Advertise)
    e = r.edge
    r.note("other cid", e.call("GET", f"/v1/next?client={other.cid}"))  # its key, not other's
    r.note("stranger", e.call("POST", "/v1/join", {"device": "x"}, token="not-the-token"))
    r.note("non-ascii token", e.call("GET", f"/v1/next?client={e.cid}", token="jeton-é"))
    r.note("non-ascii key", e.call("GET", f"/v1/next?client={e.cid}", key="clé"))
    r.note("enrol again", e.call("POST", "/v1/join", {"device": "rogue-b"}))
    r.note("full", e.call("POST", "/v1/join", {"device": "one-more"}))
    (mine,) = adverts.adverts
    as_other = KeyAdvert(other.cid, mine.c_public, mine.s_public, mine.b_commit)
    r.note("advert as another", e.reply(Adverts(msg.round, (as_other,))))


def b_huge_count(r: Rogue) -> None:
    _, adverts = r.step(Advertise)
    assert r.edge.reply(adverts)[0] == 200
    _, shares = r.step(ShareSeeds)
    assert r.edge.reply(shares)[0] == 200
    r.kept["shares"] = shares
    _, fitted = r.step(Fit)
    bad = Fitted(fitted.round, {r.edge.cid: 10**12}, fitted.figures, {}, fitted.masked)
    r.note("count", r.edge.reply(bad))


def b_replays_shares(r: Rogue) -> None:
    r.note("replay", r.edge.reply(r.kept["shares"]))


def b_wrong_shares(r: Rogue) -> None:
    """Trains honestly (its update counts), then reveals well-formed shares of random bytes:
    the server must find them out by verifying what they rebuild, and skip them."""
    for kind in (Advertise, ShareSeeds, Fit):
        _, answer = r.step(kind)
        assert r.edge.reply(answer)[0] == 200
        if kind is Advertise:
            r.kept["adverts"] = answer
    _, unmasked = r.step(Unmask)
    owners = unmasked.answers[r.edge.cid]
    lies = {o: (which, idx, _field_elements(PART_BYTES)) for o, (which, idx, _) in owners.items()}
    r.note("unmask", r.edge.reply(Unmasked(unmasked.round, {r.edge.cid: lies})))


def _field_elements(n: int) -> bytes:
    """`n` random bytes that are a well-formed share: 4-byte values below 2**31 - 1."""
    values = np.frombuffer(os.urandom(n), ">u4") % np.uint32(2**31 - 1)
    return values.astype(">u4").tobytes()


def b_answers_for_another(r: Rogue, other: helpers.RawEdge) -> None:
    """Answers at another edge client's address with its own key, then honestly."""
    _, adverts = r.step(Advertise)
    path = f"/v1/reply?client={other.cid}"
    r.note("reply as another", r.edge.call("POST", path, {"reply": encode(adverts)}))
    assert r.edge.reply(adverts)[0] == 200
    for kind in (ShareSeeds, Fit, Unmask):
        _, answer = r.step(kind)
        assert r.edge.reply(answer)[0] == 200


def b_old_round(r: Rogue) -> None:
    r.step(Advertise)
    r.note("old round", r.edge.reply(r.kept["adverts"]))  # round 3's adverts


def b_chunked(r: Rogue) -> None:
    r.step(Advertise)
    chunks = (b" " * 16384 for _ in range(16))  # 256 KiB, no Content-Length
    path = f"/v1/reply?client={r.edge.cid}"
    r.note("chunked", r.edge.http("POST", path, chunks, chunked=True))


def test_rogue_edge_clients_cannot_end_a_secure_run_nor_move_its_model(caplog):
    caplog.set_level("INFO", logger="raymesh.federated")
    finished = [threading.Event() for _ in range(ROUNDS + 1)]
    config = fl.RunConfig(
        clients=4,
        rounds=ROUNDS,
        hosts=2,
        secure_aggregation=True,
        timeout_s=30.0,  # no step waits for it: every client answers, rightly or not
        edge=fl.EdgeConfig(
            token=TOKEN,
            wait_for=3,
            join_timeout_s=30,
            poll_s=5,
            max_body_bytes=128 << 10,
            max_clients=3,
        ),
    )
    fed = helpers.LocalFederation(fedmlp.client_fn, fl.FedAvg(fraction=1.0, min_clients=2), config)
    assert fed.edge is not None
    a, b = helpers.RawEdge(fed.edge.url, TOKEN), helpers.RawEdge(fed.edge.url, TOKEN)
    assert a.join("rogue-a")[0] == 200 and b.join("rogue-b")[0] == 200
    honest = EdgeClient(fed.edge.url, TOKEN, fedmlp.client_fn, device="honest")
    honest_thread = threading.Thread(target=honest.run, daemon=True)
    honest_thread.start()
    rogue_a = Rogue(
        a,
        {
            1: a_low_order_key,
            2: a_cut_share,
            3: a_bad_figures,
            4: a_oversized,
            5: a_bad_unmask,
            6: a_deep,
        },
        {},
        finished,
    )
    rogue_b = Rogue(
        b,
        {
            1: lambda r: b_pretends(r, a),
            2: b_huge_count,
            3: b_wrong_shares,
            4: lambda r: b_answers_for_another(r, a),
            5: b_old_round,
            6: b_chunked,
        },
        {2: b_replays_shares},
        finished,
    )
    rogue_a.start()
    rogue_b.start()

    def between_rounds(record: fl.RoundRecord) -> None:
        finished[record.round].set()
        for rogue in (rogue_a, rogue_b):
            assert rogue.ready[record.round].wait(60), f"round {record.round}: {rogue.errors}"

    result = fed.run(between_rounds)
    honest_thread.join(timeout=30)
    assert not rogue_a.errors and not rogue_b.errors, (rogue_a.errors, rogue_b.errors)
    assert (a.cid, b.cid, honest.cid) == (4, 5, 6)

    assert not set(rogue_a.seen) & set(rogue_b.seen)
    seen = {**rogue_a.seen, **rogue_b.seen}
    status = {k: v[0] for k, v in seen.items()}
    error = {k: ((v[1] or {}).get("error") or {}).get("message", "") for k, v in seen.items()}
    assert status[(1, "advert")] == 422 and "low-order point" in error[(1, "advert")]
    assert status[(1, "advert as another")] == 422
    assert status[(1, "other cid")] == 403
    assert status[(1, "stranger")] == 401
    assert status[(1, "non-ascii token")] == 401 and status[(1, "non-ascii key")] == 401
    assert status[(1, "enrol again")] == 409 and "enrolled already" in error[(1, "enrol again")]
    assert status[(1, "full")] == 403 and "max_clients=3" in error[(1, "full")]
    assert status[(2, "shares")] == 422 and f"not {SHARE_BYTES} bytes" in error[(2, "shares")]
    assert status[(2, "count")] == 422 and "max_examples" in error[(2, "count")]
    assert status[(2, "replay")] == 409
    assert status[(3, "figures")] == 422 and "not a finite number" in error[(3, "figures")]
    assert status[(3, "unmask")] == 200  # well-formed: only verifying what they rebuild tells
    assert status[(4, "oversized")] == 413
    assert status[(4, "reply as another")] == 403
    assert status[(5, "unmask")] == 422
    assert status[(5, "old round")] == 422 and "round 3, not 5" in error[(5, "old round")]
    assert status[(6, "deep")] == 400 and "nests deeper" in error[(6, "deep")]
    assert status[(6, "chunked")] == 413

    one, two, three, four, five, six = result.history
    assert all(r.applied and r.reason == "" for r in result.history), result.history
    assert sorted(one.dropped) == [4, 5] and "does not answer for" in one.dropped[5]
    assert sorted(two.dropped) == [4, 5]
    assert list(three.dropped) == [4] and three.responded == 6
    assert list(four.dropped) == [4] and four.responded == 6
    assert list(five.dropped) == [5] and list(five.ignored) == [4] and five.responded == 6
    assert sorted(six.dropped) == [4, 5]
    honest_rounds = [[0, 1, 2, 3, 6]] * 2 + [[0, 1, 2, 3, 5, 6]]
    honest_rounds += [[0, 1, 2, 3, 5, 6], [0, 1, 2, 3, 4, 6], [0, 1, 2, 3, 6]]
    expected = helpers.fedavg_by_hand(honest_rounds)
    np.testing.assert_allclose(helpers.final(result), expected, atol=1e-5)
    assert TOKEN not in caplog.text


def test_a_wide_body_and_answers_sent_at_once_from_one_device_cannot_stall_a_run():
    """An enrolled rogue answers round 1's Fit with a flat list of four million numbers
    streamed in (8 MB, well under the old 256 MiB default) and, while that answer is in flight,
    answers again. The second is refused at once (429), the first as soon as it passes what an
    honest answer for fedmlp can be (413, ~130 KB, long before its end). In round 2 it sends
    40 000 numbers, within the bytes: 413 by the item budget, before json.loads. Both rounds are
    applied, the honest clients' FedAvg computed here."""
    config = fl.RunConfig(
        clients=2,
        rounds=2,
        hosts=1,
        timeout_s=60.0,
        edge=fl.EdgeConfig(token=TOKEN, wait_for=2, join_timeout_s=30, poll_s=5),
    )
    fed = helpers.LocalFederation(fedmlp.client_fn, fl.FedAvg(fraction=1.0, min_clients=2), config)
    assert fed.edge is not None
    rogue = helpers.RawEdge(fed.edge.url, TOKEN)
    assert rogue.join("wide")[0] == 200
    honest = EdgeClient(fed.edge.url, TOKEN, fedmlp.client_fn, device="honest")
    honest_thread = threading.Thread(target=honest.run, daemon=True)
    honest_thread.start()
    seen: dict[str, tuple[int, Any]] = {}
    errors: list[str] = []
    edge = fed.edge

    def wide() -> None:
        try:
            participant = Participant(fedmlp.client_fn)
            answer = participant.handle(rogue.next())  # round 1's Fit
            upload = rogue.upload()
            upload.send(b'{"reply": [0')
            # The server's own record, read only to know when the second answer is concurrent.
            wait_for(lambda: edge._edges[rogue.cid].replying, 10, what="the answer in flight")
            seen["again"] = rogue.reply(answer)
            sent = 0
            while sent < 4_000_000 and upload.send(b",0" * 65536):
                sent += 65536
            upload.send(b"]}")
            seen["wide"] = upload.response()
            participant.handle(rogue.next())  # round 2's Fit
            many = b'{"reply": [' + b",".join([b"0"] * 40_000) + b"]}"
            seen["many"] = rogue.call("POST", f"/v1/reply?client={rogue.cid}", raw=many)
            seen["done"] = (200, rogue.next())  # the run goes on to its end
        except BaseException:
            errors.append(traceback.format_exc())

    rogue_thread = threading.Thread(target=wide, daemon=True)
    rogue_thread.start()
    result = fed.run()
    honest_thread.join(timeout=30)
    rogue_thread.join(timeout=30)
    assert not errors, errors
    assert (rogue.cid, honest.cid) == (2, 3)
    assert seen["again"][0] == 429, seen["again"]
    status, body = seen["wide"]
    limit = edge.limits.max_bytes
    assert status == 413 and f"limit of {limit} bytes" in body["error"]["message"]
    assert 100_000 < limit < 200_000  # 6154 floats: 11 bytes each, and 64 KiB
    assert seen["many"][0] == 413 and "JSON values" in seen["many"][1]["error"]["message"]
    assert isinstance(seen["done"][1], Done)
    one, two = result.history
    assert one.applied and two.applied, result.history
    assert list(one.dropped) == [2] and list(two.dropped) == [2]
    assert one.responded == two.responded == 3
    expected = helpers.fedavg_by_hand([[0, 1, 3], [0, 1, 3]])
    np.testing.assert_allclose(helpers.final(result), expected, atol=1e-5)
