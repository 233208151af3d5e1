"""raymesh.data without procs: sources read by index, batches as pure functions, bad input."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raymesh import data
from raymesh.train import TrainConfig, load_config
from tests.data.helpers import Indexed, augment, fails_on_seven


@pytest.fixture
def shards(tmp_path):
    """Two Parquet files of 25 and 15 rows, row groups of 7: ids 0..39 in file order."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, ids in (("a.parquet", range(25)), ("b.parquet", range(25, 40))):
        table = pa.table({"id": list(ids), "sq": [i * i for i in ids]})
        pq.write_table(table, folder / name, row_group_size=7)
    return folder


def test_parquet_rows_are_read_by_global_index_across_files_and_row_groups(shards):
    src = data.from_files(str(shards / "*.parquet"))
    assert len(src) == 40 and "2 files" in src.describe()
    rows = src.read([39, 0, 24, 25, 8, 8])
    assert [r["id"] for r in rows] == [39, 0, 24, 25, 8, 8]
    assert rows[0] == {"id": 39, "sq": 39 * 39}
    only = data.from_files(str(shards / "*.parquet"), columns=["sq"])
    assert only.read([3]) == [{"sq": 9}]


def test_an_image_folder_gives_pillow_images_labelled_by_their_folder(tmp_path):
    for label, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / label).mkdir()
        for k in range(3):
            Image.new("RGB", (4 + k, 4), color).save(tmp_path / label / f"{k}.png")
    src = data.from_files(str(tmp_path))
    assert len(src) == 6
    (image, label), (image2, label2) = src.read([0, 5])
    assert isinstance(image, Image.Image) and image.getpixel((0, 0)) == (255, 0, 0)
    assert (label, label2) == (0, 1) and image2.size == (6, 4)


def test_bad_files_and_patterns_fail_before_anything_runs(tmp_path, shards):
    with pytest.raises(ValueError, match=r"no file matches"):
        data.from_files(str(tmp_path / "nothing" / "*.parquet"))
    (shards / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"broken.parquet is not a readable Parquet file"):
        data.from_files(str(shards / "*.parquet"))
    (tmp_path / "bad.png").write_bytes(b"\x89PNG nonsense")
    with pytest.raises(ValueError, match=r"bad.png is not a readable image"):
        data.from_files(str(tmp_path / "*.png"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unknown suffixes \['.txt'\]"):
        data.from_files(str(tmp_path / "*.*"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("workers", (3, 1), "data.workers=(3, 1)"),
        ("workers", -1, "data.workers=-1"),
        ("prefetch", 0, "data.prefetch=0"),
        ("on_error", "ignore", "give 'raise' or 'skip'"),
        ("transform", "no_such_module:fn", "cannot import module"),
        ("cpus_per_worker", 0, "data.cpus_per_worker=0"),
    ],
)
def test_a_bad_field_names_itself_the_value_and_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        data.Pipeline(source=Indexed(8), **{field: value})


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_a_batch_is_a_function_of_seed_step_and_indices_and_leaves_the_callers_rng_alone():
    pipe = data.Pipeline(source=Indexed(16), transform=augment)
    _seed_all(5)
    expected = torch.rand(3), random.random(), np.random.rand()
    _seed_all(5)
    a = data.make_batch(pipe, 0, 3, [1, 2, 3])
    b = data.make_batch(pipe, 0, 3, [1, 2, 3])
    got = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert torch.equal(a[0], b[0]) and a[1].tolist() == [1, 2, 3]
    assert not torch.equal(a[0], torch.tensor([[1.0, 1], [2, 2], [3, 3]]))  # augmented
    other_step = data.make_batch(pipe, 0, 4, [1, 2, 3])
    other_seed = data.make_batch(pipe, 1, 3, [1, 2, 3])
    assert not torch.equal(a[0], other_step[0]) and not torch.equal(a[0], other_seed[0])
    # The same sample at the same step is augmented the same in any batch it is in.
    alone = data.make_batch(pipe, 0, 3, [2])
    assert torch.equal(alone[0][0], a[0][1])


def test_a_failing_sample_raises_naming_source_and_index_or_is_skipped_once(caplog):
    raising = data.Pipeline(source=Indexed(16), transform=fails_on_seven)
    with pytest.raises(data.DataError, match=r"dataset Indexed .*sample 7: transform raised "):
        data.make_batch(raising, 0, 0, [6, 7, 8])
    skipping = data.Pipeline(source=Indexed(16), transform=fails_on_seven, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        batch = data.make_batch(skipping, 0, 0, [6, 7, 8])
        data.make_batch(skipping, 0, 0, [6, 7, 8])
    assert batch[1].tolist() == [6, 8]
    assert sum("sample 7" in r.message for r in caplog.records) == 1
    with pytest.raises(data.DataError, match="every sample"):
        data.make_batch(skipping, 0, 0, [7])


def test_a_job_file_data_table_is_a_pipeline(tmp_path, shards):
    job = tmp_path / "job.toml"
    job.write_text(
        f"""
build = "tests.data.helpers:build_without_data"
workers = 2
steps = 5
global_batch_size = 8

[data]
source = "{shards}/*.parquet"
transform = "tests.data.helpers:slow"
workers = [1, 3]
prefetch = 2
"""
    )
    config = load_config(job)
    assert isinstance(config.data, data.Pipeline)
    assert config.data.bounds == (1, 3) and config.data.prefetch == 2 and len(config.data) == 40
    manifest = json.loads(json.dumps(config.to_dict()))
    assert manifest["data"]["workers"] == [1, 3]
    assert manifest["data"]["transform"] == "tests.data.helpers:slow"
    with pytest.raises(ValueError, match=r"\[data\] has unknown key\(s\) \['sorce'\]"):
        TrainConfig(data={"sorce": "x"})
    with pytest.raises(ValueError, match="no file matches"):
        TrainConfig(data={"source": str(tmp_path / "missing/*.parquet")})


def test_scaling_adds_a_worker_when_trainers_wait_and_removes_one_when_far_ahead():
    policy = data.ScalePolicy(min=1, max=3)
    up = policy.decide(workers=1, wait_fraction=0.4, busy_workers=1.0)
    assert up is not None and up.workers == 2 and "waited 40%" in up.reason
    assert policy.decide(workers=3, wait_fraction=0.4, busy_workers=3.0) is None  # at max
    down = policy.decide(workers=3, wait_fraction=0.0, busy_workers=0.5)
    assert down is not None and down.workers == 2 and "ahead" in down.reason
    assert policy.decide(workers=3, wait_fraction=0.0, busy_workers=1.5) is None  # still needed
    assert policy.decide(workers=1, wait_fraction=0.0, busy_workers=0.0) is None  # at min


def test_the_progress_bar_shows_the_pipeline_when_there_is_one():
    import io

    from raymesh.cli.progress import ProgressBar

    base = {"step": 5, "steps": 10, "loss": 1.0, "samples_per_s": 100.0, "eta_s": 3.0}
    base["ranks"] = [{"rank": 0, "loss": 1.0}]
    out = io.StringIO()
    ProgressBar(out)(base)
    ProgressBar(out)(base | {"data_wait": 0.25, "data_workers": 2, "data_samples_per_s": 999.6})
    plain, piped = out.getvalue().splitlines()
    assert "data" not in plain
    assert piped.endswith("| data wait 25%, 2 prep 1000 samples/s")
