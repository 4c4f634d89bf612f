"""``track="tensorboard"``: scalars in ``<root>/<job key>/`` through torch's ``SummaryWriter`` (the
``distfn[tensorboard]`` extra, as ``ctx.writer``).

A continued run writes a new event file into the same directory (TensorBoard merges them); its floor is the
highest step in the event files already there, read once when the run opens.

Imports: `tracking.base`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs

from .base import Row, RunInfo, Settings, Status, require, root_setting, run_directory


def _records(path: Path) -> Iterator[bytes]:
    """The records of one event file (TFRecord framing: length, its CRC, data, its CRC), up to the first that
    does not check out: a killed write's tail, or a length the file cannot hold, which is never read (the
    file is read back from disk, so what it claims is checked before anything is allocated for it)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    size = path.stat().st_size
    with path.open("rb") as f:
        pos = 0
        while pos + 16 <= size:
            header = f.read(12)
            (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if masked_crc32c(header[:8]) != crc or length > size - pos - 16:
                return
            data, trailer = f.read(length), f.read(4)
            if len(trailer) < 4 or masked_crc32c(data) != struct.unpack("<I", trailer)[0]:
                return
            yield data
            pos += 16 + length


def _last_step(directory: Path) -> int | None:
    """The highest step of the event files in ``directory`` (not its subfolders), or ``None``."""
    # imported here: tensorboard's protobufs, wanted only on rank 0 and only when a run continues
    from tensorboard.compat.proto.event_pb2 import Event

    best: int | None = None
    for path in sorted(directory.glob("events.out.tfevents.*")):
        if not path.is_file():  # a FIFO would block the open for ever
            continue
        for data in _records(path):
            try:
                event = Event.FromString(data)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError: framed right but not an event, so the rest
                break  # of the file is not trusted either
            if event.HasField("summary") and (best is None or event.step > best):
                best = int(event.step)
    return best


@attrs.frozen(kw_only=True)
class TensorBoard(Settings):
    """Log scalars to ``<root>/<job key>/`` for ``tensorboard --logdir <root>``.

    Attributes:
        root: the directory holding one folder per run.
    """

    root: str = attrs.field(default="runs", converter=root_setting)
    name: ClassVar[str] = "tensorboard"

    def check(self) -> None:
        """The ``distfn[tensorboard]`` extra must be installed."""
        require("tensorboard", "tensorboard", self.name)

    def open(self, run: RunInfo) -> TensorBoardRun:
        """A writer on the run's directory (continuing its event files when there are some)."""
        return TensorBoardRun(run_directory(self.root, run.key), run)


class TensorBoardRun:
    """An open TensorBoard run (see `TensorBoard`)."""

    def __init__(self, directory: Path, run: RunInfo) -> None:
        # imported here: torch.utils.tensorboard imports tensorboard and its protobufs, for rank 0 only
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.floor = _last_step(directory)
        self.ids: Mapping[str, str] = {"dir": str(directory.resolve())}
        self._writer: Any = SummaryWriter(log_dir=str(directory))
        self._writer.add_text("distfn/tags", "\n".join(f"{k}: {v}" for k, v in sorted(run.tags.items())))

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """``add_scalar`` every value, then flush."""
        for step, values in rows:
            for name, value in values.items():
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def log_params(self, params: Mapping[str, str]) -> None:
        """The parameters as one markdown table under the ``params`` text tag."""
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self._writer.add_text("params", f"| parameter | value |\n|---|---|\n{rows}")

    def close(self, status: Status) -> None:
        """Record ``status`` (text tag ``distfn/status``) and close the writer."""
        self._writer.add_text("distfn/status", status)
        self._writer.close()
