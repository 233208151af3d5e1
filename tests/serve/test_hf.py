"""Serving Hugging Face models in a replica's process (`LoadedModel`, no Ray): an exported
folder (`ModelSpec(hf=...)`, `raymesh serve --hf`) and a checkpoint of raymesh.train.hf's build
function, whose params the replica reads from the checkpoint's job; and, on Ray over HTTP, a
checkpoint whose build function lived in the user's script, served from its record alone."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: a hub call fails, not hangs

import functools
import json
import queue
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from raymesh import serve, train
from raymesh.serve import ModelSpec
from raymesh.serve.model import LoadedModel
from raymesh.train import hf
from raymesh.train.checkpoint import Checkpointer
from tests.serve.helpers import Client, mlp_checkpoint
from tests.train.hf_runs import HF_BUILD, job, logits, step_and_save, text_file, trained_run

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A tiny model, a LoRA run of it, and the run exported as an adapter and merged."""
    root = tmp_path_factory.mktemp("hf")
    tiny = hf.save_tiny_llama(root / "tiny")
    trained_run(root / "run", job(tiny, text_file(root), lora_r=4))
    return {
        "tiny": tiny,
        "run": root / "run",
        "adapter": train.export_hf(root / "run", root / "adapter"),
        "merged": train.export_hf(root / "run", root / "merged", merge=True),
    }


def test_a_replica_serves_an_exported_folder_generating_its_text_and_predicting_logits(runs):
    loaded = LoadedModel(ModelSpec(hf=str(runs["merged"])), CPU)
    assert loaded.info.generates and loaded.info.input_dtype == "int64"
    model = hf.load_causal_lm(runs["merged"]).eval()
    want = list(hf.generate(model, "def f(", 10, 0.0, 0))
    assert list(loaded.generate("def f(", 10, 0.0, 0)) == want
    assert len(want) == 10 and "".join(want)
    values, errors = loaded.predict([[100, 101, 102], [1, 2, 3]])
    assert not errors
    assert torch.equal(
        torch.tensor(values), logits(model, torch.tensor([[100, 101, 102], [1, 2, 3]]))
    )
    # An adapter folder: its base, named in adapter_config.json, with the adapter.
    adapter = LoadedModel(ModelSpec(hf=runs["adapter"]), CPU)
    assert adapter.generate("def f(", 10, 0.0, 0).__next__() == want[0]


def test_streams_decoded_as_one_batch_each_get_their_text_alone(runs):
    """The replica's decoder of an exported folder, as it runs there (no Ray): a long greedy
    stream, joined after its 3rd token by two greedy ones, two sampled ones (their own seeds)
    and one cancelled after its 2nd token; each text is the one `hf.generate` gives alone,
    and the cancelled one leaves without a further token."""
    loaded = LoadedModel(ModelSpec(hf=str(runs["tiny"])), CPU)
    with torch.no_grad():  # sharp attention: untrained, it is near uniform, blind to position
        for layer in loaded.module.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    assert loaded.decoder(1) is None  # one at a time: today's path, a KV cache each
    decoder = loaded.decoder(8)
    assert decoder is not None
    asks = {
        "long": ("def f(", 40, 0.0, 0),
        "join": ("import os", 12, 0.0, 0),
        "join2": ("x", 20, 0.0, 0),
        "sampled": ("class A:", 16, 0.9, 7),
        "sampled2": ("class A:", 16, 0.9, 8),
        "cancelled": ("print(", 30, 0.0, 0),
    }
    alone = {k: list(hf.generate(loaded.module, *a)) for k, a in asks.items()}
    events: dict[str, queue.Queue[tuple[str, Any]]] = {k: queue.Queue() for k in asks}
    handles: dict[str, Any] = {}
    texts: dict[str, list[str]] = {k: [] for k in asks}

    def emit(key: str, kind: str, value: Any) -> None:  # on the decoder's thread
        events[key].put((kind, value))
        if kind != "text":
            return
        texts[key].append(value)
        made = len(texts[key])
        if key == "long" and made == 3:  # the others join before its next token
            for k in asks.keys() - {"long"}:
                handles[k] = submit(k)
        if key == "cancelled" and made == 2:
            handles[key].stop.set()  # left before its next token

    def submit(key: str) -> Any:
        return decoder.submit(*asks[key], functools.partial(emit, key))

    handles["long"] = submit("long")
    ends = {k: _last(events[k]) for k in asks}
    assert ends == {**dict.fromkeys(asks, "end"), "cancelled": "stopped"}, ends
    assert {k: texts[k] for k in asks.keys() - {"cancelled"}} == {
        k: alone[k] for k in asks.keys() - {"cancelled"}
    }
    assert texts["cancelled"] == alone["cancelled"][:2]
    assert decoder.most_at_once == len(asks)  # they ran as one batch
    decoder.close()


def _last(events: queue.Queue[tuple[str, Any]]) -> str:
    while (kind := events.get(timeout=60)[0]) == "text":
        pass
    return kind


