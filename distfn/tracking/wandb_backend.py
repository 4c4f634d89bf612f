"""``track="wandb"``: one Weights & Biases run per job, its id derived from the job key (the ``distfn[wandb]``
extra).

``wandb.init(id=<key>, resume="allow")``: the first attempt creates the run, every later attempt of the job
(restart, requeue, a re-run that resumed its checkpoint) continues it. ``WANDB_MODE=offline`` works as usual
(``wandb sync`` later). The run's status: ``finish(exit_code=0)`` for FINISHED, 1 otherwise, and
``distfn_status`` in its summary.

Imports: `tracking.base`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from .base import Row, RunInfo, Settings, Status, dir_setting, is_text, require


@attrs.frozen(kw_only=True)
class WandB(Settings):
    """Log to Weights & Biases.

    Attributes:
        project: the project; ``None``: ``WANDB_PROJECT`` or ``distfn``.
        entity: the team or user; ``None``: W&B's default.
        dir: where W&B writes its local files; ``None``: ``WANDB_DIR`` or the working directory.
        run_name: the run's display name in the W&B UI (nanoGPT's ``wandb_run_name``); ``None``: the job key.
            It only labels the run: every attempt of the job still continues the one run whose id is the key.
            (``run_name``, not ``name``: a backend's ``name`` is ``"wandb"``, the name ``track=`` knows it by.)
    """

    project: str | None = attrs.field(default=None, validator=is_text)
    entity: str | None = attrs.field(default=None, validator=is_text)
    dir: str | None = attrs.field(default=None, converter=dir_setting)
    run_name: str | None = attrs.field(default=None, validator=is_text)
    name: ClassVar[str] = "wandb"

    def check(self) -> None:
        """The ``distfn[wandb]`` extra must be installed."""
        require("wandb", "wandb", self.name)

    def open(self, run: RunInfo) -> WandbRun:
        """``wandb.init`` with the key as the run id (``resume="allow"``)."""
        return WandbRun(self, run)


class WandbRun:
    """An open W&B run (see `WandB`)."""

    def __init__(self, settings: WandB, run: RunInfo) -> None:
        # imported here: wandb takes seconds to import and starts a service process, on rank 0 only
        import wandb

        self._run: Any = wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or "distfn", entity=settings.entity,
            dir=settings.dir, id=run.key, name=settings.run_name or run.name, resume="allow",
            tags=[f"{k}:{v}" for k, v in sorted(run.tags.items()) if k != "distfn.key"],
            config={"distfn": dict(run.tags)},
            settings=wandb.Settings(console="off", x_disable_stats=True))
        # a resumed online run knows its last step; offline (or new) it does not, and the session's floor
        # (from the checkpoint record) applies
        resumed = bool(getattr(self._run, "resumed", False)) and self._run.step > 0
        self.floor: int | None = self._run.step - 1 if resumed else None
        self.ids: Mapping[str, str] = {"id": str(self._run.id), "project": str(self._run.project)}

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """``run.log`` each row at its step."""
        for step, values in rows:
            self._run.log(values, step=step)

    def log_params(self, params: Mapping[str, str]) -> None:
        """The parameters into the run's config."""
        self._run.config.update(dict(params), allow_val_change=True)

    def close(self, status: Status) -> None:
        """``finish`` with exit code 0 (FINISHED) or 1, the status in the summary."""
        self._run.summary["distfn_status"] = status
        self._run.finish(exit_code=0 if status == "FINISHED" else 1)
