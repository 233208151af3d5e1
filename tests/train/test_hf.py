"""Fine-tuning Hugging Face models (raymesh.train.hf) and exporting them (raymesh.train.export,
`raymesh export`), with real transformers and peft on a tiny Llama saved from a config: all in
this process, no Ray, no process group, nothing downloaded."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: a hub call fails, not hangs

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from raymesh import train  # noqa: E402
from raymesh.train import hf  # noqa: E402
from tests.train.hf_runs import job, logits, text_file, trained_run  # noqa: E402

IDS = torch.tensor([list(b"def main():\n    return 0\n")])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return hf.save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return text_file(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny, text):
    """(checkpoint folder, the trained Task) of a full fine-tune."""
    dir = tmp_path_factory.mktemp("full")
    return dir, trained_run(dir, job(tiny, text))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny, text):
    """(checkpoint folder, the trained Task) of a LoRA fine-tune."""
    dir = tmp_path_factory.mktemp("lora")
    return dir, trained_run(dir, job(tiny, text, lora_r=4))


# -- the model ---------------------------------------------------------------------------------


def test_a_tiny_llama_is_the_same_bytes_for_a_seed_and_loads_back_with_its_tokenizer(tmp_path):
    a = hf.save_tiny_llama(tmp_path / "a", seed=1)
    b = hf.save_tiny_llama(tmp_path / "b", seed=1)
    c = hf.save_tiny_llama(tmp_path / "c", seed=2)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    model = transformers.AutoModelForCausalLM.from_pretrained(a, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(a, local_files_only=True)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer) == 257
    assert tokenizer("hé", add_special_tokens=False)["input_ids"] == list("hé".encode())
    assert tokenizer.decode([*b"ok", tokenizer.eos_token_id]) == "ok<eos>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temp left


def test_save_tiny_llama_refuses_a_folder_that_is_not_empty_and_fills_an_empty_one(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"path=.*taken.*not an empty folder; give a new one"):
        hf.save_tiny_llama(tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert (hf.save_tiny_llama(tmp_path / "empty") / "config.json").is_file()


def test_loading_names_a_folder_that_holds_no_model_or_no_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"model=.*nowhere.*no such folder"):
        hf.load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"model=.*not a model folder \(no config.json\)"):
        hf.load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer=.*no tokenizer files.*save_pretrained"):
        hf.load_tokenizer(tmp_path)


class Plant:
    """Unpickled, it opens `path` for writing, which creates the file: a stand-in for any code a
    planted pickle could run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("kind", ["model", "adapter"])
def test_weights_saved_as_a_pickle_are_refused_unread_naming_the_folder_and_the_fix(
    tiny, tmp_path, kind
):
    """Safetensors only: a `pytorch_model.bin` (or `adapter_model.bin`) folder is refused before
    the pickle is opened, whether it holds real weights (which torch.load would read) or a
    pickle that runs code."""
    model = hf.load_causal_lm(tiny, lora=hf.Lora(r=4) if kind == "adapter" else None)
    state = peft.get_peft_model_state_dict(model) if kind == "adapter" else model.state_dict()
    weights = {k: v.clone() for k, v in state.items()}  # what torch.load would read
    marker = tmp_path / "planted-code-ran"
    for payload in (weights, Plant(marker)):
        folder = tmp_path / f"{kind}-{type(payload).__name__}"
        model.save_pretrained(folder)
        stem = "adapter_model" if kind == "adapter" else "model"
        (folder / f"{stem}.safetensors").unlink()
        pickle = folder / ("adapter_model.bin" if kind == "adapter" else "pytorch_model.bin")
        torch.save(payload, pickle)
        with pytest.raises(ValueError) as e:
            hf.load_causal_lm(folder)
        message = str(e.value)
        assert message.startswith(f"model={str(folder)!r}: its weights are [{pickle.name!r}]")
        assert "safetensors only" in message and "save_pretrained(folder)" in message
        if kind == "model":  # built on meta too: refused before PretrainedWeights reads it
            with pytest.raises(ValueError, match="safetensors only"):
                hf.load_causal_lm(folder, meta=True)
    assert not marker.exists()


def test_a_loaded_model_is_fp32_without_a_cache_and_lora_trains_only_the_adapter(tiny):
    full = hf.load_causal_lm(tiny)
    assert full.config.use_cache is False
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in full.parameters())
    model = hf.load_causal_lm(tiny, lora=hf.Lora(r=4, targets=["q_proj", "v_proj"]))
    assert isinstance(model, peft.PeftModel)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".q_proj.lora_A" in n for n in trainable)
    assert any(".v_proj.lora_B" in n for n in trainable)
    assert not any(".k_proj." in n for n in trainable)


