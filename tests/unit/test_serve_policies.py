"""raymesh.serve's decisions as plain data: which requests leave together and when, when the
queue refuses one, and when the replica count changes (no Ray, no HTTP, no sleeping)."""

from __future__ import annotations

import pytest

from raymesh.serve import AutoscalePolicy, BatchConfig, BatchQueue, Overloaded, ReplicaScale


def _queue(**kw) -> BatchQueue[int]:
    return BatchQueue(BatchConfig(**({"max_batch_size": 4, "batch_wait_ms": 5.0} | kw)))


def test_a_full_batch_leaves_at_once_in_arrival_order_and_the_rest_waits():
    q = _queue()
    for i in range(6):
        q.put(i, now=10.0)
    assert q.ready(10.0)  # four are waiting: full, no need to wait
    assert q.take(10.0) == [0, 1, 2, 3]
    assert not q.ready(10.004)  # two left, their wait not over
    assert q.deadline() == pytest.approx(10.005)
    assert q.ready(10.005) and q.take(10.005) == [4, 5]
    assert len(q) == 0 and q.deadline() is None and not q.ready(99.0) and q.take(99.0) == []


def test_a_partial_batch_leaves_when_its_oldest_request_has_waited():
    q = _queue(batch_wait_ms=10.0)
    q.put("a", now=1.0)
    q.put("b", now=1.008)  # joins the batch of the oldest: the deadline is the oldest's
    assert not q.ready(1.009) and q.deadline() == pytest.approx(1.010)
    assert q.ready(1.010) and q.take(1.010) == ["a", "b"]
    zero = _queue(batch_wait_ms=0.0)  # no waiting: each request leaves as it comes
    assert not zero.ready(3.0)  # (an empty queue is never ready)
    zero.put("x", now=3.0)
    assert zero.ready(3.0) and zero.take(3.0) == ["x"]


def test_a_full_queue_refuses_with_a_retry_after_from_the_drain_rate():
    q = _queue(max_queue=8)
    for i in range(8):
        q.put(i, now=0.0)
    with pytest.raises(Overloaded) as first:
        q.put(8, now=0.0)
    assert first.value.depth == 8 and first.value.retry_after_s == 1  # no rate measured yet
    assert len(q) == 8  # the refused request changed nothing
    q.take(1.0)  # two batches leave at t=1: the drain rate is measured from the first
    q.take(1.0)
    for i in range(8):
        q.put(i, now=1.5)
    with pytest.raises(Overloaded) as later:
        q.put(99, now=3.0)  # 8 requests left in 2 s: 4 a second; 8 wait
    assert later.value.retry_after_s == 1  # half of them (4) drain in 1 s
    slow = _queue(max_queue=8)
    slow.put(0, now=0.0)
    slow.take(0.0)
    for i in range(8):
        slow.put(i, now=0.0)
    with pytest.raises(Overloaded) as slowly:
        slow.put(9, now=10.0)  # 1 request in 10 s: half of 8 takes 40 s
    assert slowly.value.retry_after_s == 40


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size=0: give an integer >= 1"),
        ({"max_batch_size": 2.5}, "max_batch_size=2.5"),
        ({"batch_wait_ms": -1}, "batch_wait_ms=-1: give a number of milliseconds >= 0"),
        ({"batch_wait_ms": float("nan")}, "batch_wait_ms=nan"),
        ({"max_queue": 0}, "max_queue=0"),
        ({"max_batch_size": 16, "max_queue": 8}, "must hold at least one full batch"),
    ],
)
def test_bad_batch_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BatchConfig(**kw)


def test_the_autoscaler_adds_on_queue_depth_or_latency_removes_when_idle_one_step_at_a_time():
    policy = AutoscalePolicy(min=1, max=3, queue_up=4, latency_up_s=0.05, cooldown_s=5)
    idle = dict(queue_depth=0, p99_s=0.01, busy_replicas=0.2, since_last_s=10)
    grow = policy.decide(replicas=1, **(idle | {"queue_depth": 9}))
    assert grow == ReplicaScale(2, grow.reason) and "9 requests waiting" in grow.reason
    slow = policy.decide(replicas=2, **(idle | {"p99_s": 0.2}))
    assert slow is not None and slow.replicas == 3 and "p99 200.0 ms > 50.0 ms" in slow.reason
    assert policy.decide(replicas=3, **(idle | {"queue_depth": 100})) is None  # at max
    assert policy.decide(replicas=1, **(idle | {"queue_depth": 9, "since_last_s": 1})) is None
    shrink = policy.decide(replicas=3, **idle)
    assert shrink is not None and shrink.replicas == 2 and "remove a replica" in shrink.reason
    busy = policy.decide(replicas=2, **(idle | {"busy_replicas": 1.8}))
    assert busy is None  # one replica would be 180% busy: stay
    assert policy.decide(replicas=1, **idle) is None  # at min
    assert policy.decide(replicas=2, **(idle | {"queue_depth": 1})) is None  # still has work


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min": 0}, "replicas min=0"),
        ({"min": 3, "max": 2}, r"replicas=\(3, 2\): min must be <= max"),
        ({"queue_up": 0}, "queue_up=0: give a number > 0"),
        ({"latency_up_s": -1.0}, "latency_up_s=-1.0"),
        ({"busy_down": 1.5}, "busy_down=1.5: a share of the time"),
        ({"cooldown_s": -1}, "cooldown_s=-1"),
    ],
)
def test_bad_autoscale_policy_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        AutoscalePolicy(**kw)


