"""Step-numbered checkpoint files: ``keep=`` rotation and `latest`.

A step-numbered name is ``<prefix><step>.safetensors`` (``ckpt-1200.safetensors``); hidden files (temporary
files of writers) never count.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
from typing import Final

from loguru import logger

from ..errors import CheckpointError
from . import storage

__all__ = ["latest", "rotate", "step_of"]

_STEP_RE: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)\.safetensors$")


def step_of(name: str) -> tuple[str, int] | None:
    """``(prefix, step)`` of a step-numbered file name, or ``None`` (also for hidden files)."""
    m = _STEP_RE.match(name)
    if m is None or name.startswith("."):
        return None
    return m.group("prefix"), int(m.group("step"))


def rotate(target: pathlib.Path, keep: int) -> None:
    """Keep ``target`` and the ``keep - 1`` newest other files with its prefix in its directory; delete the rest."""
    parsed = step_of(target.name)
    if parsed is None:
        raise CheckpointError(f"keep= needs a step-numbered file name such as 'ckpt-1200.safetensors', "
                              f"got '{target.name}'")
    prefix = parsed[0]
    found = []
    for p in target.parent.iterdir():
        s = step_of(p.name)
        if s is not None and s[0] == prefix and p.is_file():
            found.append((s[1], p.name, p))
    found.sort(reverse=True)
    kept = 0
    for _, _, p in found:
        if p == target or kept < keep - 1:
            kept += p != target
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            logger.debug("keep={}: removed {}", keep, p)


def latest(directory: str | os.PathLike[str], prefix: str = "ckpt-") -> pathlib.Path | None:
    """The complete step-numbered checkpoint with the highest step in ``directory``.

    Args:
        directory: where to look; a missing directory gives ``None``.
        prefix: the name before the step number (``ckpt-`` matches ``ckpt-1200.safetensors``).

    Returns:
        The path of the newest complete file, or ``None`` when there is none. Files whose header or size is
        inconsistent (e.g. torn copies made by other tools) are skipped with a warning; temporary files of
        distfn's own writers are never considered.
    """
    d = pathlib.Path(os.fspath(directory)).expanduser()
    if not d.is_dir():
        return None
    candidates = []
    for p in d.iterdir():
        s = step_of(p.name)
        if s is not None and s[0] == prefix and p.is_file():
            candidates.append((s[1], p))
    for _, p in sorted(candidates, reverse=True):
        try:
            storage.read_header(p)
        except CheckpointError as exc:
            logger.warning("skipping incomplete checkpoint {}: {}", p, exc)
            continue
        return p
    return None
