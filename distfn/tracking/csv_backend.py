"""``track="csv"``: metrics as rows of ``<root>/<job key>/metrics.csv``, needing no package at all.

The file is long-form (``step,name,value,time``): a row per value, so a metric that appears late needs no new
column and a continued run just appends. ``params.json`` holds the parameters and ``run.json`` the key and the
status. A continued run reads the last row back to learn its floor (the highest step already written, `scan`),
and cuts off a row that a killed write left half-written.

Imports: `tracking.base`.
"""

from __future__ import annotations

import csv
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, ClassVar, Final

import attrs
from loguru import logger

from ..errors import ConfigError
from .base import Row, RunInfo, Settings, Status, root_setting, run_directory

HEADER = ("step", "name", "value", "time")


#: Bytes read at the end of ``metrics.csv`` to find its last row (more, four times as much each round, when a
#: long quoted name leaves no whole row in them).
TAIL: Final = 64 * 1024
_CHUNK: Final = 1 << 20
_STEP = re.compile(rb"[0-9]{1,19}")


def _quotes_before(f: BinaryIO, end: int) -> int:
    """How many ``"`` the file holds before byte ``end``: its parity says whether ``end`` is inside a quoted
    field (csv doubles a quote inside one, which changes nothing to the parity)."""
    f.seek(0)
    count, left = 0, end
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            break
        count += chunk.count(b'"')
        left -= len(chunk)
    return count


def _row_ends(data: bytes, inside: bool) -> list[int]:
    """The offsets just after each newline of ``data`` that ends a row (outside quotes; ``inside``: ``data``
    starts inside a quoted field)."""
    ends: list[int] = []
    offset = 0
    for i, part in enumerate(data.split(b'"')):
        if (i % 2 == 1) == inside:  # outside quotes
            at = part.find(b"\n")
            while at >= 0:
                ends.append(offset + at + 1)
                at = part.find(b"\n", at + 1)
        offset += len(part) + 1
    return ends


def _step_of(record: bytes) -> int | None:
    """The step of one whole row (``step,name,value,time``), or ``None`` for the header or a row that is not one."""
    first = record.split(b",", 1)[0]
    if _STEP.fullmatch(first) is None or int(first) >= 2**63:
        return None
    try:
        fields = next(csv.reader([record.decode("utf-8", "replace").rstrip("\r\n")]), [])
    except csv.Error:  # a name longer than csv's field limit: the step (never quoted) is enough
        return int(first)
    if len(fields) != 4:
        return None
    try:
        float(fields[2])
    except ValueError:
        return None
    return int(first)


def scan(path: Path) -> tuple[int | None, int]:
    """``(floor, end)`` of a ``metrics.csv``: the step of its last whole row (``None``: none), and the offset
    just after that row's end (what follows is a row cut short by a killed write).

    Rows are found by the csv rules, not by lines: a quoted name may hold newlines, commas and quotes, and be of
    any length. Whether the tail starts inside quotes is told by counting the quotes before it (one pass over the
    file, at memory speed); only the tail is parsed, from its last row backwards.
    """
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        span = TAIL
        while True:
            start = max(0, size - span)
            inside = _quotes_before(f, start) % 2 == 1
            f.seek(start)
            data = f.read(size - start)
            ends = _row_ends(data, inside)
            if start == 0:
                ends.insert(0, 0)  # the file's start begins a row
            for first, last in zip(reversed(ends[:-1]), reversed(ends[1:]), strict=True):
                step = _step_of(data[first:last])
                if step is not None:
                    return step, start + ends[-1]
            if start == 0:
                return None, ends[-1]
            span *= 4


@attrs.frozen(kw_only=True)
class CSV(Settings):
    """Log to ``<root>/<job key>/metrics.csv`` (long form: step, name, value, time).

    Attributes:
        root: the directory holding one folder per run (relative to the working directory of rank 0).
    """

    root: str = attrs.field(default="runs", converter=root_setting)
    name: ClassVar[str] = "csv"

    def check(self) -> None:
        """Nothing to check: the standard library is enough."""

    def open(self, run: RunInfo) -> CsvRun:
        """The run's folder, created, or continued after the rows it already holds."""
        return CsvRun(run_directory(self.root, run.key), run)


class CsvRun:
    """An open CSV run (see `CSV`)."""

    def __init__(self, directory: Path, run: RunInfo) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / "metrics.csv"
        self.floor: int | None = None
        if self.path.exists() and not self.path.is_file():  # a FIFO or a device: never opened
            raise ConfigError(f"{self.path} is not a regular file; the CSV backend writes nothing there")
        if self.path.exists():
            self.floor, end = scan(self.path)
            cut = self.path.stat().st_size - end
            if cut:  # a killed write's half row: appended to, it would swallow the next row (or every row)
                logger.warning("csv: {} ended with a row cut short ({} bytes, a killed write); removed", self.path,
                               cut)
                os.truncate(self.path, end)
        self.ids: Mapping[str, str] = {"dir": str(directory.resolve())}
        new = not self.path.exists() or self.path.stat().st_size == 0
        # UTF-8 whatever the locale; a name that is no text (a lone surrogate) is written escaped, not refused
        self._file = self.path.open("a", newline="", encoding="utf-8", errors="backslashreplace")
        self._rows = csv.writer(self._file)
        if new:
            self._rows.writerow(HEADER)
            self._file.flush()
        # what run.json holds, kept here: close rewrites it without reading back a file that may be damaged
        self._info = {"key": run.key, "name": run.name, "tags": dict(run.tags)}
        self._write_json("run.json", {**self._info, "status": "RUNNING"})
        self._params = _read_params(directory / "params.json")

    def _write_json(self, name: str, value: object) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.unlink(missing_ok=True)  # a leftover (or a planted symlink) is replaced, never written through
        with tmp.open("x", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=1, sort_keys=True))
        tmp.replace(self.directory / name)

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """Append ``rows`` and flush (a killed job keeps what was written)."""
        stamp = f"{time.time():.3f}"  # one time for the batch: rows are written once per flush
        # One writerows over every value; csv writes a float as its repr(), as before (nan, inf included).
        self._rows.writerows((step, name, value, stamp) for step, values in rows for name, value in values.items())
        self._file.flush()

    def log_params(self, params: Mapping[str, str]) -> None:
        """Merge ``params`` into ``params.json``."""
        self._params.update(params)
        self._write_json("params.json", self._params)

    def close(self, status: Status) -> None:
        """Close the file and record ``status`` in ``run.json``."""
        self._file.close()
        self._write_json("run.json", {**self._info, "status": status})


#: The largest ``params.json`` read back (parameters are short texts; a bigger file is not one of ours).
MAX_PARAMS_FILE: Final = 16 << 20


def _read_params(path: Path) -> dict[str, str]:
    """The parameters an earlier attempt wrote to ``params.json``, to merge into; a file that is not such a
    mapping (damaged, nested too deep, too big, not a regular file) is replaced, with one warning."""
    if not path.exists():
        return {}
    try:
        if not path.is_file() or path.stat().st_size > MAX_PARAMS_FILE:
            raise ValueError(f"not a regular file of at most {MAX_PARAMS_FILE >> 20} MiB")
        value = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError("not a mapping of names to texts")
        return value
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        logger.warning("csv: {} cannot be read back ({}: {}); the parameters logged now replace it", path,
                       type(exc).__name__, exc)
        return {}