def test_an_idle_server_sends_at_once_and_a_resent_request_goes_first():
    q = _queue(batch_wait_ms=50.0)
    q.put("a", now=1.0)
    assert not q.ready(1.001)  # a replica is computing: wait for others to join
    assert q.ready(1.001, idle=True)  # nothing is computing: waiting gains nothing
    assert q.take(1.001) == ["a"]
    q.put("b", now=2.0)
    q.requeue([(0.5, "a")])  # its replica died: it goes back first, its wait already over
    assert q.ready(2.0) and q.take(2.0) == ["a", "b"]
    for i in range(q.config.max_queue):
        q.put(i, now=3.0)
    q.requeue([(2.9, "resent")])  # not refused: it was admitted once already
    assert len(q) == q.config.max_queue + 1
    assert q.take_all()[0] == "resent" and len(q) == 0


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"replicas": 0}, "replicas=0"),
        ({"replicas": (3, 2)}, "min must be <= max"),
        ({"replicas": (1, 2, 3)}, "replicas=(1, 2, 3)"),
        ({"port": 70000}, "port=70000"),
        ({"host": ""}, "host=''"),
        ({"token": ""}, "token="),
        ({"max_batch_size": 64, "max_queue": 8}, "max_queue=8"),
        ({"batch_wait_ms": -1}, "batch_wait_ms=-1"),
        ({"request_timeout_s": 0}, "request_timeout_s=0"),
        ({"cpus_per_replica": 0}, "cpus_per_replica=0"),
        ({"backend": "triton"}, "backend='triton'"),
        ({"busy_down": 2}, "busy_down=2"),
        ({"admin_token": ""}, "admin_token="),
        ({"body_timeout_s": 0}, "body_timeout_s=0"),
        ({"keep_alive_s": -1}, "keep_alive_s=-1"),
        ({"max_connections": 0}, "max_connections=0"),
        ({"tls": {"cert": "c.pem"}}, "tls_key is missing"),
        ({"tls": {"cert": "c.pem", "key": "k.pem", "ca": "x"}}, "give cert and key"),
        ({"tls": "c.pem"}, "tls='c.pem': give Tls(cert=..., key=...)"),
        ({"checkpoint_root": "/no/such/folder"}, "checkpoint_root='/no/such/folder'"),
    ],
)
def test_a_bad_serve_config_names_the_field_and_the_fix(fields, named):
    from raymesh.serve import ServeConfig

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ServeConfig(**fields)


def test_a_serve_config_from_a_job_file_takes_lists_and_refuses_unknown_keys():
    from raymesh.serve import ServeConfig

    config = ServeConfig.from_dict({"replicas": [1, 4], "port": 0})
    assert config.replicas == (1, 4) and config.min_replicas == 1 and config.max_replicas == 4
    assert config.router.autoscale.max == 4 and config.batch.max_batch_size == 32
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['replica'\]"):
        ServeConfig.from_dict({"replica": 2})


