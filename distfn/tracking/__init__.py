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

import importlib
from typing import TYPE_CHECKING, Any

from .base import KEY_ENV, Backend, Handle, OnError, Row, RunInfo, Status

if TYPE_CHECKING:  # for type checkers and the API page's reader (griffe); at run time `__getattr__` loads them
    from .csv_backend import CSV
    from .mlflow_backend import MLflow
    from .tensorboard_backend import TensorBoard
    from .wandb_backend import WandB

__all__ = ["CSV", "KEY_ENV", "Backend", "Handle", "MLflow", "OnError", "Row", "RunInfo", "Status", "TensorBoard",
           "WandB"]

#: The backends' settings classes, imported on first use: decoration imports `tracking.base` (through
#: `options`), and the four backend modules cost about 15 ms of attrs class building there (measured with
#: ``python -X importtime``), which a call without ``track=`` never needs.
_LAZY = {"CSV": "csv_backend", "MLflow": "mlflow_backend", "TensorBoard": "tensorboard_backend",
         "WandB": "wandb_backend"}


def __getattr__(name: str) -> Any:
    """``distfn.tracking.MLflow`` and the other backends on first use (see `_LAZY`)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