def test_lora_targets_that_match_no_module_are_named_with_the_models_linear_modules(tiny):
    with pytest.raises(ValueError) as e:
        hf.load_causal_lm(tiny, lora=hf.Lora(targets=("q_proj", "query")))
    message = str(e.value)
    assert message.startswith("targets=['q_proj', 'query']: ['query'] match no module")
    assert "'k_proj', 'lm_head', 'o_proj', 'q_proj'" in message


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"r": 0}, "lora.r=0"),
        ({"alpha": 0}, "lora.alpha=0"),
        ({"dropout": 1.0}, "lora.dropout=1.0"),
        ({"targets": ()}, "lora.targets=()"),
        ({"targets": ["q_proj", ""]}, "lora.targets="),
    ],
)
def test_a_bad_lora_names_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"^{named}"):
        hf.Lora(**fields)
    assert hf.Lora(targets=["a", "b"]).targets == ("a", "b")


# -- the data and the job ----------------------------------------------------------------------


def test_packed_text_is_contiguous_blocks_without_the_tail_and_refuses_too_little(tiny):
    blocks = hf.PackedText(list(range(10)), 3)
    assert len(blocks) == 3
    assert [b.tolist() for b in blocks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert blocks[-1].dtype == torch.long and blocks[-1].tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        blocks[3]
    with pytest.raises(ValueError, match=r"block_size=11: the text has 10 tokens, not one block"):
        hf.PackedText(list(range(10)), 11)
    with pytest.raises(ValueError, match="block_size=1"):
        hf.PackedText(list(range(10)), 1)
    tokenizer = hf.load_tokenizer(tiny)
    packed = hf.packed_text(tokenizer, ["ab", "cd"], 2)  # documents joined by eos
    assert packed.tokens.tolist() == [97, 98, tokenizer.eos_token_id, 99]
    stacked = torch.utils.data.default_collate([packed[0], packed[1]])
    assert stacked.shape == (2, 2)
    assert hf.python_text() == hf.python_text() and len(hf.python_text()) > 100_000


def test_build_gives_a_finite_loss_and_an_optimizer_of_the_trainable_params_only(tiny, text):
    from tests.train.hf_runs import built

    lora = built(job(tiny, text, lora_r=4, eval_fraction=0.25))
    trainable = [p for p in lora.model.parameters() if p.requires_grad]
    held = [p for g in lora.optimizer.param_groups for p in g["params"]]
    assert len(held) == len(trainable) < len(list(lora.model.parameters()))
    assert all(p.requires_grad for p in held)
    assert lora.optimizer.param_groups[0]["lr"] == 1e-3
    assert (len(lora.dataset), len(lora.eval_dataset)) == (21, 7)  # 28 blocks of 64
    # The text's blocks in order: the training set's, then the eval set's.
    blocks = hf.packed_text(hf.load_tokenizer(tiny), text.read_text(), 64)
    assert torch.equal(lora.dataset[20], blocks[20]) and torch.equal(
        lora.eval_dataset[0], blocks[21]
    )
    batch = torch.utils.data.default_collate([lora.dataset[i] for i in range(2)])
    loss = lora.loss_fn(lora.model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss) and 4.0 < float(loss) < 7.0  # ~ln(257)
    full = built(job(tiny, text, eval_fraction=0))
    assert full.eval_dataset is None and len(full.dataset) == 28
    assert full.optimizer.param_groups[0]["lr"] == 1e-4
    assert sum(len(g["params"]) for g in full.optimizer.param_groups) == len(
        list(full.model.parameters())
    )


DROP = object()  # a key left out of the params


@pytest.mark.parametrize(
    "change, message",
    [
        ({"modle": "x"}, r"\[params\] has unknown key\(s\) \['modle'\]; the keys are .*'lora_r'"),
        ({"model": DROP}, r"params.model=None: give the folder"),
        ({"lora_alpha": 8}, r"params.lora_alpha=8: LoRA needs lora_r >= 1"),
        ({"lora_r": 4, "lora_targets": ["nope"]}, r"targets=\['nope'\].*match no module"),
        ({"lora_r": 4, "lora_dropout": 2}, r"params.lora_dropout=2"),
        ({"lr": 0}, r"params.lr=0: give a number > 0"),
        ({"eval_fraction": 1}, r"params.eval_fraction=1"),
        ({"block_size": 4096}, r"block_size=4096: the text has 1800 tokens"),
        ({"text": "/no/such.txt"}, r"params.text='/no/such.txt'"),
    ],
)
def test_bad_params_name_the_key_and_the_fix(tiny, text, change, message):
    from raymesh.train import Context, TrainConfig

    params = {"model": str(tiny), "text": str(text)} | change
    params = {k: v for k, v in params.items() if v is not DROP}
    ctx = Context.alone(config=TrainConfig(params=params))
    with pytest.raises(ValueError, match=message):
        hf.build(ctx)


def test_generate_streams_the_greedy_text_of_an_uncached_decode_and_is_seeded(tiny):
    model = hf.load_causal_lm(tiny).eval()
    tokenizer = hf.load_tokenizer(tiny)
    pieces = list(hf.generate(model, "def ", 12, 0.0, 0))
    ids = list(b"def ")
    for _ in range(12):  # the same decode without a KV cache, one whole forward per token
        ids.append(int(logits(model, torch.tensor([ids]))[0, -1].argmax()))
    want = ids[4:]
    if tokenizer.eos_token_id in want:
        want = want[: want.index(tokenizer.eos_token_id)]
    assert "".join(pieces) == tokenizer.decode(want)
    assert len(pieces) == len(want)  # one piece per token
    sampled = [list(hf.generate(model, "def ", 12, 1.0, seed)) for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


# -- export ------------------------------------------------------------------------------------


def test_an_exported_full_fine_tune_loads_with_from_pretrained_and_gives_the_same_logits(
    full_run, tiny, tmp_path
):
    dir, task = full_run
    out = train.export_hf(dir, tmp_path / "out")
    assert out == tmp_path / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logits(model, IDS), logits(task.model, IDS))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    assert not torch.equal(logits(base, IDS), logits(model, IDS))  # the trained weights
    assert model.config.use_cache is True  # on again, for generation
    assert len(transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)) == 257
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_exported_lora_run_is_an_adapter_on_its_base_and_merged_one_plain_model(
    lora_run, tiny, tmp_path
):
    dir, task = lora_run
    adapter = train.export_hf(dir, tmp_path / "adapter")
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert "model.safetensors" not in names
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    want = logits(task.model, IDS)
    assert torch.equal(logits(loaded, IDS), want)
    merged = train.export_hf(dir, tmp_path / "merged", merge=True)
    assert not (merged / "adapter_config.json").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    assert type(plain) is transformers.LlamaForCausalLM
    assert torch.allclose(logits(plain, IDS), want, atol=1e-5)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    assert not torch.allclose(logits(untrained, IDS), want, atol=1e-5)  # the adapter counts
    # An adapter folder serves as its base with the adapter (load_causal_lm reads its base).
    assert torch.equal(logits(hf.load_causal_lm(adapter), IDS), want)
    # Rebuilt for training on (RL's init=): the optimizer holds the loaded adapters, not the
    # meta parameters hf.build made them from.
    from raymesh.train.export import rebuild

    rebuilt = rebuild(dir)
    held = [p for g in rebuilt.optimizer.param_groups for p in g["params"]]
    trained = [p for p in rebuilt.model.parameters() if p.requires_grad]
    assert held and [id(p) for p in held] == [id(p) for p in trained]