def test_each_room_is_handed_its_section_of_the_flat_config(monkeypatch, tmp_path):
    from raymesh._common import Range
    from raymesh.serve import ServeConfig
    from raymesh.serve.sections import ReplicaConfig

    monkeypatch.setenv("RAYMESH_SERVE_TOKEN", "from-env-token-0123")
    monkeypatch.setenv("RAYMESH_SERVE_ADMIN_TOKEN", "admin-from-env-0123")
    config = ServeConfig(
        replicas=(2, 5),
        max_batch_size=8,
        batch_wait_ms=2,
        max_queue=64,
        port=0,
        checkpoint_root=str(tmp_path),
        request_timeout_s=7,
        max_retries=1,
        max_tokens=16,
        cpus_per_replica=0.5,
        start_timeout_s=9,
        max_streams=4,
        latency_up_ms=250,
    )
    router, batch, front = config.router, config.batch, config.front
    assert router.replicas == ReplicaConfig(
        replicas=Range(2, 5), cpus=0.5, gpus=False, start_timeout_s=9, max_streams=4
    )
    with pytest.raises(ValueError, match="max_streams=0: give an integer >= 1"):
        ServeConfig(max_streams=0)
    scale = router.autoscale
    assert (scale.min, scale.max, scale.latency_up_s) == (2, 5, 0.25)
    assert (router.request_timeout_s, router.max_retries) == (7, 1)
    assert batch == BatchConfig(max_batch_size=8, batch_wait_ms=2, max_queue=64)
    # The front's tokens are settled when it is read: no room reads the environment later.
    assert (front.token, front.admin_token) == ("from-env-token-0123", "admin-from-env-0123")
    assert (front.port, front.checkpoint_root, front.max_tokens) == (0, str(tmp_path), 16)
    monkeypatch.delenv("RAYMESH_SERVE_TOKEN")
    assert front.token == "from-env-token-0123" and config.front.token is None
    # An admin token from the environment that cannot be used: ValueError when it is read.
    with pytest.raises(ValueError, match="checkpoint_root=None"):
        _ = ServeConfig().front


def test_the_token_comes_from_the_environment_when_not_given(monkeypatch):
    from raymesh.serve import ServeConfig

    monkeypatch.setenv("RAYMESH_SERVE_TOKEN", "from-env-token-0123")
    assert ServeConfig().bearer() == "from-env-token-0123"
    assert ServeConfig(token="given-token-01234567").bearer() == "given-token-01234567"
    monkeypatch.delenv("RAYMESH_SERVE_TOKEN")
    assert ServeConfig().bearer() is None


@pytest.mark.parametrize(
    "x, shape, integer, why",
    [
        ([1.0, 2.0], (2,), False, None),
        ([[1, 2], [3, 4]], (2, 2), True, None),
        ([1.0], (2,), False, "x: expected 2 items (input shape [2]), got 1"),
        ([1.0, "a"], (2,), False, "x[1]: expected a number, got 'a'"),
        ([1.0, True], (2,), False, "x[1]: expected a number, got True"),
        ([[1, 2], [3]], (2, 2), True, "x[1]: expected 2 items (input shape [2, 2]), got 1"),
        ([[1, 2], [3, 4.5]], (2, 2), True, "x[1][1]: expected an integer, got 4.5"),
        ({"a": 1}, (2,), False, "x: expected a list of 2, got dict"),
        ("text", None, False, "x: give a number or a list"),
    ],
)
def test_an_input_of_the_wrong_shape_is_named_by_its_place(x, shape, integer, why):
    from raymesh.serve.http.inputs import check_input

    assert check_input(x, shape, integer) == why


@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        ({}, 422, "prompt: give a string"),
        ({"prompt": ["def "]}, 422, "prompt: give a string"),
        ({"prompt": "a", "max_tokens": True}, 422, "max_tokens: give an integer 1..64"),
        ({"prompt": "a", "max_tokens": 65}, 422, "max_tokens: give an integer 1..64 (got 65)"),
        ({"prompt": "a", "max_tokens": "9" * 5000}, 422, "max_tokens: give an integer"),
        ({"prompt": "a", "temperature": -1}, 422, "temperature: give a number >= 0"),
        ({"prompt": "a", "temperature": 1e39}, 400, "temperature"),
        ({"prompt": "a", "seed": 2**64}, 400, "seed: give an integer of 64 bits (got 20 digits)"),
        ({"prompt": "a", "seed": "1" * 5000}, 422, "seed: give an integer (got '1111"),
        ({"prompt": "a", "stream": "yes"}, 422, "stream: give true or false"),
    ],
)
def test_a_generate_request_is_checked_field_by_field_without_a_server(body, status, why):
    from raymesh.serve.http.front import GenerateArgs, generate_args
    from raymesh.serve.http.guard import HTTPError

    with pytest.raises(HTTPError) as e:
        generate_args(body, max_tokens=64)
    assert e.value.status == status and why in e.value.body["message"], e.value.body
    assert len(e.value.body["message"]) < 200  # the value is cut, whatever its size
    good = {"prompt": "def ", "max_tokens": 64, "temperature": 0.5, "seed": -1, "stream": True}
    assert generate_args(good, max_tokens=64) == GenerateArgs("def ", 64, 0.5, -1, True)


