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
from . import format as fmt
from . import sharded, storage

__all__ = ["latest", "rotate", "step_of", "step_of_path"]

_STEP_RE: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)\.safetensors$")


def step_of(name: str) -> tuple[str, int] | None:
    """``(prefix, step)`` of a step-numbered file name, or ``None`` (also for hidden files)."""
    m = _STEP_RE.match(name)
    if m is None or name.startswith("."):
        return None
    return m.group("prefix"), int(m.group("step"))


def step_of_path(path: str | os.PathLike[str]) -> int | None:
    """The step number in a checkpoint's name (``ckpt-1200.safetensors`` or a sharded ``ckpt-1200`` directory)."""
    name = pathlib.Path(os.fspath(path)).name
    parsed = step_of(name) or sharded.step_of_dir(name)
    return None if parsed is None else parsed[1]


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
        prefix: the name before the step number (``ckpt-`` matches ``ckpt-1200.safetensors``,
            ``snapshot-`` matches ``snapshot-3.safetensors``).

    Returns:
        The path of the newest complete file, or ``None`` when there is none. Files whose header or size is
        inconsistent (torn or malformed copies) are skipped with a warning; temporary files of distfn's own
        writers are never considered. ``.safetensors`` files with other names are not candidates: they are
        logged (a warning when nothing matched, so a resume that would start from scratch says why).
    """
    d = storage.local_path(directory)
    if not d.is_dir():
        return None
    candidates = []
    others = []
    for p in d.iterdir():
        s = step_of(p.name)
        if s is not None and s[0] == prefix and p.is_file():
            candidates.append((s[1], p))
        elif (ds := sharded.step_of_dir(p.name)) is not None and ds[0] == prefix and p.is_dir():
            candidates.append((ds[1], p))  # a sharded checkpoint directory (complete once its index is in)
        elif p.name.endswith(".safetensors") and not p.name.startswith("."):
            others.append(p.name)
    skipped = ", ".join(sorted(others)[:8]) + (" ..." if len(others) > 8 else "")
    for _, p in sorted(candidates, reverse=True):
        try:
            sharded.read_index(p) if p.is_dir() else fmt.check(storage.read_header(p))
        except CheckpointError as exc:
            logger.warning("skipping incomplete checkpoint {}: {}", p, exc)
            continue
        if others:
            logger.debug("latest('{}', prefix='{}'): skipped other names: {}", d, prefix, skipped)
        return p
    if others:
        logger.warning("latest('{}', prefix='{}'): no complete '{}<step>.safetensors' there; skipped other names: {} "
                       "(pass prefix= to match them)", d, prefix, prefix, skipped)
    return None
