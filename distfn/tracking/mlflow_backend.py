"""``track="mlflow"``: one MLflow run per job, found again by its ``distfn.key`` tag (the ``distfn[mlflow]`` extra).

The run is looked up in its experiment by the job key before one is created, so every attempt of a job (and a
re-run that resumed its checkpoint) continues the same run: status back to RUNNING, floor = the highest step of
its metrics, parameters already there kept (a changed value is a warning, since MLflow parameters cannot
change). Metrics and parameters go in ``log_batch`` requests (one per flush, not one per value).

The tracking server comes from ``uri=``, else ``MLFLOW_TRACKING_URI``, else MLflow's default; the experiment
from ``experiment=``, else ``MLFLOW_EXPERIMENT_NAME``, else MLflow's ``Default``.

Imports: `tracking.base`.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import attrs
from loguru import logger

from ..errors import ConfigError
from .base import KEY_TAG, Row, RunInfo, Settings, Status, is_text, require

#: The most metrics / parameters MLflow takes in one ``log_batch``.
MAX_METRICS: Final = 1000
MAX_PARAMS: Final = 100

#: MLflow's rule for metric and parameter names (``mlflow.utils.validation``): letters, digits, ``_ - . / :``
#: and spaces, at most 250 characters, and a name that stays itself as a path (no ``..``, no leading ``/``).
#: One name it refuses makes it refuse the whole ``log_batch``, so such names are dropped here (one warning each).
MAX_NAME: Final = 250
_NAME = re.compile(r"[/\w.\- :]+")


def valid_name(name: str) -> bool:
    """Whether MLflow takes ``name`` as a metric or parameter name."""
    if len(name) > MAX_NAME or _NAME.fullmatch(name) is None:
        return False
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith(("..", "/"))


@attrs.frozen(kw_only=True)
class MLflow(Settings):
    """Log to an MLflow tracking server or store.

    Attributes:
        uri: the tracking URI (``http://host:5000``, ``sqlite:///mlflow.db``, a directory); ``None``:
            ``MLFLOW_TRACKING_URI`` or MLflow's default.
        experiment: the experiment's name (created when missing); ``None``: ``MLFLOW_EXPERIMENT_NAME`` or
            ``Default``.
    """

    uri: str | None = attrs.field(default=None, validator=is_text)
    experiment: str | None = attrs.field(default=None, validator=is_text)
    name: ClassVar[str] = "mlflow"

    def check(self) -> None:
        """The ``distfn[mlflow]`` extra must be installed."""
        require("mlflow", "mlflow", self.name)

    def open(self, run: RunInfo) -> MlflowRun:
        """The job's run in the experiment: found by its key tag, else created."""
        return MlflowRun(self, run)


class MlflowRun:
    """An open MLflow run (see `MLflow`)."""

    def __init__(self, settings: MLflow, run: RunInfo) -> None:
        # imported here: mlflow takes seconds to import and exists on rank 0 of a tracked job only
        from mlflow import MlflowClient

        try:
            self._client: Any = MlflowClient(tracking_uri=settings.uri)
        except Exception as exc:
            # (MLflow 3 refuses a plain directory or file: store unless MLFLOW_ALLOW_FILE_STORE=true)
            uri = settings.uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
            raise ConfigError(f"MLflow cannot use the tracking URI {uri!r} ({type(exc).__name__}: "
                              f"{str(exc)[:400]})") from exc
        self._refused: set[str] = set()
        experiment = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        runs = self._client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{run.key}'",
                                        max_results=1)
        self._params: dict[str, str] = {}
        self.floor: int | None = None
        if runs:
            self.run_id: str = runs[0].info.run_id
            self._params = dict(runs[0].data.params)
            self.floor = self._highest_step(runs[0].data.metrics)
            self._client.update_run(self.run_id, status="RUNNING")
            logger.info("mlflow: continuing run {} (job {}) after step {}", self.run_id, run.key, self.floor)
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=run.name, tags=dict(run.tags)).info.run_id
            logger.info("mlflow: run {} (job {}) in experiment {!r}", self.run_id, run.key, experiment)
        self.ids: Mapping[str, str] = {"run_id": self.run_id, "experiment_id": str(experiment_id)}

    def _highest_step(self, metrics: Mapping[str, float]) -> int | None:
        steps = [m.step for key in metrics for m in self._client.get_metric_history(self.run_id, key)]
        return max(steps) if steps else None

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """The rows as ``log_batch`` requests."""
        from mlflow.entities import Metric  # already imported by MlflowClient: a dictionary look-up

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for step, values in rows for name, value in values.items()
                   if self._takes(name, "metric")]
        for start in range(0, len(metrics), MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS])

    def log_params(self, params: Mapping[str, str]) -> None:
        """The parameters the run does not hold yet (a different value for one it holds is a warning: MLflow
        parameters are immutable)."""
        from mlflow.entities import Param

        changed = sorted(k for k, v in params.items() if k in self._params and self._params[k] != v)
        if changed:
            logger.warning("mlflow: run {} already has different values for {}; MLflow parameters cannot change, "
                           "the new values are not logged", self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in self._params and self._takes(k, "parameter")]
        for start in range(0, len(new), MAX_PARAMS):
            self._client.log_batch(self.run_id, params=new[start:start + MAX_PARAMS])
        self._params.update((p.key, p.value) for p in new)

    def _takes(self, name: str, kind: str) -> bool:
        """Whether ``name`` can be sent; a name MLflow refuses is dropped, with one warning."""
        if name in self._refused:
            return False
        if valid_name(name):
            return True
        self._refused.add(name)
        shown = repr(name) if len(name) <= 80 else repr(name[:77]) + "..."
        logger.warning("mlflow: the {} name {} is one MLflow refuses (letters, digits, '_', '-', '.', '/', ':' and "
                       "spaces, at most {} characters); it is not logged, the others are", kind, shown, MAX_NAME)
        return False

    def close(self, status: Status) -> None:
        """End the run with ``status``."""
        self._client.set_terminated(self.run_id, status=status)