def test_a_reload_request_names_its_checkpoint_field():
    from raymesh.serve.http.front import reload_args
    from raymesh.serve.http.guard import HTTPError

    assert reload_args({"checkpoint": "runs/job"}) == "runs/job"
    for body in ({}, {"checkpoint": ""}, {"checkpoint": ["runs"]}):
        with pytest.raises(HTTPError, match="checkpoint: give a checkpoint folder") as e:
            reload_args(body)
        assert e.value.status == 422 and e.value.body["field"] == "checkpoint"


def test_a_model_spec_refuses_what_it_cannot_serve(tmp_path):
    import torch

    from raymesh.serve import ModelSpec

    with pytest.raises(ValueError, match="not several or none"):
        ModelSpec()
    with pytest.raises(ValueError, match="build='no_such_module:build': cannot import module"):
        ModelSpec(build="no_such_module:build")
    with pytest.raises(ValueError, match="needs a module to load into"):
        ModelSpec(model=lambda x: x, checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="input_shape"):
        ModelSpec(model=lambda x: x, input_shape=(0,))
    spec = ModelSpec(model=torch.nn.Linear(2, 2), checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="no committed checkpoint there"):
        spec.resolved()


def test_the_serve_table_of_a_job_file_and_training_ignoring_it(tmp_path):
    from raymesh import train
    from raymesh.serve.jobfile import load_serving

    job = tmp_path / "job.toml"
    job.write_text(
        'build = "raymesh.examples.tinygpt:build"\nseed = 3\n'
        '[checkpoint]\ndir = "runs/x"\n'
        '[serve]\ngenerate = "raymesh.examples.tinygpt:serve_text"\nreplicas = [1, 3]\n'
    )
    model, config = load_serving(job, port=0, checkpoint=None)
    assert model == {
        "generate": "raymesh.examples.tinygpt:serve_text",
        "build": "raymesh.examples.tinygpt:build",
        "checkpoint": "runs/x",
        "seed": 3,
    }
    assert config.replicas == (1, 3) and config.port == 0
    assert train.load_config(job).seed == 3  # `raymesh train` reads the same file
    job.write_text('build = "raymesh.examples.tinygpt:build"\n[serve]\nreplica = 2\n')
    with pytest.raises(ValueError, match=r"job.toml: \[serve\] has unknown key"):
        load_serving(job)


@pytest.fixture
def pem(tmp_path):
    """Two files that stand for a certificate and its key (Tls checks that they exist)."""
    (tmp_path / "cert.pem").write_text("cert")
    (tmp_path / "key.pem").write_text("key")
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


@pytest.mark.parametrize(
    "field",
    ["admin_token", "checkpoint_root", "tls", "max_connections", "keep_alive_s", "max_streams"],
)
def test_the_ray_serve_backend_refuses_what_its_proxy_would_not_apply(field, pem, tmp_path):
    from raymesh.serve import ServeConfig, Tls

    value = {
        "admin_token": "admin-token-0123456",
        "checkpoint_root": str(tmp_path),
        "tls": Tls(cert=pem[0], key=pem[1]),
        "max_connections": 10,
        "keep_alive_s": 60.0,
        "max_streams": 4,
    }[field]
    fields = {field: value}
    if field == "admin_token":
        fields["checkpoint_root"] = str(tmp_path)  # which it needs
    ServeConfig(**fields)  # fine with raymesh's own front
    with pytest.raises(ValueError, match=rf'{field}=.*: backend="ray-serve" cannot apply it'):
        ServeConfig(backend="ray-serve", **fields)
    # The token and the body's limits hold there too: the deployment checks them (Guard).
    config = ServeConfig(
        backend="ray-serve", token="t-token-0123456789", max_body_bytes=10, body_timeout_s=1
    )
    assert config.bearer() == "t-token-0123456789" and config.admin() is None


def test_tls_and_the_reload_fields_from_a_job_file_and_the_command_line(pem, tmp_path):
    from raymesh.serve import Tls
    from raymesh.serve.jobfile import load_serving

    job = tmp_path / "job.toml"
    job.write_text(
        'build = "raymesh.examples.mlp:build"\n'
        f'[serve]\ncheckpoint_root = "{tmp_path}"\n'
        f'tls = {{cert = "{pem[0]}", key = "{pem[1]}"}}\n'
    )
    _, config = load_serving(job, admin_token="from-cli-token-0123")
    assert config.tls == Tls(cert=pem[0], key=pem[1])
    assert config.checkpoint_root == str(tmp_path) and config.admin() == "from-cli-token-0123"
    _, config = load_serving(job, tls=Tls(cert=pem[1], key=pem[0]))  # --tls-cert/--tls-key
    assert config.tls == Tls(cert=pem[1], key=pem[0]) and config.admin() is None
