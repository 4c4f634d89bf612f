"""Asynchronous saves (``ctx.save(..., blocking=False)``): at most one pending write per process, in a thread.

The caller copies the state to host memory first (`snapshot` for one file; torch's ``async_save`` staging for
sharded saves), then hands the write, ``fsync`` and rename to `submit`. The next save, the end of the decorated
function (return or exception) and a true ``ctx.should_stop`` call `wait` first, so nothing is lost when the
process group is torn down. The thread is not a daemon: a plain script's interpreter also waits for it at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from .. import tree
from ..errors import CheckpointError
from ..modules import unwrap_module
from . import format as fmt
from . import storage

__all__ = ["cpu_group", "pending", "save_file", "snapshot", "submit", "wait"]

_lock = threading.Lock()
_pending: tuple[threading.Thread, str, list[BaseException]] | None = None
_group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)


def pending() -> bool:
    """Whether a background save is still writing."""
    return _pending is not None and _pending[0].is_alive()


def wait(timeout: float | None = None) -> None:
    """Wait for the pending background save (if any) and raise its failure as a `CheckpointError`.

    Args:
        timeout: seconds to wait at most (``None``: until it ends); a write still running after it is left to
            finish on its own, and nothing is raised.
    """
    global _pending
    with _lock:
        job = _pending
        if job is None:
            return
        thread, what, errors = job
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the background save of {} is still running after {} s", what, timeout)
            return
        _pending = None
    if errors:
        raise CheckpointError(f"the background save of {what} failed: {type(errors[0]).__name__}: "
                              f"{errors[0]}") from errors[0]


def submit(what: str, write: Callable[[], Any]) -> None:
    """Run ``write`` in a background thread, after waiting for the previous one (whose failure is raised here)."""
    global _pending
    wait()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - handed to wait(), raised in the training thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=f"distfn-save {what}", daemon=False)
    with _lock:
        _pending = (thread, what, errors)
    thread.start()


def _is_object(value: Any) -> bool:
    return isinstance(value, nn.Module) or fmt.is_stateful(value)


def _state_of(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return unwrap_module(value).state_dict()
    return value.state_dict() if fmt.is_stateful(value) else value


def snapshot(obj: Any) -> Any:
    """``obj`` with every module and stateful object replaced by its state dict and every tensor copied to host
    memory (views of one memory, such as tied weights, stay one copy): what a background write may read while
    training goes on."""
    copies: dict[Any, torch.Tensor] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
               t.dtype) if t.numel() else id(t)
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        return copies[key]

    return tree.tree_map(copy, tree.tree_map(_state_of, obj, is_leaf=_is_object))


def cpu_group() -> Any:
    """A gloo process group for the collectives of background sharded saves (created once, on first use, by
    every rank): the training thread's collectives keep the default group to themselves."""
    global _group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:  # none yet, or made for a process group since destroyed
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def save_file(obj: Any, path: Any, *, save: Callable[..., Any], metadata: Any = None,
              keep: int | None = None) -> Any:
    """``save`` (`distfn.checkpoint.save`, passed in by the package, which imports this module) in the
    background: copies ``obj`` to host memory (`snapshot`), checks that it can be stored (errors are raised here,
    before returning), and writes it in a thread. Returns the path."""
    snap = snapshot(obj)
    fmt.plan(snap, metadata)  # every error about the content is raised now, in the caller
    target = storage.local_path(path).absolute()
    submit(str(target), lambda: save(snap, target, metadata=metadata, keep=keep))
    return target
