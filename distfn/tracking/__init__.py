"""Experiment tracking from rank 0, one run per job: ``@distributed(track="mlflow")`` and ``ctx.log_metrics``.

The modules, one job each (docs/tracking.md is the user's page):

* `base`: what a backend is (its settings, `Backend`; its open run, `Handle`), the run's `Status`;
* `spec`: ``track=`` checked at decoration (names, lists, objects; a missing extra is a `ConfigError`);
* `key`: the job key that makes restarts, requeues and resumed re-runs continue one run;
* `params`: the cfg flattened into parameters;
* `session`: rank 0's queue and tracking thread (batching, floors, failures, the run's end);
* `csv_backend`, `tensorboard_backend`, `mlflow_backend`, `wandb_backend`: the built-in backends (each imports
  its package only when its run opens, on rank 0).

Importing this package imports no tracking package (mlflow, wandb, tensorboard).
"""

from __future__ import annotations

from .base import Backend, Handle, OnError, Row, RunInfo, Status
from .csv_backend import CSV
from .key import KEY_ENV
from .mlflow_backend import MLflow
from .tensorboard_backend import TensorBoard
from .wandb_backend import WandB

__all__ = ["CSV", "KEY_ENV", "Backend", "Handle", "MLflow", "OnError", "Row", "RunInfo", "Status", "TensorBoard",
           "WandB"]
