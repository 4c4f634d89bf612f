"""Checkpoints as one standard ``.safetensors`` file: streamed, atomic, pickle-free, full training state.

Everything here is a pure function of its arguments: no process group, no collective, no rank logic.
``Context.save`` calls `save` on rank 0 only and ``Context.load`` calls `load_into` on every rank.

``save(obj, path)`` accepts a module (bare, ``DistributedDataParallel``, ``DataParallel``, ``torch.compile``-d:
stored with the bare module's keys), a flat ``{name: tensor}`` mapping, or a **training state**: any mapping such
as ``{"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "step": 1200, "rng": RNG}`` whose
values are modules, optimizers, LR schedulers, ``GradScaler`` objects, anything else with
``state_dict()``/``load_state_dict()``, tensors, and plain JSON-like values, nested freely. The file layout, the
durability promise and the loading rules are specified in docs/checkpoints.md ("File format").

The package: `format` (object <-> header and JSON tree), `storage` (atomic writer, memory-mapped reader,
temporary files, pickle refusal), `files` (``keep=`` rotation, `latest`), `restore` (`load_into`). Random
generator states live in `distfn.rng` and module unwrapping in `distfn.modules`; both are re-exported here.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch
from loguru import logger

from ..errors import CheckpointError
from ..modules import unwrap_module
from ..rng import RNG, combine_rng_states, gather_rng_states, rng_state, rng_state_for_rank, set_rng_state
from . import background, sharded, storage
from . import format as fmt
from .files import latest, rotate, step_of, step_of_path
from .restore import load_into
from .sharded import consolidate

__all__ = [
    "RNG",
    "combine_rng_states",
    "consolidate",
    "gather_rng_states",
    "latest",
    "load",
    "load_into",
    "read_metadata",
    "rng_state",
    "rng_state_for_rank",
    "save",
    "save_in_background",
    "set_rng_state",
    "step_of_path",
    "unwrap_module",
]

PathLike = str | os.PathLike[str]


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
) -> pathlib.Path:
    """Write ``obj`` atomically and durably to ``path`` as one safetensors file.

    No collective and no rank logic in here: the caller decides who writes (``Context.save`` writes from rank
    0 only). Other ranks that must read the file afterwards should wait on ``ctx.barrier()``.

    Args:
        obj: a module (possibly wrapped), a ``{name: tensor}`` mapping, or a training-state mapping (see the
            package documentation for what values may hold).
        path: the target file. Missing parent directories are created.
        metadata: JSON-like values stored in the header (string values also readable by other tools).
        keep: with a step-numbered name such as ``ckpt-1200.safetensors``, keep only the ``keep`` newest files
            with the same prefix in that directory (by step number; the file just written is always kept).

    Returns:
        The path written, absolute.

    Raises:
        CheckpointError: a value that cannot be stored (the message names its key path; raised before anything
            is written), an invalid ``keep``, or an I/O failure (the target is then left untouched).
    """
    target = storage.local_path(path).absolute()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep= must be a positive int or None, got {keep!r}")
    if keep is not None and step_of(target.name) is None:
        raise CheckpointError(
            f"keep= needs a step-numbered file name such as 'ckpt-1200.safetensors', got '{target.name}'"
        )
    if target.is_dir():
        raise CheckpointError(f"cannot save to '{target}': it is a directory")
    plan = fmt.plan(obj, metadata)  # every error about the content is raised here, before touching the disk
    storage.write(plan, target)
    logger.debug("saved {} ({} tensors, {} bytes)", target, len(plan.entries), plan.total)
    if keep is not None:
        rotate(target, keep)
    return target



def save_in_background(obj: Any, path: PathLike, *, metadata: Mapping[str, Any] | None = None,
                       keep: int | None = None) -> pathlib.Path:
    """`save` with ``blocking=False``: returns once ``obj`` is copied to host memory and checked; the write,
    fsync and renames run in a background thread (`distfn.checkpoint.background`). The next save, the end of
    the function and a stop wait for it.

    Args:
        obj: what `save` takes.
        path: the file to write.
        metadata: string metadata for the file's header.
        keep: rotation as in `save`.

    Returns:
        The absolute path that will hold the checkpoint.
    """
    return background.save_file(obj, path, save=save, metadata=metadata, keep=keep)

def load(
    path: PathLike, device: str | torch.device = "cpu", *, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Read the tensors of a safetensors file into a plain ``{name: tensor}`` dict.

    Works outside any distributed run (e.g. for inference). Names are as stored: a module's bare keys, or the
    dotted key paths of a training state (``model.fc.weight``). Tied weights come back under all their names,
    as the same tensor. Files written by other tools load too.

    Args:
        path: a ``.safetensors`` file. Pickle files (``torch.save``) are refused with a conversion hint.
        device: where the tensors go.
        prefix: only the tensors under this key path, with it removed: ``load("ckpt-100.safetensors",
            prefix="model")`` is the model's state dict out of a training-state checkpoint.

    Returns:
        The tensors, in the file's header order. CPU tensors are copy-on-write views of a memory map of the
        file (read on first use): another tool must not rewrite the file *in place* while they are in use
        (distfn's own saves replace it by rename, which is safe); ``.clone()`` them to detach from the file.
    """
    if os.path.isdir(path):  # a sharded checkpoint directory: whole tensors
        return sharded.load(path, device, prefix=prefix)
    with storage.open_reader(path, device) as reader:
        names = reader.names()
        aliases = fmt.saved_aliases(reader.header)
        if prefix is not None:
            start = prefix.rstrip(".") + "."
            wanted = {n for n in [*names, *aliases] if n.startswith(start)}
            if not wanted:
                raise CheckpointError(f"'{path}' has no tensors under '{prefix}' (it holds "
                                      f"{fmt.describe(sorted({n.split('.')[0] for n in names}))})")
            names = [n for n in names if n in wanted or n in {aliases.get(w) for w in wanted}]
        stored = {name: reader.get(name) for name in names}
    out = dict(stored)
    for alias, target in aliases.items():
        if target not in stored:
            if prefix is None:
                raise CheckpointError(f"'{path}': the tied name '{alias}' refers to a missing tensor '{target}'")
            continue
        out[alias] = stored[target]
    if prefix is not None:
        out = {n[len(start):]: t for n, t in out.items() if n.startswith(start)}
    return out


def read_metadata(path: PathLike) -> dict[str, Any]:
    """The ``metadata=`` mapping saved with a checkpoint (or the raw string metadata of a foreign file).

    Args:
        path: a ``.safetensors`` file.

    Returns:
        The values passed as ``metadata=`` to `save`, decoded.
    """
    return fmt.saved_metadata(storage.read_header(storage.local_path(path)))
