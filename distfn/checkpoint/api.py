"""The plain functions of the package, usable without a process group: `save`, `load`, `latest`, ...

No collective and no rank logic in here: the caller decides who writes (``Context.save`` writes one file from
rank 0 only, through `distfn.checkpointing`). Every path goes through `distfn.checkpoint.layout.resolve`
once, and what it names decides the reader: `load` and `latest` take a ``.safetensors`` file and a sharded
checkpoint directory alike.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from loguru import logger

from ..errors import CheckpointError
from . import format as fmt
from . import sharded, storage
from .background import DEFAULT
from .layout import SUFFIX, Location, check_keep, resolve, rotate, step_of
from .names import PICKLE_SUFFIXES

__all__ = ["latest", "latest_location", "load", "read_metadata", "save", "save_in_background", "verify"]

PathLike = str | os.PathLike[str]


@functools.cache
def _warn_suffix(suffix: str) -> None:
    """Once per suffix and process: a ``.pt`` name with safetensors content surprises every other tool."""
    logger.warning("distfn checkpoints are safetensors files whatever their name: a '{}' file written now holds "
                   "safetensors, not torch.save's pickle (torch.load will not read it; distfn.load and "
                   "safetensors will). Name it '*.safetensors' to say so.", suffix)


def check_file_target(target: Location) -> Location:
    """Refuse a single-file target that names a directory: ``"out/"``, an existing directory; warn once for a
    pickle-looking suffix. Returns ``target`` marked `Location.checked`, which `save` does not check again."""
    if target.checked:
        return target
    if target.names_directory:
        raise CheckpointError(f"cannot save one file to '{target.given}': the trailing '/' names a directory. Give "
                              f"the file's name (e.g. '{target.given.rstrip('/' + os.sep)}/model.safetensors'), or "
                              "write a sharded checkpoint directory (ctx.save(..., sharded=True))")
    if target.layout() in ("dir", "sharded"):
        raise CheckpointError(f"cannot save to '{target}': it is a directory")
    if target.path.suffix.lower() in PICKLE_SUFFIXES:
        _warn_suffix(target.path.suffix.lower())
    return attrs.evolve(target, checked=True)


def save(
    obj: Any,
    path: PathLike | Location,
    *,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> pathlib.PurePath:
    """Write ``obj`` atomically and durably to ``path`` as one safetensors file.

    No collective and no rank logic in here: the caller decides who writes (``Context.save`` writes from rank
    0 only). Other ranks that must read the file afterwards should wait on ``ctx.barrier()``.

    Args:
        obj: a module (possibly wrapped), a ``{name: tensor}`` mapping, or a training-state mapping (see the
            package documentation for what values may hold).
        path: the target file. Missing parent directories are created. A path ending in ``/`` names a
            directory and is refused (give the file's name).
        metadata: JSON-like values stored in the header (string values also readable by other tools).
        keep: with a step-numbered name such as ``ckpt-1200.safetensors``, keep only the ``keep`` newest files
            with the same prefix in that directory (by step number; the file just written is always kept).
        storage_options: for a URL (``s3://bucket/...``), the fsspec file system's options (``endpoint_url``,
            ``key``, ...) for this call (the returned path keeps them: pass it back to `load`); by default
            fsspec's own configuration.

    Returns:
        The path written, absolute (a `distfn.checkpoint.remote.RemotePath`, whose text is the URL, for a URL).

    Raises:
        CheckpointError: a value that cannot be stored (the message names its key path; raised before anything
            is written), an invalid ``keep``, a directory as the target or a file as a parent, or an I/O failure
            (the target is then left untouched).
    """
    target = resolve(path, storage_options)
    check_keep(keep, target, directory=False)
    target = check_file_target(target)
    plan = fmt.plan(obj, metadata)  # every error about the content is raised here, before touching the disk
    storage.write(plan, target)
    logger.debug("saved {} ({} tensors, {} bytes)", target, len(plan.entries), plan.total)
    if keep is not None:
        rotate(target, keep)
    return target.path


def save_in_background(obj: Any, path: PathLike | Location, *, metadata: Mapping[str, Any] | None = None,
                       keep: int | None = None,
                       storage_options: Mapping[str, Any] | None = None) -> pathlib.PurePath:
    """`save` with ``blocking=False``: returns once ``obj`` is copied to host memory and checked; the write,
    fsync and renames run in a background thread (`distfn.checkpoint.background`). The next background save
    waits for it, and so does the interpreter at exit: a failed write is then reported on stderr and the exit
    status is 1 (never lost).

    Args:
        obj: what `save` takes.
        path: the file to write.
        metadata: string metadata for the file's header.
        keep: rotation as in `save`.
        storage_options: for a URL, the fsspec file system's options (see `save`); the background write uses
            them, whatever other calls pass meanwhile.

    Returns:
        The absolute path that will hold the checkpoint.
    """
    target = resolve(path, storage_options)
    check_keep(keep, target, directory=False)
    target = check_file_target(target)
    return DEFAULT.save_file(obj, target, save=save, metadata=metadata, keep=keep).path


def load(
    path: PathLike | Location, device: str | torch.device = "cpu", *, prefix: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors of a checkpoint into a plain ``{name: tensor}`` dict.

    Works outside any distributed run (e.g. for inference). Names are as stored: a module's bare keys, or the
    dotted key paths of a training state (``model.fc.weight``). Tied weights come back under all their names,
    as the same tensor. Files written by other tools load too.

    Args:
        path: a ``.safetensors`` file, or a sharded checkpoint directory (whole tensors are assembled; the
            directory is checked whole first). Pickle files (``torch.save``) are refused with a conversion hint.
        device: where the tensors go.
        prefix: only the tensors under this key path, with it removed: ``load("ckpt-100.safetensors",
            prefix="model")`` is the model's state dict out of a training-state checkpoint.
        storage_options: for a URL, the fsspec file system's options (see `save`).

    Returns:
        The tensors, in the file's header order. CPU tensors are copy-on-write views of a memory map of the
        file (read on first use): another tool must not rewrite the file *in place* while they are in use
        (distfn's own saves replace it by rename, which is safe); ``.clone()`` them to detach from the file.
    """
    loc = resolve(path, storage_options)
    if loc.layout() in ("sharded", "dir"):  # a directory is read as a sharded checkpoint (or says why it is not)
        return sharded.load(loc, device, prefix=prefix)
    with storage.open_reader(loc, device) as reader:
        return fmt.select(loc, reader.names(), fmt.saved_aliases(reader.header), prefix, reader.get)


def read_metadata(path: PathLike | Location, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``metadata=`` mapping saved with a checkpoint (or the raw string metadata of a foreign file).

    Args:
        path: a ``.safetensors`` file or a sharded checkpoint directory.
        storage_options: for a URL, the fsspec file system's options (see `save`).

    Returns:
        The values passed as ``metadata=`` to `save`, decoded.
    """
    loc = resolve(path, storage_options)
    if loc.layout() == "sharded":
        checkpoint = sharded.open_checkpoint(loc)
        strings = {k: v for k, v in checkpoint.metadata.items() if isinstance(v, str)}
        return fmt.saved_metadata(fmt.Header(loc.path, 0, {}, strings))
    return fmt.saved_metadata(storage.read_header(loc))


def verify(loc: Location) -> None:
    """Check a checkpoint whole without reading its tensors (`latest` skips what fails).

    Raises:
        CheckpointError: a torn, truncated, incomplete or malformed file or directory, naming it.
    """
    if loc.layout() == "file":
        fmt.check(storage.read_header(loc))
    else:
        sharded.open_checkpoint(loc)


def latest(directory: PathLike | Location, prefix: str = "ckpt-", *,
           storage_options: Mapping[str, Any] | None = None) -> pathlib.PurePath | None:
    """The complete step-numbered checkpoint with the highest step in ``directory``.

    Args:
        directory: where to look; a missing directory gives ``None``.
        prefix: the name before the step number (``ckpt-`` matches ``ckpt-1200.safetensors`` and a sharded
            ``ckpt-1200`` directory, ``snapshot-`` matches ``snapshot-3.safetensors``).
        storage_options: for a URL, the fsspec file system's options (see `save`).

    Returns:
        The path of the newest complete checkpoint, or ``None`` when there is none. Files and directories that
        fail the checks of a load (torn, truncated or malformed copies, a shard missing) are skipped with one
        warning each; temporary files of distfn's own writers are never considered. ``.safetensors`` files with
        other names are not candidates: they are logged (a warning when nothing matched, so a resume that would
        start from scratch says why).
    """
    found = latest_location(resolve(directory, storage_options), prefix)
    return None if found is None else found.path


def latest_location(d: Location, prefix: str = "ckpt-") -> Location | None:
    """`latest` on a resolved directory, as a `Location` on the same file system (with its storage options).

    Raises:
        CheckpointError: the store itself is missing (an object store's bucket: a typo must not silently train
            from scratch), unreachable, or not the kind of server the URL says, naming the URL and the cause.
    """
    kind = d.fs.kind(d.path)
    if kind != "dir":
        if kind == "missing":
            try:
                d.fs.check_root(d.path)
            except OSError as exc:
                raise CheckpointError(f"latest('{d}'): {exc}") from exc
        return None
    candidates: list[tuple[int, str, Location]] = []
    others = []
    for name in d.fs.listdir(d.path):
        entry = d.child(name)
        as_file, as_dir = step_of(name), step_of(name, directory=True)
        if as_file is not None and as_file[0] == prefix and entry.layout() == "file":
            candidates.append((as_file[1], name, entry))
        elif as_dir is not None and as_dir[0] == prefix and entry.layout() in ("sharded", "dir"):
            candidates.append((as_dir[1], name, entry))  # a sharded checkpoint directory (checked below)
        elif name.endswith(SUFFIX) and not name.startswith("."):
            others.append(name)
    skipped = ", ".join(sorted(others)[:8]) + (" ..." if len(others) > 8 else "")
    for _, _, entry in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            verify(entry)
        except CheckpointError as exc:
            logger.warning("skipping incomplete checkpoint {}: {}", entry, exc)
            continue
        if others:
            logger.debug("latest('{}', prefix='{}'): skipped other names: {}", d, prefix, skipped)
        return entry
    if others:
        logger.warning("latest('{}', prefix='{}'): no complete '{}<step>.safetensors' there; skipped other names: {} "
                       "(pass prefix= to match them)", d, prefix, prefix, skipped)
    return None
