"""Asynchronous saves (``ctx.save(..., blocking=False)``): at most one pending write per process, in a thread.

The caller copies the state to host memory first (`snapshot` for one file, `stage` for a sharded save's own
pieces), then hands the write, ``fsync`` and rename to `submit`. The host copies go into buffers that are kept
and reused by the next save of the same state (pinned memory when the tensors are on a GPU, so the copy is a
DMA): allocating and pinning fresh host memory on every save would cost more than the copy itself.

The next save, the end of the decorated function (return or exception) and a true ``ctx.should_stop`` call `wait`
first, so nothing is lost when the process group is torn down. The thread is not a daemon: a plain script's
interpreter also waits for it at exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from .. import tree
from ..errors import CheckpointError
from ..modules import unwrap_module
from . import format as fmt
from . import storage

__all__ = ["HostBuffers", "buffers", "cpu_group", "pending", "save_file", "snapshot", "stage", "submit", "wait"]

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


#: The background writer's nice value, relative to the training thread (Linux: per thread).
_NICE: Final = 10


def _lower_priority() -> None:
    """Let the training thread win the CPU: the writer runs when training waits (collectives, data, the GPU).

    On a machine whose cores the training processes keep busy, every CPU cycle of the write (the copy into the
    page cache, the file system's work) is taken from training; at a lower priority the writer takes the idle
    moments first. On Linux ``setpriority`` with a thread id changes that thread only.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


def submit(what: str, write: Callable[[], Any]) -> None:
    """Run ``write`` in a background thread, after waiting for the previous one (whose failure is raised here)."""
    global _pending
    wait()
    errors: list[BaseException] = []

    def run() -> None:
        _lower_priority()
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


class HostBuffers:
    """Host memory for the copies of asynchronous saves, kept from one save to the next and reused.

    A save takes its buffers with `copy` between `begin` and `end`; `end` frees whatever the previous save had and
    this one did not take again (a state whose shapes changed does not keep old memory alive). Buffers are pinned
    when the source tensor is on a GPU. Only one save stages at a time: `wait` for the previous write first.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._used: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._cuda = False
        self.allocated = 0  # bytes allocated (not reused) by the current or last save, for tests and benchmarks

    def begin(self) -> None:
        """Start staging a save: every buffer of the previous save becomes free for reuse (call `wait` first: the
        previous write may still be reading them)."""
        for key, bufs in self._used.items():
            self._free.setdefault(key, []).extend(bufs)
        self._used = {}
        self._cuda = False
        self.allocated = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (detached, contiguous) in a reused buffer of the same shape and dtype."""
        pinned = t.device.type == "cuda"
        key = (tuple(t.shape), t.dtype, pinned)
        free = self._free.get(key)
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            self.allocated += buf.numel() * buf.element_size()
        self._used.setdefault(key, []).append(buf)
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            # memmove is ~1.7x faster than a one-thread copy_ here (measured: 600 MiB in 60 ms vs 100 ms), and
            # this copy is all the time an asynchronous save blocks training
            ctypes.memmove(buf.data_ptr(), t.data_ptr(), buf.numel() * buf.element_size())
        else:  # from a GPU into pinned memory, non_blocking: copies overlap; `end` synchronises once
            buf.copy_(t.detach(), non_blocking=pinned)
        self._cuda = self._cuda or pinned
        return buf

    def end(self) -> None:
        """Finish staging: wait for the device copies, free the buffers this save did not reuse."""
        if self._cuda:
            torch.cuda.synchronize()
        self._free = {}


#: The process's buffers (one pending save at a time, so one set is enough).
buffers = HostBuffers()


@contextlib.contextmanager
def _staging() -> Iterator[dict[Any, torch.Tensor]]:
    """One save's copying into the reused `buffers`; yields the copies made so far (by `fmt.memory_key`)."""
    wait()  # the previous write may still read the buffers this copy reuses
    buffers.begin()
    try:
        yield {}
    finally:
        buffers.end()


def stage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (views of one memory stay one copy) in the reused `buffers`, once the previous
    background save has finished with them."""
    with _staging() as copies:
        return {name: _copy_once(t, copies) for name, t in tensors.items()}


def _copy_once(t: torch.Tensor, copies: dict[Any, torch.Tensor]) -> torch.Tensor:
    key = fmt.memory_key(t)
    if key not in copies:
        copies[key] = buffers.copy(t)
    return copies[key]


def snapshot(obj: Any) -> Any:
    """``obj`` with every module and stateful object replaced by its state dict and every tensor copied to host
    memory (views of one memory, such as tied weights, stay one copy; the copies go into the reused `buffers`):
    what a background write may read while training goes on."""
    states = tree.tree_map(_state_of, obj, is_leaf=_is_object)
    with _staging() as copies:
        return tree.tree_map(lambda t: _copy_once(t, copies) if isinstance(t, torch.Tensor) else t, states)


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
