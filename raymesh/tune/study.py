"""`run`: a hyperparameter study whose trials are whole raymesh.train jobs.

Optuna drives the search from outside (ask and tell): its samplers choose each trial's
parameters (TPE by default, "random", or "grid" over choice-only spaces), and its pruners stop
trials early (`scheduler`: "asha" is Optuna's asynchronous successive halving, "hyperband",
"median"). Every report of a trial's job (one per `TrainConfig.report_every` steps) is told to
the pruner with its step; a trial told to stop ends at that step boundary, its procs stopped.

What `run` returns (`Study`, `TrialResult`) and the files it writes are `results`'s.

Guarantees:
- A trial is `train.fit(build, config)` with the trial's parameters in `config.params` (the
  build reads `ctx.params`): any world size and strategy, self-healing included. A trial that
  fails for good (`TrainError`, `TooManyFailures`) is recorded as failed, with its error, and
  the study goes on.
- Trial procs are started once and reused (`train.WarmRanks`): a trial that ends (complete, or
  pruned once its ranks finish the chunk they were given) hands its procs to the next trial,
  which builds its model there. A failed trial's procs are stopped, never reused. At most as
  many trials run at once as the cluster has room for (`concurrent` is lowered to that, with a
  warning), so no trial waits for another's resources.
- With `storage`, the study lives in Optuna's SQLite storage next to the trials' folders.
  `resume=True` continues a study whose controller died: finished trials are kept, trials that
  were running are run again with the same parameters, from their last checkpoint when
  `config.checkpoint.every` made one (each trial checkpoints in a folder named after its
  parameters).
- Bad input (an empty or invalid space, an unknown scheduler or sampler, a metric that jobs do
  not report, a mode other than "min" or "max") is a ValueError before any trial starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raymesh import train
from raymesh._common import resolve
from raymesh.tune.results import Study, TrialResult, collect, failed_for_good, write
from raymesh.tune.space import domains, to_distributions

__all__ = ["METRICS", "Study", "TrialResult", "run"]

logger = logging.getLogger("raymesh")

# What a job reports at each chunk (train.fit's progress), and so what a study can optimize.
METRICS = ("loss", "samples_per_s")
SCHEDULERS = ("asha", "hyperband", "median", None)
SAMPLERS = ("tpe", "random", "grid")


class _Pruned(Exception):
    """Raised from a trial's progress callback: the pruner stopped it at this step."""


def _pruner(scheduler: str | None, first_step: int) -> Any:
    import optuna

    if scheduler == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first_step, reduction_factor=4)
    if scheduler == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first_step)
    if scheduler == "median":
        return optuna.pruners.MedianPruner(n_warmup_steps=first_step)
    return optuna.pruners.NopPruner()


def _sampler(sampler: str, found: Mapping[str, Any], seed: int) -> Any:
    import optuna

    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler == "grid":  # every point is enqueued (`_grid`): the sampler never draws
        not_choice = [n for n, d in found.items() if d.kind != "choice"]
        if not_choice:
            raise ValueError(
                f"sampler='grid' needs choice() for every parameter; {not_choice} are ranges"
            )
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _grid(study: Any, found: Mapping[str, Any]) -> int:
    """Enqueue every point of a choice-only space not tried yet (Optuna's GridSampler ends
    the study from inside its own optimize loop, which ask-and-tell does not run); returns
    the number of points."""
    names = list(found)
    points = [dict(zip(names, p)) for p in itertools.product(*(found[n].options for n in names))]
    tried = [t.params for t in study.get_trials(deepcopy=False)]
    for point in points:
        if point not in tried:
            study.enqueue_trial(point)
    return len(points)


