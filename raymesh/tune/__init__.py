"""raymesh.tune: hyperparameter search whose trials are whole raymesh.train jobs.

    from raymesh import train, tune

    study = tune.run(
        build,  # build(ctx) reads ctx.params["lr"], ...
        train.TrainConfig(workers=2, steps=200, global_batch_size=64),
        space={"lr": tune.loguniform(1e-4, 1e-1), "width": tune.choice([64, 128, 256])},
        trials=32, concurrent=4, metric="loss", mode="min", scheduler="asha",
        storage="runs/study.db",
    )
    study.best.params, study.best.checkpoint, study.table()

Optuna samples and prunes (`pip install 'raymesh[tune]'`); see `raymesh.tune.study`.
"""

from raymesh.tune.jobfile import load_study
from raymesh.tune.results import Study, TrialResult
from raymesh.tune.space import Domain, choice, loguniform, randint, uniform
from raymesh.tune.study import METRICS, run

__all__ = [
    "METRICS",
    "Domain",
    "Study",
    "TrialResult",
    "choice",
    "load_study",
    "loguniform",
    "randint",
    "run",
    "uniform",
]
