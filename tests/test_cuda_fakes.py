"""CUDA paths checked on the CPU build with CUDA faked (issue 42): object collectives from another thread run on the
rank's GPU, a background save synchronises every GPU its copies came from, and no timing event is recorded while a
CUDA graph is being captured. The real-GPU counterparts are in tests/test_gpu.py and bench/gpu_check.sh."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distfn import collectives, timings
from distfn.checkpoint.background import HostBuffers


class _Devices:
    """A stand-in for ``torch.cuda.device``: records (device, thread name) on entry, and what ran inside."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any, str]] = []
        self.inside: Any = None

    def __call__(self, device: Any) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def entered() -> Iterator[None]:
            self.log.append(("enter", device, threading.current_thread().name))
            previous, self.inside = self.inside, device
            try:
                yield
            finally:
                self.inside = previous
                self.log.append(("exit", device, threading.current_thread().name))

        return entered()


def _in_thread(fn: Any) -> Any:
    box: list[Any] = []
    worker = threading.Thread(target=lambda: box.append(fn()), name="not-main")
    worker.start()
    worker.join(10)
    assert box, "the thread failed"
    return box[0]


# -- finding 5: object collectives ---------------------------------------------------------------------------------
def test_object_collectives_from_another_thread_run_on_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _Devices()
    monkeypatch.setattr(torch.cuda, "device", devices)
    world = type("World", (), {"bound_device_id": torch.device("cuda", 3)})()
    monkeypatch.setattr(dist.distributed_c10d._world, "_default_pg", world)  # what GroupMember.WORLD reads
    monkeypatch.setattr(collectives, "active", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    seen: list[tuple[str, Any]] = []

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        seen.append(("all_gather_object", devices.inside))
        out[0] = obj

    def broadcast_object_list(box: list[Any], src: int = 0, group: Any = None) -> None:
        seen.append(("broadcast_object_list", devices.inside))

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    assert _in_thread(lambda: (collectives.gather_object("x"), collectives.broadcast_object("y"))) == (["x"], "y")
    # both ran inside the rank's device, entered from the calling (non-main) thread
    assert seen == [("all_gather_object", torch.device("cuda", 3)), ("broadcast_object_list", torch.device("cuda", 3))]
    assert {(kind, thread) for kind, _, thread in devices.log} == {("enter", "not-main"), ("exit", "not-main")}
    # a group bound to no GPU (CPU runs): nothing is entered
    devices.log.clear()
    monkeypatch.setattr(world, "bound_device_id", None)
    assert collectives.gather_object(1) == [1] and not devices.log


# -- finding 4: background saves -----------------------------------------------------------------------------------
class _OnGpu:
    """A tensor that says it is on ``cuda:index`` (its values are a CPU tensor's)."""

    def __init__(self, values: torch.Tensor, index: int) -> None:
        self.values, self.device = values, torch.device("cuda", index)
        self.shape, self.dtype = values.shape, values.dtype

    def detach(self) -> torch.Tensor:
        return self.values


def test_a_background_copy_synchronises_every_gpu_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Any] = []
    devices = _Devices()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "device", devices)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))  # no pinning here
    buffers = HostBuffers()

    def save() -> list[torch.Tensor]:
        buffers.begin()
        copies = [buffers.copy(_OnGpu(torch.full((4,), float(i)), i % 2)) for i in range(3)]  # type: ignore[arg-type]
        buffers.copy(torch.ones(2))  # a CPU tensor: no device to wait for
        buffers.end()
        return copies

    copies = _in_thread(save)  # the current device of a thread that is not the main one is cuda:0
    assert [c.tolist() for c in copies] == [[float(i)] * 4 for i in range(3)]
    assert sorted(synced, key=str) == [torch.device("cuda", 0), torch.device("cuda", 1)]  # each GPU once
    # the pinned buffers were allocated under their source's device, not the thread's cuda:0
    assert [d for kind, d, _ in devices.log if kind == "enter"] == [torch.device("cuda", i % 2) for i in range(3)]
    synced.clear()
    buffers.begin()
    buffers.copy(torch.ones(2))
    buffers.end()
    assert synced == []  # a save of CPU tensors only synchronises nothing