# A user's job script: the build function lives in it, so `raymesh export` cannot import it.
USER_SCRIPT = """
import torch
import transformers
from raymesh import train


def build(ctx):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ctx.params["model"], local_files_only=True, use_safetensors=True
    )
    model.config.use_cache = False
    if ctx.params["lora"]:
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, config)
    blocks = torch.arange(4 * 64).remainder(256).reshape(4, 64)
    return train.Task(
        model=model,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        dataset=list(blocks),
        loss_fn=lambda m, b: m(input_ids=b, labels=b).loss,
    )
"""


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_run_whose_build_lived_in_the_users_script_exports_from_its_checkpoint_alone(
    tiny, tmp_path, kind, capsys
):
    """The checkpoint records the transformers (and PEFT) model; export, rebuild and the CLI
    use that record when the job's build function cannot be imported, and `build=` still wins."""
    import runpy

    from raymesh.cli.main import main
    from raymesh.train.api import _import_name
    from raymesh.train.checkpoint import Manifest
    from raymesh.train.export import rebuild
    from tests.train.hf_runs import step_and_save

    script = tmp_path / "user_job.py"
    script.write_text(USER_SCRIPT)
    build = runpy.run_path(str(script), run_name="__main__")["build"]  # `python user_job.py`
    # What fit() records for it: none for a function of __main__; a module name otherwise.
    named = _import_name(build, build) if kind == "full" else "user_job:build"
    assert (named is None) == (kind == "full")
    config = train.TrainConfig(build=named, params={"model": str(tiny), "lora": kind == "lora"})
    torch.manual_seed(0)
    ctx = train.Context.alone(config=config)
    task = build(ctx)
    step_and_save(task, tmp_path / "run", config)
    want = logits(task.model, IDS)
    step = tmp_path / "run" / "step-00000001"
    record = Manifest.from_json((step / "manifest.json").read_text()).hf
    assert record["class"] == "LlamaForCausalLM" and record["base"] == str(tiny)
    assert (record["peft"] is not None) == (kind == "lora")

    out = train.export_hf(tmp_path / "run", tmp_path / "out")  # no build function
    assert (out / "tokenizer.json").is_file()  # the recorded base folder's
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    assert not torch.equal(logits(base, IDS), want)  # the trained weights, not the base's
    if kind == "lora":
        adapter = json.loads((out / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(tiny)
        loaded = peft.PeftModel.from_pretrained(base, out)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logits(loaded, IDS), want)
    rebuilt = rebuild(tmp_path / "run")  # what serve and init= call
    assert torch.equal(logits(rebuilt.model, IDS), want)
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "cli")]) == 0
    assert "exported the" in capsys.readouterr().out
    with pytest.raises(ValueError, match="holds the weights of another model"):
        train.export_hf(tmp_path / "run", tmp_path / "x", build=_linear)  # build= wins
    assert not (tmp_path / "x").exists()


