"""Asynchronous saves (``ctx.save(..., blocking=False)``): at most one pending write per `Saves`, in a thread.

The caller copies the state to host memory first (`Saves.snapshot` for one file, `Saves.stage_file` for a
sharded save's own file, laid out as on disk), then hands the write, ``fsync`` and rename to `Saves.submit`. The
host copies go into buffers that are kept and reused by the next save of the same state (pinned memory when the
tensors are on a GPU, so the copy is a DMA): allocating and pinning fresh host memory on every save would cost
more than the copy itself.

Every ``Context`` holds one `Saves` (the worker bootstrap drains it: the end of the decorated function, return or
exception, waits for the pending write, and so do the next save and a true ``ctx.should_stop``), so nothing is
lost when the process group is torn down. Plain scripts (`distfn.checkpoint.save_in_background`, no Context) use
the process's `DEFAULT`: the interpreter waits for its write at exit, and a failed one is reported on stderr and
turns the exit status to 1 instead of being lost.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
import torch.distributed as dist
from loguru import logger

from .. import tree
from ..errors import CheckpointError
from . import format as fmt
from . import fs
from .layout import Location, resolve
from .objects import is_object, state_of

__all__ = ["DEFAULT", "HostBuffers", "Saves"]


#: The background writer's nice value, relative to the training thread (Linux: per thread).
_NICE: Final = 10


def _lower_priority() -> None:
    """Let the training thread win the CPU: the writer runs when training waits (collectives, data, the GPU).

    On a machine whose cores the training processes keep busy, every CPU cycle of the write (the copy into the
    page cache, the file system's work) is taken from training; at a lower priority the writer takes the idle
    moments first. An increment of the nice value the thread inherited from the one that started it (the
    training thread's), not an absolute value: under ``nice -n 15`` an absolute 10 would *raise* the writer above
    training. On Linux ``nice()`` changes the calling thread only; the kernel caps the value at 19.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.nice(_NICE)


class HostBuffers:
    """Host memory for the copies of asynchronous saves, kept from one save to the next and reused.

    A save takes its buffers with `copy` between `begin` and `end`; `end` frees whatever the previous save had and
    this one did not take again (a state whose shapes changed does not keep old memory alive). Buffers are pinned
    when the source tensor is on a GPU. Only one save stages at a time: `wait` for the previous write first.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._used: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._devices: set[torch.device] = set()  # the GPUs this save's copies were enqueued on
        self.allocated = 0  # bytes allocated (not reused) by the current or last save, for tests and benchmarks

    def begin(self) -> None:
        """Start staging a save: every buffer of the previous save becomes free for reuse (call `wait` first: the
        previous write may still be reading them)."""
        for key, bufs in self._used.items():
            self._free.setdefault(key, []).extend(bufs)
        self._used = {}
        self._devices = set()
        self.allocated = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (detached, contiguous) in a reused buffer of the same shape and dtype."""
        pinned = t.device.type == "cuda"
        key = (tuple(t.shape), t.dtype, pinned)
        free = self._free.get(key)
        if free:
            buf = free.pop()
        else:
            with torch.cuda.device(t.device) if pinned else contextlib.nullcontext():  # not cuda:0's context
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            self.allocated += buf.numel() * buf.element_size()
        self._used.setdefault(key, []).append(buf)
        self.copy_into(buf, t)
        return buf

    def copy_into(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        """Copy ``t`` into ``buf`` (host memory of ``t``'s shape and dtype, pinned when ``t`` is on a GPU)."""
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            # memmove is ~1.7x faster than a one-thread copy_ here (measured: 600 MiB in 60 ms vs 100 ms), and
            # this copy is all the time an asynchronous save blocks training
            ctypes.memmove(buf.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
        else:  # from a GPU into pinned memory, non_blocking: copies overlap; `end` synchronises each GPU once
            pinned = t.device.type == "cuda"
            buf.copy_(t.detach(), non_blocking=pinned)
            if pinned:
                self._devices.add(t.device)

    def image(self, nbytes: int, *, pinned: bool, device: torch.device | None = None) -> torch.Tensor:
        """A reused uint8 buffer of ``nbytes`` whose first byte is at a page boundary: one file's image (its
        header and tensors at their offsets), which a direct write can hand to the disk as it is
        (`distfn.checkpoint.fs.DIRECT_ALIGN`). Pinned when any tensor staged into it is on a GPU (``device``)."""
        align = fs.DIRECT_ALIGN
        key = ("image", pinned)
        free = self._free.get(key, [])
        # a buffer large enough and not more than twice as large: a state that shrank does not keep its old size
        fits = [b for b in free if nbytes + align <= b.numel() <= 2 * (nbytes + align)]
        if fits:
            raw = fits[0]
            free.remove(raw)
        else:
            with torch.cuda.device(device) if pinned else contextlib.nullcontext():
                raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pinned)
            self.allocated += raw.numel()
        self._used.setdefault(key, []).append(raw)
        start = -raw.data_ptr() % align
        return raw[start : start + nbytes]

    def end(self) -> None:
        """Finish staging: wait for the device copies, free the buffers this save did not reuse.

        Every GPU a copy came from is synchronised, not only the current one: a ``non_blocking`` copy of a tensor on
        ``cuda:k`` is enqueued on *k*'s stream, and ``torch.cuda.synchronize()`` waits for the current device only
        (torch/cuda/__init__.py:1209-1219), which in a thread other than the main one is cuda:0 (issue 42, finding
        4: state on another GPU of the rank, an EMA copy, a save from a user's thread)."""
        for device in self._devices:
            torch.cuda.synchronize(device)
        self._devices = set()
        self._free = {}



class Saves:
    """One pending background save at most, its host buffers, and the gloo group its collectives use.

    Args:
        report_at_exit: wait for the pending save when the interpreter exits and, when it failed, log the error
            and exit with status 1 (the process-wide `DEFAULT` of plain scripts; a distfn worker drains its
            context's instance itself).
    """

    def __init__(self, *, report_at_exit: bool = False) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[threading.Thread, str, list[BaseException]] | None = None
        self._group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)
        self._report_at_exit = report_at_exit
        self._exit_hook = False
        #: The host buffers of this writer's saves (one pending save at a time, so one set is enough).
        self.buffers = HostBuffers()
        #: CPU seconds (user + system) the writer thread spent on each finished background write, oldest first
        #: (the last 64): the CPU a background save takes from training, which benchmarks report.
        self.write_cpu_s: collections.deque[float] = collections.deque(maxlen=64)

    def pending(self) -> bool:
        """Whether a background save is still writing."""
        job = self._pending
        return job is not None and job[0].is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the pending background save (if any) and raise its failure as a `CheckpointError`.

        Args:
            timeout: seconds to wait at most (``None``: until it ends); a write still running after it is left to
                finish on its own, and nothing is raised.
        """
        with self._lock:
            job = self._pending
            if job is None:
                return
            thread, what, errors = job
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the background save of {} is still running after {} s", what, timeout)
                return
            self._pending = None
        if errors:
            raise CheckpointError(f"the background save of {what} failed: {type(errors[0]).__name__}: "
                                  f"{errors[0]}") from errors[0]

    def submit(self, what: str, write: Callable[[], Any]) -> None:
        """Run ``write`` in a background thread, after waiting for the previous one (whose failure is raised
        here)."""
        self.wait()
        errors: list[BaseException] = []
        # The writer blocks on `go` before its first line of work. `Thread.start` returns only once the new thread
        # has run, and a writer that went straight to work would hold the GIL for a switch interval (5 ms) or, at
        # its lower priority on busy cores, until the OS schedules it again: 16 ms per save was measured in
        # `start` alone, all of it blocking training. Parked on `go` it releases the GIL at once.
        go = threading.Event()

        def run() -> None:
            go.wait()
            _lower_priority()
            start = time.thread_time()
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - handed to wait(), raised in the training thread
                errors.append(exc)
            self.write_cpu_s.append(time.thread_time() - start)

        thread = threading.Thread(target=run, name=f"distfn-save {what}", daemon=False)
        with self._lock:
            self._pending = (thread, what, errors)
            if self._report_at_exit and not self._exit_hook:
                atexit.register(self._at_exit)
                self._exit_hook = True
        thread.start()
        go.set()

    def _at_exit(self) -> None:
        """At interpreter exit (the thread is not a daemon, so it has ended): a failure is not lost."""
        try:
            self.wait()
        except CheckpointError as exc:
            # stderr itself: outside a job distfn's logger is disabled (a library is quiet), but this must show
            if sys.stdout is not None:  # None: started with stdout / stderr closed (``>&- 2>&-``)
                sys.stdout.flush()
            if sys.stderr is not None:
                sys.stderr.write(f"distfn: {exc}\n")
                sys.stderr.flush()
            os._exit(1)  # atexit cannot change the exit status otherwise; the failed save is the news

    @contextlib.contextmanager
    def _staging(self) -> Iterator[dict[Any, torch.Tensor]]:
        """One save's copying into the reused `buffers`; yields the copies made so far (by `fmt.memory_key`)."""
        self.wait()  # the previous write may still read the buffers this copy reuses
        self.buffers.begin()
        try:
            yield {}
        finally:
            self.buffers.end()

    def _copy_once(self, t: torch.Tensor, copies: dict[Any, torch.Tensor]) -> torch.Tensor:
        key = fmt.memory_key(t)
        if key not in copies:
            copies[key] = self.buffers.copy(t)
        return copies[key]

    def stage_file(self, plan: fmt.Plan) -> memoryview:
        """The bytes of the file ``plan`` describes (header, then every tensor at its offset), copied once into a
        reused, page-aligned host buffer (`HostBuffers.image`), once the previous background save has finished
        with it: what the background write hands to the disk as it is (`storage.write_image`), with no copy per
        tensor, no per-tensor work and no page-cache copy left for the writer thread."""
        cuda = [e.tensor.device for e in plan.entries if e.tensor.device.type == "cuda"]
        with self._staging():
            image = self.buffers.image(plan.total, pinned=bool(cuda), device=cuda[0] if cuda else None)
            header = len(plan.header)
            ctypes.memmove(image.data_ptr(), plan.header, header)
            offset = header
            for e in plan.entries:
                if e.nbytes:
                    self.buffers.copy_into(image[offset : offset + e.nbytes].view(e.tensor.dtype).view(e.shape),
                                           e.tensor)
                offset += e.nbytes
        from . import storage  # deferred: a job that never saves does not load the writer (issue 32)

        return storage.memory_of(image)

    def snapshot(self, obj: Any) -> Any:
        """``obj`` with every module and stateful object replaced by its state dict and every tensor copied to
        host memory (views of one memory, such as tied weights, stay one copy; the copies go into the reused
        `buffers`): what a background write may read while training goes on."""
        states = tree.tree_map(state_of, obj, is_leaf=is_object)
        with self._staging() as copies:
            return tree.tree_map(lambda t: self._copy_once(t, copies) if isinstance(t, torch.Tensor) else t, states)

    def cpu_group(self) -> Any:
        """A gloo process group for the collectives of background sharded saves (created once, on first use, by
        every rank): the training thread's collectives keep the default group to themselves."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:  # none yet, or made for a group since destroyed
            self._group = (world, dist.new_group(backend="gloo"))
        return self._group[1]

    def save_file(self, obj: Any, path: str | os.PathLike[str] | Location, *, save: Callable[..., Any],
                  metadata: Any = None, keep: int | None = None) -> Location:
        """``save`` (the single-file writer, passed in by the caller, which imports this module) in the
        background: copies ``obj`` to host memory (`snapshot`), checks that it can be stored (errors are raised
        here, before returning), and writes it in a thread. Returns the location."""
        snap = self.snapshot(obj)
        fmt.plan(snap, metadata)  # every error about the content is raised now, in the caller
        target = resolve(path)
        self.submit(str(target), lambda: save(snap, target, metadata=metadata, keep=keep))
        return target


#: The writer of plain scripts (`distfn.checkpoint.save_in_background` outside a distfn run).
DEFAULT: Final = Saves(report_at_exit=True)
