"""``track="csv"``: metrics as rows of ``<root>/<job key>/metrics.csv``, needing no package at all.

The file is long-form (``step,name,value,time``): a row per value, so a metric that appears late needs no new
column and a continued run just appends. ``params.json`` holds the parameters and ``run.json`` the key and the
status. A continued run reads the last row back to learn its floor (the highest step already written).

Imports: `tracking.base`.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import attrs

from .base import Row, RunInfo, Settings, Status

HEADER = ("step", "name", "value", "time")


def _last_step(path: Path) -> int | None:
    """The step of the last complete row of ``path`` (reading its tail only), or ``None``."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        first = line.split(",", 1)[0]
        if first.isdigit():
            return int(first)
    return None


@attrs.frozen(kw_only=True)
class CSV(Settings):
    """Log to ``<root>/<job key>/metrics.csv`` (long form: step, name, value, time).

    Attributes:
        root: the directory holding one folder per run (relative to the working directory of rank 0).
    """

    root: str = attrs.field(default="runs", converter=os.fspath)
    name: ClassVar[str] = "csv"

    def check(self) -> None:
        """Nothing to check: the standard library is enough."""

    def open(self, run: RunInfo) -> CsvRun:
        """The run's folder, created, or continued after the rows it already holds."""
        return CsvRun(Path(self.root) / run.key, run)


class CsvRun:
    """An open CSV run (see `CSV`)."""

    def __init__(self, directory: Path, run: RunInfo) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / "metrics.csv"
        self.floor = _last_step(self.path)
        self.ids: Mapping[str, str] = {"dir": str(directory.resolve())}
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="")
        self._rows = csv.writer(self._file)
        if new:
            self._rows.writerow(HEADER)
        self._write_json("run.json", {"key": run.key, "name": run.name, "tags": dict(run.tags), "status": "RUNNING"})

    def _write_json(self, name: str, value: object) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
        tmp.replace(self.directory / name)

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """Append ``rows`` and flush (a killed job keeps what was written)."""
        stamp = f"{time.time():.3f}"  # one time for the batch: rows are written once per flush
        # One writerows over every value; csv writes a float as its repr(), as before (nan, inf included).
        self._rows.writerows((step, name, value, stamp) for step, values in rows for name, value in values.items())
        self._file.flush()

    def log_params(self, params: Mapping[str, str]) -> None:
        """Merge ``params`` into ``params.json``."""
        path = self.directory / "params.json"
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged.update(params)
        self._write_json("params.json", merged)

    def close(self, status: Status) -> None:
        """Close the file and record ``status`` in ``run.json``."""
        self._file.close()
        info = json.loads((self.directory / "run.json").read_text())
        self._write_json("run.json", {**info, "status": status})
