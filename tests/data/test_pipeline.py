"""raymesh.data on real procs: batches made ahead on preprocessing procs equal the ones made in
place, a SIGKILLed preprocessing proc changes nothing, scaling follows the consumer's wait, and
train.fit with a pipeline is bitwise the run without one (healing and resuming included)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Generator
from typing import Any

import pytest
import torch

from raymesh import data, train
from raymesh.data import order
from raymesh.data.loader import Batches

from ..train.weights import equal
from ..waiting import wait_for
from .helpers import Indexed, RecordPid, augment, fails_on_seven, pause, slow, teacher

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

BUILD = "tests.data.helpers:build"
BUILD_WITHOUT_DATA = "tests.data.helpers:build_without_data"


def _expected(pipe, step, batch_size, seed=0):
    return data.make_batch(pipe, seed, step, order.global_batch(seed, step, batch_size, len(pipe)))


def _pids(folder) -> list[int]:
    return [int(p) for p in os.listdir(folder)]


class _Consumer:
    """A `data.batches` stream consumed one batch per `next()`; with `check`, each checked
    against the batch made here for its step (which makes the consumer as slow as the
    transform: the scaling test, which needs a consumer that never waits itself, does not)."""

    def __init__(self, pipe: data.Pipeline, stream: Batches, batch_size: int, check: bool):
        self.pipe, self.stream, self.batch_size, self.check = pipe, stream, batch_size, check
        self.batches: Generator[Any, None, None] = iter(stream)  # type: ignore[assignment]
        self.step = 0

    def next(self) -> None:
        batch = next(self.batches)
        if self.check:
            expected = _expected(self.pipe, self.step, self.batch_size)
            assert all(torch.equal(a, b) for a, b in zip(batch, expected)), self.step
        self.step += 1

    def until(self, done, what: str, timeout: float = 120.0, pace_s: float = 0.0) -> Any:
        """Take batches (one every `pace_s` at most) until `done()` is true; returns it."""
        return wait_for(lambda: self.next() or done(), timeout, what=what, interval=pace_s)

    def workers(self) -> list[int]:
        return [d.workers for d in self.stream.report().decisions]


def test_batches_made_on_workers_equal_batches_made_here_through_a_sigkill(tmp_path):
    pipe = data.Pipeline(source=Indexed(64), transform=RecordPid(str(tmp_path)), workers=2)
    stream = data.batches(pipe, batch_size=8, steps=100_000)
    checked = _Consumer(pipe, stream, 8, check=True)
    killed = checked.until(lambda: _pids(tmp_path), "a worker making a batch")[0]
    os.kill(killed, signal.SIGKILL)
    checked.until(lambda: stream.report().replaced, "the killed worker replaced")
    for _ in range(20):  # and the batches made since are the same
        checked.next()
    checked.batches.close()  # stops the workers
    assert killed != os.getpid()
    report = stream.report()
    assert report.replaced == 1 and report.workers == 0, report


def test_workers_scale_up_under_a_slow_transform_and_down_when_the_consumer_is_slow():
    pipe = data.Pipeline(
        source=Indexed(64), transform=slow, workers=(1, 3), prefetch=6, scale_interval_s=0.3
    )
    stream = data.batches(pipe, batch_size=4, steps=100_000)
    consumer = _Consumer(pipe, stream, 4, check=False)
    # A consumer that never waits itself: the trainers' wait adds workers, one at a time.
    consumer.until(lambda: 3 in consumer.workers(), "scaling up to 3 workers")
    # Then one that takes 0.15 s a batch: the pipeline gets far ahead, and removes one.
    consumer.until(lambda: consumer.workers()[-1] < 3, "scaling down", pace_s=0.15)
    consumer.batches.close()
    assert consumer.workers()[:2] == [2, 3] and consumer.workers()[-1] == 2, stream.report()


def test_a_ray_dataset_and_parquet_files_are_sources_read_on_a_worker(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    ds = ray.data.range(50, override_num_blocks=5).map(lambda r: {"x": r["id"] * 3})
    source = data.from_ray(ds)
    assert len(source) == 50 and source.read([49, 0, 7]) == [{"x": 147}, {"x": 0}, {"x": 21}]
    assert [r["x"] for r in source.read(list(range(50)))] == [3 * i for i in range(50)]
    pq.write_table(pa.table({"x": list(range(30))}), tmp_path / "a.parquet", row_group_size=8)
    for src in (source, data.from_files(str(tmp_path / "*.parquet"))):
        pipe = data.Pipeline(source=src, workers=1, prefetch=2)
        n = len(src)
        scale = 3 if src is source else 1
        for step, batch in enumerate(data.batches(pipe, batch_size=8, steps=6)):
            ids = order.global_batch(0, step, 8, n)
            assert batch["x"].tolist() == [i * scale for i in ids]


def _config(**kw) -> train.TrainConfig:
    base = dict(workers=2, steps=24, global_batch_size=32, seed=0, report_every=2)
    base.update(kw)
    return train.TrainConfig(**base)


def test_fit_with_a_pipeline_is_bitwise_the_fit_without_one(tmp_path):
    # train.fit, not the warm `fit`: on warm ranks the 40 steps can end before the workers
    # are up, and this test checks the later batches came from them.
    plain = train.fit(BUILD, _config(steps=40))
    pipe = data.Pipeline(source=teacher(), transform=pause, workers=2)  # pause: a cost, no change
    piped = train.fit(BUILD_WITHOUT_DATA, _config(steps=40, data=pipe, run_dir=str(tmp_path)))
    assert equal(plain.state_dict(), piped.state_dict())
    assert piped.data is not None and piped.data.peak_workers == 2
    assert 0.0 <= piped.data.wait_fraction <= 1.0
    rows = piped.history
    assert all("data_wait" in r and r["data_workers"] in (0, 1, 2) for r in rows)
    assert all(r["data_samples_per_s"] >= 0 for r in rows)
    assert rows[-1]["data_workers"] == 2  # up before the end: the later batches came from them
    assert "data_wait" in (tmp_path / "metrics.jsonl").read_text()
    assert plain.data is None and "data_wait" not in plain.history[0]


def test_augmented_fit_heals_a_killed_preprocessing_proc_and_resumes_mid_epoch(fit, tmp_path):
    """Both runs mix batches made by the ranks (until the workers are up) and by workers."""
    pids = tmp_path / "pids"
    pids.mkdir()
    replaced = tmp_path / "replaced"  # the job runs slowly until this file exists
    transform = RecordPid(str(pids), until=str(replaced))
    pipe = data.Pipeline(source=teacher(), transform=transform, workers=2, prefetch=2)
    killed: list[int] = []
    lost = _Heard("preprocessing worker lost")
    logging.getLogger("raymesh").addHandler(lost)

    def kill_one() -> None:
        try:
            killed.append(wait_for(lambda: _pids(pids), 120, what="a worker making a batch")[0])
            os.kill(killed[0], signal.SIGKILL)
            lost.heard.wait(timeout=60)  # the pool saw it: the job may go at full speed
        finally:
            replaced.touch()

    killer = threading.Thread(target=kill_one)
    killer.start()
    try:
        healed = fit(BUILD_WITHOUT_DATA, _config(data=pipe))
    finally:
        replaced.touch()
        logging.getLogger("raymesh").removeHandler(lost)
        killer.join(timeout=130)
    assert killed, "no preprocessing proc made a batch"
    # A preprocessing proc is not a rank: nothing to heal there; the pool replaced it.
    assert healed.failures == [] and healed.data is not None and healed.data.replaced == 1

    # 200 samples, 32 a step: step 10 ends inside the second epoch.
    ckpt = train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10)
    augmented = data.Pipeline(source=teacher(), transform=augment, workers=1)
    fit(BUILD_WITHOUT_DATA, _config(steps=10, checkpoint=ckpt, data=augmented))
    resumed = fit(BUILD_WITHOUT_DATA, _config(checkpoint=ckpt, data=augmented))
    assert resumed.resumed_from == 10
    assert equal(healed.state_dict(), resumed.state_dict())


class _Heard(logging.Handler):
    """Sets `heard` once a record saying `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.heard = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.heard.set()


def test_a_transform_that_raises_stops_the_job_naming_the_sample_and_skip_leaves_it_out(fit):
    pipe = data.Pipeline(source=Indexed(64), transform=fails_on_seven, workers=1)
    config = _config(global_batch_size=64, steps=4, data=pipe)
    with pytest.raises(train.TrainError, match=r"dataset Indexed .*sample 7: transform raised"):
        fit("tests.data.helpers:build_indexed", config)
    skipping = data.Pipeline(source=Indexed(64), transform=fails_on_seven, on_error="skip")
    sizes = [len(b[1]) for b in data.batches(skipping, batch_size=64, steps=2)]
    assert sizes == [63, 63]