# -- finding 7: CUDA graph capture ---------------------------------------------------------------------------------
class _Marks:
    """A clock counting its marks (host time underneath)."""

    def __init__(self) -> None:
        self.marks = 0
        self.host = timings.HostClock()

    def mark(self) -> Any:
        self.marks += 1
        return self.host.mark()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)


def test_no_timing_event_is_recorded_while_a_cuda_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Marks()
    run = timings.Timings(enabled=True, window=100)
    recorder = run.start(0, 1, None, clock)  # type: ignore[arg-type]
    timings._ModelHooks(recorder).install(model := nn.Linear(4, 1), bracket=True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    from distfn.run import Run

    class Ctx:
        def __init__(self) -> None:
            self.run = Run(timings=run)

        def all_reduce(self) -> int:
            with self.run.collective("all_reduce"):  # the one hook every ctx collective goes through
                return 1

    def step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        assert Ctx().all_reduce() == 1

    step()
    step()
    assert clock.marks == 0  # captured: no boundary, no backward bracket, no collective marks
    capturing[0] = False
    step()
    step()
    assert clock.marks >= 6  # the same steps outside a capture: two boundaries and two pairs per step at least


# -- finding 3: a collective queued on the GPU, under NCCL ----------------------------------------------------------
class _Event:
    """A CUDA event that the GPU passes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_queued_collective_the_gpu_has_not_finished_is_reported_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Under NCCL a CUDA tensor's ctx.all_reduce returns once queued: the ledger block closes at once, and the rank
    # waits later (loss.item()), outside distfn. The ledger keeps an event recorded as the call returned; the
    # responder reports when the GPU has not passed it after distfn's timeout (faked: entered 11 s ago, timeout 10).
    import time

    from distfn import hangs
    from distfn.ledger import Ledger
    from distfn.rankstore import Channel

    book = Ledger()
    events: list[_Event] = []

    def make() -> _Event:
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(hangs, "POLL_S", 0.05)
    monkeypatch.setattr(hangs, "_watch_gpu", lambda ledger: setattr(ledger, "gpu_event", make))
    reported: list[BaseException] = []
    responder = hangs.Responder.start(Channel.open(dist.HashStore(), 0, 1).child("hang"), timeout_s=10.0,
                                      ledger=book, report=reported.append, deadline=True)
    try:
        with book.entered("all_reduce"):
            pass  # the host call returns at once
        with book.entered("all_reduce"):
            pass
        assert len(events) == 2 and book.inside_since is None
        events[0].done = True  # the GPU finished the first one: dropped when the next call returns
        with book.entered("barrier"):
            pass
        assert [seq for _, _, seq in book._queued] == [2, 3]
        time.sleep(0.3)
        assert not reported  # queued 0.3 s ago, timeout 10 s
        book._queued[0] = (events[1], time.monotonic() - 11.0, 2)
        deadline = time.monotonic() + 5
        while not reported and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        responder.stop()
    assert reported, "the deadline watch did not report the collective still on the GPU"
    message = str(reported[0])
    assert isinstance(reported[0], TimeoutError) and "all_reduce #2 (test_cuda_fakes.py:" in message, message
    assert "did not finish on the GPU within the timeout of 10 s" in message and "about 75 s later" in message
    assert book.state(0).inside and book.gpu_event is None  # the report says it is in it; stopped: no more events
    # once the GPU has passed it, nothing is overdue
    events[1].done = True
    assert book.gpu_overdue(time.monotonic() + 100, 10.0, lambda e: e.query()) is None


def test_the_gpu_watch_never_raises_into_a_collective() -> None:
    from distfn.ledger import Ledger

    class Broken:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: the context was torn down")

    book = Ledger()
    book.gpu_event = Broken
    with book.entered("all_reduce"):
        pass
    with book.entered("all_reduce"):  # the first one's query raises: the watch ends, the collective does not fail
        pass
    assert book.gpu_event is None and not book._queued and book.seq == 2
    book.gpu_event = lambda: None  # no event (a CUDA graph being captured): nothing queued
    with book.entered("barrier"):
        pass
    assert not book._queued