def test_export_refuses_an_existing_out_and_a_checkpoint_of_another_model_leaving_nothing(
    full_run, tiny, text, tmp_path
):
    dir, _ = full_run
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match=r"out=.*taken.*it exists; give a new folder"):
        train.export_hf(dir, tmp_path / "taken")
    other = hf.save_tiny_llama(tmp_path / "wide", hidden_size=32, heads=2, kv_heads=1)
    wrong = tmp_path / "wrong"  # the job names `tiny`, the weights are `wide`'s
    trained_run(wrong, job(tiny, text), model=hf.load_causal_lm(other))
    with pytest.raises(ValueError) as e:
        train.export_hf(wrong, tmp_path / "out")
    message = str(e.value)
    assert "checkpoint=" in message and "step-00000001" in message
    assert "holds the weights of another model" in message and "of another shape" in message
    assert "model.embed_tokens.weight [257, 32] vs [257, 64]" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "wide", "wrong"]


def test_an_export_that_fails_while_writing_leaves_nothing_behind(full_run, tmp_path, monkeypatch):
    def fail(path):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "load_tokenizer", fail)  # after the weights are written
    with pytest.raises(OSError, match="disk full"):
        train.export_hf(full_run[0], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_needs_a_build_function_and_a_transformers_model(tmp_path):
    from raymesh.train.checkpoint import Checkpointer

    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path / "run").save(
        1,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        world_size=1,
        strategy="ddp",
        config={},  # `fit(fn, config)`: the manifest names no build function
        data_position=0,
        rank=0,
    )
    with pytest.raises(ValueError, match=r"build=None: checkpoint .* names none; pass the build"):
        train.export_hf(tmp_path / "run", tmp_path / "out")

    with pytest.raises(ValueError, match="export --hf needs a transformers model"):
        train.export_hf(tmp_path / "run", tmp_path / "out", build=_linear)
    with pytest.raises(ValueError, match="no committed checkpoint there"):
        train.export_hf(tmp_path / "none", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _linear(ctx):
    model = torch.nn.Linear(2, 2)
    return train.Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=[],
        loss_fn=lambda m, b: m(b).sum(),
    )


def test_raymesh_export_says_what_it_wrote_and_a_mistake_in_one_line(
    lora_run, full_run, tmp_path, capsys
):
    from raymesh.cli.main import main

    dir, _ = lora_run
    assert main(["export", str(dir), "--hf", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out
    assert said.startswith("exported the LoRA adapter") and "step-00000001" in said
    assert main(["export", str(dir), "--hf", str(tmp_path / "m"), "--merge"]) == 0
    assert "exported the merged model" in capsys.readouterr().out
    assert main(["export", str(full_run[0]), "--hf", str(tmp_path / "f")]) == 0
    assert "exported the full model" in capsys.readouterr().out
    assert main(["export", str(full_run[0]), "--hf", str(tmp_path / "g"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raymesh export: merge=True: the model has no LoRA adapter")
    assert len(err.strip().splitlines()) == 1
    assert main(["export", str(dir), "--hf", str(tmp_path / "a")]) == 2
    assert "it exists; give a new folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "f", "m"]
    shutil.rmtree(tmp_path / "a")