def test_a_replica_rebuilds_a_checkpoint_of_the_hf_build_with_its_jobs_params(runs):
    spec = ModelSpec(build=HF_BUILD, checkpoint=str(runs["run"])).resolved()
    loaded = LoadedModel(spec, CPU)  # the build reads params.model and lora_r from the manifest
    served = hf.load_causal_lm(runs["adapter"]).eval()
    ids = torch.tensor([list(b"import os")])
    assert torch.equal(logits(loaded.module, ids), logits(served, ids))


def llama_from_config(ctx: train.Context) -> train.Task:
    """A build function whose causal LM is built from a config: it names no folder."""
    import transformers

    torch.manual_seed(ctx.seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=8,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train.Task(model=model, optimizer=optimizer, loss_fn=hf.causal_lm_loss)


def test_a_causal_lm_of_no_known_folder_generates_unchecked_against_its_context(tmp_path):
    """A checkpoint alone rebuilt by its build from a config, or from a record naming no base
    folder: no tokenizer to count a prompt with, so no context check (decided at load), and
    the user's generate function serves a prompt however long."""
    ctx = train.Context.alone(device=CPU)
    task = llama_from_config(ctx)
    for build in ("tests.serve.test_hf:llama_from_config", "user_job:build"):  # build, record
        run = tmp_path / build.split(":")[0]
        config = train.TrainConfig(build=build).to_dict()
        Checkpointer(run).save(
            1, task.model, task.optimizer, world_size=1, strategy="ddp", config=config,
            data_position=0, rank=0,
        )  # fmt: skip
        spec = ModelSpec(checkpoint=str(run), generate="tests.serve.helpers:alphabet").resolved()
        record = build == "user_job:build"  # not importable here: rebuilt from its record
        assert spec.pinned is not None and spec.pinned.build == (None if record else build)
        loaded = LoadedModel(spec, CPU)
        assert loaded.context is None, build
        assert list(loaded.generate("a prompt of more than 8 tokens", 3, 0.0, 0)) == list("efg")


def test_an_hf_model_spec_refuses_a_checkpoint_another_model_and_a_folder_of_no_model(
    runs, tmp_path
):
    with pytest.raises(ValueError, match="not several or none"):
        ModelSpec(hf=str(runs["merged"]), build=HF_BUILD)
    with pytest.raises(ValueError, match=r"checkpoint=.*an hf folder holds its own weights"):
        ModelSpec(hf=str(runs["merged"]), checkpoint=str(runs["run"]))
    with pytest.raises(ValueError, match=r"hf=.*not a Hugging Face model folder.*raymesh export"):
        ModelSpec(hf=str(tmp_path))
    spec = ModelSpec(hf=runs["merged"], generate=lambda *a: iter(["x"]))
    assert spec.hf == str(runs["merged"]) and callable(spec.generate)  # kept when given


def test_raymesh_serve_takes_an_hf_folder_or_a_job_file_and_says_which_is_missing(
    runs, tmp_path, capsys
):
    from raymesh.cli.main import main

    assert main(["serve", str(tmp_path / "job.toml"), "--hf", str(runs["merged"])]) == 2
    assert "or --hf FOLDER, not both" in capsys.readouterr().err
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "give a job file (raymesh serve job.toml), --checkpoint RUN or --hf FOLDER" in err
    argv = ["serve", "--hf", str(runs["merged"]), "--checkpoint", str(runs["run"])]
    assert main(argv) == 2  # refused before anything starts
    assert "an hf folder holds its own weights" in capsys.readouterr().err


def test_a_job_files_serve_hf_names_the_folder_served_instead_of_its_build(runs, tmp_path):
    from raymesh.serve import ServeConfig, load_serving

    job = tmp_path / "job.toml"
    job.write_text(
        f'build = "{HF_BUILD}"\nsteps = 1\nglobal_batch_size = 2\n'
        f'[params]\nmodel = "{runs["tiny"]}"\n'
        f'[checkpoint]\ndir = "{runs["run"]}"\n'
        f'[serve]\nhf = "{runs["merged"]}"\nmax_batch_size = 4\n'
    )
    model, config = load_serving(job)
    assert model == {"hf": str(runs["merged"])} and config == ServeConfig(max_batch_size=4)
    loaded = LoadedModel(ModelSpec(**model), CPU)
    want = hf.load_causal_lm(runs["merged"]).eval()
    ids = torch.tensor([list(b"import os")])
    assert torch.equal(logits(loaded.module, ids), logits(want, ids))
    job.write_text(job.read_text().replace(f'hf = "{runs["merged"]}"', "hf = 3"))
    with pytest.raises(ValueError, match=r"serve\.hf=3: give the folder"):
        load_serving(job)


# A user's job script: the build function lives in it, so serve cannot import it.
USER_SCRIPT = """
import torch
from raymesh import train
from raymesh.train import hf


def build(ctx):
    model = hf.load_causal_lm(ctx.params["model"], lora=hf.Lora(r=4))
    return train.Task(
        model=model,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        dataset=list(torch.arange(4 * 64).remainder(256).reshape(4, 64)),
        loss_fn=hf.causal_lm_loss,
    )
"""


def test_a_checkpoint_whose_build_lived_in_the_users_script_is_served_from_its_record(
    ray_cluster, runs, tmp_path
):
    """`raymesh serve job.toml` of such a job (what the command runs, in this process): the
    replica rebuilds the LoRA model from the checkpoint's record, generates with the recorded
    base folder's tokenizer and answers the trained model's greedy tokens and logits."""
    from raymesh.serve import load_serving

    build = runpy.run_path(str(_script(tmp_path)), run_name="__main__")["build"]
    config = train.TrainConfig(build="user_job:build", params={"model": str(runs["tiny"])})
    torch.manual_seed(0)
    ctx = train.Context.alone(device=CPU, config=config)
    trained = step_and_save(build(ctx), tmp_path / "run", config).model.eval()
    want = list(hf.generate(trained, "def f(", 8, 0.0, 0))
    ids = [list(b"import os")]
    want_logits = logits(trained, torch.tensor(ids))[0]
    base = hf.load_causal_lm(runs["tiny"])
    assert not torch.equal(logits(base, torch.tensor(ids))[0], want_logits)  # it trained
    job = tmp_path / "job.toml"
    job.write_text(
        f'build = "user_job:build"\n[params]\nmodel = "{runs["tiny"]}"\n'
        f'[checkpoint]\ndir = "{tmp_path / "run"}"\n[serve]\nreplicas = 1\nport = 0\n'
    )
    model, serve_config = load_serving(job)
    assert "build" not in model  # not importable here: the checkpoint alone
    app = serve.deploy(config=serve_config, **model)
    try:
        client = Client(app.url)
        body = {"prompt": "def f(", "max_tokens": 8, "stream": True}
        status, _, events = client.post("/v1/generate", body)
        assert status == 200, events
        lines = [line[6:] for line in events.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", events
        assert [json.loads(line)["text"] for line in lines[:-1]] == want
        status, _, answer = client.post("/v1/predict", {"x": ids[0]})
        assert status == 200, answer
        torch.testing.assert_close(torch.tensor(answer["y"]), want_logits)
        # Streams decoded as one batch (max_streams: 16 by default): a long one; one whose
        # client leaves after its first token; one joining mid-batch. Each has its text alone.
        long = hf.generate(trained, "import os", 200, 0.0, 0)
        long_text = "".join(long)
        running = _stream(app.url, {"prompt": "import os", "max_tokens": 200})
        first = _pieces(running, 1)
        leaving = _stream(app.url, {"prompt": "class A", "max_tokens": 200})
        _pieces(leaving, 1)  # its first token is out: it is in the batch
        assert app.stats()["replicas"][0]["streams"] == 2  # both on the one replica
        leaving.close()  # its client is gone
        status, _, body = client.post("/v1/generate", {"prompt": "def f(", "max_tokens": 8})
        assert status == 200 and body == {"text": "".join(want), "tokens": 8}, body
        assert first + _pieces(running) == long_text
        stats = app.stats()  # the one that left was stopped, mid-batch, long before its end
        assert stats["stopped_streams"] == 1 and stats["replicas"][0]["streams"] == 0, stats
    finally:
        app.stop()


def _stream(url: str, body: dict[str, Any]) -> Any:
    """The response of a streamed /v1/generate, to read event by event."""
    client = Client(url)
    data = json.dumps({**body, "stream": True}).encode()
    client.conn.request("POST", "/v1/generate", body=data, headers=client.headers)
    response = client.conn.getresponse()
    assert response.status == 200
    return response


def _pieces(response: Any, n: int | None = None) -> str:
    """The text of the next `n` events of a stream (all, to its end, with None)."""
    text = ""
    while n is None or n > 0:
        line = response.readline().decode()
        if line.startswith("data: [DONE]"):
            break
        if line.startswith("data: "):
            text += json.loads(line[6:])["text"]
            n = None if n is None else n - 1
        elif not line:
            raise AssertionError("the stream ended without [DONE]")
    return text


def test_a_checkpoint_alone_with_no_build_and_no_record_is_refused_naming_it_and_the_fix(
    runs, tmp_path, capsys
):
    from raymesh.cli.main import main

    plain = mlp_checkpoint(tmp_path / "mlp", seed=1)  # its manifest names no build function
    assert main(["serve", "--checkpoint", str(plain)]) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert f"checkpoint='{plain}/step-00000001'" in err
    assert "records no Hugging Face model" in err and "build function that trained it" in err
    # A build function given still wins over the record: here another model's, refused.
    spec = ModelSpec(build="raymesh.examples.mlp:build", checkpoint=str(runs["run"])).resolved()
    with pytest.raises(ValueError, match="another model"):
        LoadedModel(spec, CPU)


def _script(folder: Path) -> Path:
    script = folder / "user_job.py"
    script.write_text(USER_SCRIPT)
    return script
