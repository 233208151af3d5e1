"""A study's results: each trial as `TrialResult`, the whole as `Study` (what `tune.run`
returns), read back from Optuna's trials, and written out: results.csv, and the learning
curves and parameters as plots when matplotlib is installed.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Study", "TrialResult", "collect", "failed_for_good", "write"]

logger = logging.getLogger("raymesh")


@dataclass(frozen=True)
class TrialResult:
    """One trial: its parameters, how it ended, its last reported metric and where it saved."""

    number: int
    params: dict[str, Any]
    state: str  # "complete", "pruned", "failed" or "running"
    value: float | None  # the metric at its last report (None: none came)
    step: int  # the last step it reported
    checkpoint: str | None = None  # its newest committed checkpoint (with storage)
    error: str | None = None  # why it failed
    resumed_from: int = 0  # the step its job started from (a checkpoint of an earlier run)
    curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)  # (step, metric)


@dataclass
class Study:
    """What `run` returns: every trial, the best one, a table and the files it wrote."""

    metric: str
    mode: str
    trials: list[TrialResult]
    folder: Path | None  # results.csv and the plots (with storage)

    @property
    def best(self) -> TrialResult:
        done = [t for t in self.trials if t.state == "complete" and t.value is not None]
        if not done:
            raise ValueError("no trial completed: the study has no best trial")
        pick = min if self.mode == "min" else max
        return pick(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]

    def rows(self) -> list[dict[str, Any]]:
        """One plain row per trial: number, state, value, step, then each parameter."""
        return [
            {"number": t.number, "state": t.state, self.metric: t.value, "step": t.step}
            | {f"param_{k}": v for k, v in t.params.items()}
            | ({"error": t.error} if t.error else {})
            for t in self.trials
        ]

    def table(self) -> Any:
        """The rows as a pandas DataFrame when pandas is installed, else the list of rows."""
        try:
            import pandas
        except ImportError:
            return self.rows()
        return pandas.DataFrame(self.rows())


def failed_for_good(t: Any) -> bool:
    """A trial whose job failed (it has an error); a FAIL without one was left running by a
    dead controller and asked again (`study._requeue_running`)."""
    import optuna

    return t.state == optuna.trial.TrialState.FAIL and "error" in t.user_attrs


def collect(study: Any, metric: str, mode: str, folder: Path | None) -> Study:
    import optuna

    names = {
        optuna.trial.TrialState.COMPLETE: "complete",
        optuna.trial.TrialState.PRUNED: "pruned",
        optuna.trial.TrialState.FAIL: "failed",
        optuna.trial.TrialState.RUNNING: "running",
        optuna.trial.TrialState.WAITING: "waiting",
    }
    out = []
    for t in study.get_trials(deepcopy=False):
        if t.state == optuna.trial.TrialState.FAIL and not failed_for_good(t):
            continue  # left running by a dead controller: run again under a new number
        curve = tuple(sorted(t.intermediate_values.items()))
        value = t.value if t.value is not None else (curve[-1][1] if curve else None)
        out.append(
            TrialResult(
                number=t.number,
                params=dict(t.params),
                state=names.get(t.state, str(t.state)),
                value=value,
                step=int(t.user_attrs.get("step", curve[-1][0] if curve else 0)),
                checkpoint=t.user_attrs.get("checkpoint"),
                error=t.user_attrs.get("error"),
                resumed_from=int(t.user_attrs.get("resumed_from", 0)),
                curve=curve,
            )
        )
    return Study(metric=metric, mode=mode, trials=out, folder=folder)


def write(study: Study, folder: Path) -> None:
    """results.csv, and the plots when matplotlib is installed."""
    rows = study.rows()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with (folder / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("raymesh.tune: matplotlib is not installed: no plots")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in study.trials:
        if t.curve:
            steps, values = zip(*t.curve)
            ax.plot(steps, values, alpha=0.8, label=f"{t.number} ({t.state})")
    ax.set_xlabel("step")
    ax.set_ylabel(study.metric)
    ax.set_title("learning curves")
    if len(study.trials) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=100)
    plt.close(fig)
    _parallel_coordinates(study, folder, plt)


def _parallel_coordinates(study: Study, folder: Path, plt: Any) -> None:
    """Each finished trial as a line across its parameters (scaled to [0, 1]), by its metric."""
    done = [t for t in study.trials if t.value is not None and t.params]
    names = sorted({k for t in done for k in t.params})
    if not done or not names:
        return
    columns = []
    for name in names:
        raw = [t.params.get(name) for t in done]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw)
        labels = sorted(map(str, set(raw)))
        values = [float(v) if numeric else float(labels.index(str(v))) for v in raw]  # type: ignore[arg-type]
        low, high = min(values), max(values)
        columns.append([(v - low) / (high - low) if high > low else 0.5 for v in values])
    metric = [float(t.value) for t in done if t.value is not None]
    lo, hi = min(metric), max(metric)
    fig, ax = plt.subplots(figsize=(7, 4))
    cmap = plt.get_cmap("viridis")
    for i, value in enumerate(metric):
        shade = (value - lo) / (hi - lo) if hi > lo else 0.5
        ax.plot(range(len(names)), [c[i] for c in columns], color=cmap(shade), alpha=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("parameter (scaled)")
    ax.set_title(f"parameters by {study.metric} (dark: low)")
    fig.tight_layout()
    fig.savefig(folder / "parameters.png", dpi=100)
    plt.close(fig)