def _check(metric: str, mode: str, scheduler: Any, sampler: Any, trials: Any, concurrent: Any):
    if metric not in METRICS:
        raise ValueError(
            f"metric={metric!r}: a job reports {list(METRICS)} at each step; optimize one of them"
        )
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}: give 'min' or 'max'")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}: give one of {list(SCHEDULERS)}")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: give one of {list(SAMPLERS)}")
    for name, value in (("trials", trials), ("concurrent", concurrent)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: give an integer >= 1")


def _slug(params: Mapping[str, Any]) -> str:
    text = json.dumps(params, sort_keys=True, default=str)
    return "trial-" + hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A study's arguments, checked (`_plan`): what each trial runs and what the study keeps."""

    fn: Callable[[train.Context], train.Task]  # the build, resolved
    config: train.TrainConfig  # every trial's, with the trial's parameters added
    found: Mapping[str, Any]  # the searched parameters' domains
    constants: Mapping[str, Any]  # the space's fixed values, given to every trial as they are
    distributions: dict[str, Any]  # `found` as Optuna's distributions, for `study.ask`
    sampler: Any  # the Optuna sampler
    concurrent: int  # lowered to as many trials as the cluster holds at once
    metric: str
    mode: str
    folder: Path | None  # beside the storage: results, plots and the trials' folders
    url: str | None  # Optuna's storage URL; None: in memory


def run(
    build: Callable[[train.Context], train.Task] | str,
    config: train.TrainConfig,
    *,
    space: Mapping[str, Any],
    trials: int = 16,
    concurrent: int = 1,
    metric: str = "loss",
    mode: str = "min",
    scheduler: str | None = "asha",
    sampler: str = "tpe",
    storage: str | None = None,
    resume: bool = False,
    seed: int = 0,
    progress: Callable[[Study], None] | None = None,
) -> Study:
    """Run `trials` trials of `build` with parameters drawn from `space`, `concurrent` at a
    time, optimizing `metric` (`mode` "min" or "max"); see the module docstring.

    storage: a path ("runs/study.db"): the Optuna SQLite database, with results.csv, the plots
        and each trial's checkpoints beside it. None: in memory, nothing written.
    resume: continue the study in `storage` (it must exist); without it an existing study is
        an error, so a finished study is never extended by accident.
    progress: called with the study so far after every trial ends (the CLI's live table).
    """
    plan = _plan(
        build,
        config,
        space,
        trials=trials,
        concurrent=concurrent,
        metric=metric,
        mode=mode,
        scheduler=scheduler,
        sampler=sampler,
        storage=storage,
        resume=resume,
        seed=seed,
    )
    study = _open(plan, scheduler, resume)
    if sampler == "grid":
        trials = min(trials, _grid(study, plan.found))
    _Trials(study, plan, trials, progress).run()
    out = collect(study, metric, mode, plan.folder)
    if plan.folder is not None:
        write(out, plan.folder)
    return out


def _plan(
    build: Callable[[train.Context], train.Task] | str,
    config: train.TrainConfig,
    space: Mapping[str, Any],
    *,
    trials: int,
    concurrent: int,
    metric: str,
    mode: str,
    scheduler: str | None,
    sampler: str,
    storage: str | None,
    resume: bool,
    seed: int,
) -> _Plan:
    """`run`'s arguments checked, in this order, before anything is made: the plain values, the
    space, the config, the build's name, the sampler against the space, the storage, and last
    the cluster's room."""
    import optuna

    _check(metric, mode, scheduler, sampler, trials, concurrent)
    found, constants = domains(space)
    distributions = to_distributions(found)
    if not isinstance(config, train.TrainConfig):
        raise TypeError(f"config must be a train.TrainConfig, not {type(config).__name__}")
    fn = resolve(build)  # a bad name fails here, before any trial
    chosen = _sampler(sampler, found, seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder, url = None, None
    if storage is not None:
        db = Path(storage)
        if db.exists() and not resume:
            raise ValueError(
                f"storage={storage!r} already holds a study; pass resume=True to continue it, "
                "or give a new path"
            )
        if resume and not db.exists():
            raise ValueError(f"resume=True: no study at storage={storage!r} to continue")
        folder, url = db.parent, f"sqlite:///{db.resolve()}"
    concurrent = _packed(concurrent, config)  # the last check, before the storage is made
    return _Plan(
        fn, config, found, constants, distributions, chosen, concurrent, metric, mode, folder, url
    )


def _open(plan: _Plan, scheduler: str | None, resume: bool) -> Any:
    """The Optuna study, made (or loaded, with `resume`) in `plan`'s storage, its trials that
    a dead controller left running queued again."""
    import optuna

    if plan.folder is not None:
        plan.folder.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name="raymesh",
        storage=plan.url,
        load_if_exists=resume,
        direction="minimize" if plan.mode == "min" else "maximize",
        sampler=plan.sampler,
        pruner=_pruner(scheduler, plan.config.report_every),
    )
    _requeue_running(study)
    return study


class _Trials:
    """Runs a study's trials on `plan.concurrent` threads, each asking for a trial and running
    it until `trials` have ended (complete, pruned or failed for good, resumed ones counted), so
    no more are asked than are left. The threads share one `train.WarmRanks`: a trial's procs
    go on to the next trial."""

    def __init__(
        self, study: Any, plan: _Plan, trials: int, progress: Callable[[Study], None] | None
    ) -> None:
        self._study = study
        self._plan = plan
        self._trials = trials
        self._progress = progress
        self._lock = threading.Lock()  # guards `_running` and Optuna's ask against `_left`
        self._running = 0
        self._warm = train.WarmRanks()

    def run(self) -> None:
        """Returns once every thread has found no trial left; an error a trial does not record
        (not a `TrainError`) is raised here, once the other threads have run out of trials."""
        with self._warm, ThreadPoolExecutor(self._plan.concurrent, "raymesh-trial") as pool:
            for f in [pool.submit(self._loop) for _ in range(self._plan.concurrent)]:
                f.result()

    def _loop(self) -> None:
        while self._one():
            pass

    def _left(self) -> int:
        import optuna

        finished = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
        ended = [
            t
            for t in self._study.get_trials(deepcopy=False)
            if t.state in finished or failed_for_good(t)
        ]
        return self._trials - len(ended)

    def _one(self) -> bool:
        """Runs one trial; False when none is left to ask for."""
        plan = self._plan
        with self._lock:
            if self._left() - self._running <= 0:
                return False
            self._running += 1
            trial = self._study.ask(plan.distributions)
        try:
            _trial(self._study, trial, plan, self._warm)
        finally:
            with self._lock:
                self._running -= 1
        if self._progress is not None:
            self._progress(collect(self._study, plan.metric, plan.mode, plan.folder))
        return True


def _requeue_running(study: Any) -> None:
    """Trials a dead controller left running: ended, and asked again with the same params."""
    import optuna

    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
        logger.info("raymesh.tune: trial %d was running when the study stopped: again", t.number)


def _packed(concurrent: int, config: train.TrainConfig) -> int:
    """`concurrent`, or fewer: as many trials as the cluster has room for at once (each
    `config.max_workers` procs of `config.cpus_per_worker` CPUs, and a GPU each if it uses
    them)."""
    from raymesh.actor import host_mesh

    free = host_mesh().free_procs(
        cpus_per_proc=config.cpus_per_worker, gpu=train.use_gpus(config.scaling)
    )
    procs = sum(free.values())
    room = procs // config.max_workers
    if room >= concurrent:
        return concurrent
    if room < 1:
        raise ValueError(
            f"concurrent={concurrent}: the cluster has room for {procs} procs of "
            f"{config.cpus_per_worker:g} CPUs, fewer than one trial's {config.max_workers}; "
            "lower workers or cpus_per_worker, or add nodes"
        )
    logger.warning(
        "raymesh.tune: concurrent=%d but the cluster has room for %d trials at once: running %d",
        concurrent,
        room,
        room,
    )
    return room


def _trial(study: Any, trial: Any, plan: _Plan, warm: train.WarmRanks) -> None:
    """Runs `trial` as a training job on `warm`'s procs and tells the study how it ended."""
    import optuna

    config, metric, folder = plan.config, plan.metric, plan.folder
    params = dict(trial.params) | dict(plan.constants)
    overrides: dict[str, Any] = {"params": dict(config.params) | params}
    if folder is not None:
        trial_dir = str(folder / "trials" / _slug(params))
        overrides["checkpoint"] = (
            dataclasses.replace(config.checkpoint, dir=trial_dir)
            if config.checkpoint is not None
            else train.CheckpointConfig(dir=trial_dir)
        )
        overrides["run_dir"] = trial_dir
        trial.set_user_attr("dir", trial_dir)
    cfg = dataclasses.replace(config, **overrides)

    def report(p: dict[str, Any]) -> None:
        if p[metric] is None:  # a failed chunk's loss: not every rank's figure is known
            return
        trial.report(float(p[metric]), int(p["step"]))
        trial.set_user_attr("step", int(p["step"]))
        if trial.should_prune():
            raise _Pruned(int(p["step"]))

    try:
        result = train.fit(plan.fn, cfg, progress=report, warm=warm)
    except _Pruned as stop:
        logger.info("raymesh.tune: trial %d pruned at step %d", trial.number, stop.args[0])
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    except (train.TrainError, train.TooManyFailures) as e:
        trial.set_user_attr("error", str(e).splitlines()[0][:500])
        logger.warning("raymesh.tune: trial %d failed: %s", trial.number, e)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    if result.checkpoint is not None:
        trial.set_user_attr("checkpoint", result.checkpoint)
    trial.set_user_attr("resumed_from", result.resumed_from)
    study.tell(trial, float(result.history[-1][metric]))
