"""Where each rank's step time goes: data wait, compute and communication, always on (``ctx.timings()``).

What is measured, per step and per rank (a step runs from one training forward of the model ``ctx.wrap``
returned to the next; under ``ctx.accumulate`` from the forward that opens one window to the next: one optimizer
step, however many micro-batches):

* **data**: the time spent inside the ``next()`` of ``ctx.dataloader``'s iterator (host time: what the input
  pipeline made this rank wait). A hand-built ``DataLoader`` is not seen; its wait counts as compute.
* **comm**: the time blocked at the end of backward until DDP's gradient all-reduce is done. Two autograd
  engine callbacks bracket DDP's own end-of-backward callback (queued from a pre-hook on the output's autograd
  node, so they run just before and just after it), which is where DDP waits for its buckets: no comm hook, so
  the user's own ``register_comm_hook`` still works. The rank that arrives last at the all-reduce waits least.
  The time inside ``ctx`` collectives (``ctx.all_reduce``, ``ctx.barrier``, ...: `distfn.run.Run.collective`)
  counts too.
* **compute**: the rest of the step (forward, backward, optimizer, the user's code).

On CUDA the step and comm boundaries are CUDA events recorded on the current stream and read lazily: a step's
numbers are taken once its end event has completed (``Event.query()``), never with a device synchronise
inside the loop; only the end-of-run summary waits for the last events.

How the numbers reach rank 0 without a collective per step: every `WINDOW` steps (``DISTFN_TIMINGS_WINDOW``)
each rank writes its window's row (a few hundred bytes of JSON) to the process group's store, one
``store.set`` per window; rank 0 reads a window once every rank has written it (``store.check`` then one
``multi_get``, never a blocking ``get``), so no rank ever waits for another here. The keys are a ring of `SLOTS`
per rank, overwritten, so the store does not grow with the run. Measured in ``bench/bench_timings.py``.

Rank 0 then applies `distfn.stragglers.find_straggler` to each window and warns once about a persistent
straggler (through ``ctx.progress`` when a loop runs under it, else as a log line). When the run ends normally,
every rank sends its whole-run totals and rank 0 logs one summary table. ``DISTFN_TIMINGS=0`` switches it all
off (the hooks are not even installed).

Imports: `distfn.stragglers` (the table and the rule), `distfn.rankstore` (the run's channel). Imported by `distfn.run`
(the run holds one `Timings`); ``ctx.wrap`` and ``ctx.dataloader`` hand it their model and batches.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

import attrs
import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from . import stragglers
from .errors import ConfigError
from .rankstore import Channel, default_store
from .stragglers import Detector, RankTimes, TimingTable
from .tree import tree_leaves

if TYPE_CHECKING:
    from pathlib import Path

    from .timings_plot import History

#: Steps per window (what ``ctx.timings()`` covers and how often ranks write to the store).
WINDOW: Final = 50
#: Store slots per rank: window ``k`` is written to slot ``k % SLOTS`` (rank 0 reads within a window or two).
SLOTS: Final = 4
#: Seconds rank 0 waits, at the end of a run, for the other ranks' totals.
FINAL_WAIT_S: Final = 10.0
ENV_SWITCH: Final = "DISTFN_TIMINGS"
ENV_WINDOW: Final = "DISTFN_TIMINGS_WINDOW"

Sample = tuple[float, float, float, float]  # (data, compute, comm, step) seconds of one step


def enabled_by_env(env: Any = None) -> bool:
    """False when ``DISTFN_TIMINGS`` is ``0``/``false``/``off``/``no``."""
    value = (os.environ if env is None else env).get(ENV_SWITCH, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def window_from_env(env: Any = None) -> int:
    """``DISTFN_TIMINGS_WINDOW`` (steps per window), else `WINDOW`; a `ConfigError` naming it for a bad value."""
    raw = (os.environ if env is None else env).get(ENV_WINDOW, "").strip()
    if not raw:
        return WINDOW
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{ENV_WINDOW}={raw!r}: expected a positive number of steps per window (default "
                          f"{WINDOW}); unset it for the default")
    return int(raw)


# -- clocks: host time, or CUDA events read lazily -------------------------------------------------------------
class HostClock:
    """Marks are ``time.perf_counter()`` readings, ready at once (CPU ranks: gloo blocks the host)."""

    def mark(self) -> Any:
        """A mark for now."""
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        """Whether ``mark`` can be read without waiting (always, for host time)."""
        return True

    def wait(self, mark: Any) -> None:
        """Wait until ``mark`` can be read (nothing to wait for)."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``."""
        return float(end - start)


@attrs.define
class CudaClock:
    """Marks are CUDA events recorded on the current stream: the GPU's timeline, not the host's (the host runs
    ahead of the GPU, and NCCL's all-reduce wait happens on the GPU). ``ready`` is ``Event.query()``, so reading
    never blocks; only `wait` (the end-of-run summary) synchronises an event.

    Attributes:
        event: the event type (``torch.cuda.Event``; tests pass a fake one).
    """

    event: Callable[..., Any] = attrs.field(factory=lambda: torch.cuda.Event)

    def mark(self) -> Any:
        """An event recorded now on the current stream."""
        event = self.event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        """Whether the GPU has passed ``mark`` (no synchronise)."""
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        """Block until the GPU has passed ``mark``."""
        mark.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        """GPU seconds between two passed marks."""
        return float(start.elapsed_time(end)) / 1000.0


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """CUDA events on a CUDA device, host time elsewhere."""
    return CudaClock() if device.type == "cuda" else HostClock()


# -- this rank's steps ---------------------------------------------------------------------------------------------
#: A finished step whose marks may not be readable yet (CUDA): (start, end, comm (begin, end) pairs, data seconds).
#: A tuple, not an attrs class: made every step, and the accounting must stay within microseconds per step.
#: A pair whose begin is ``None`` holds seconds already read (`Recorder.comm_end` folds a long list).
_Closed = tuple[Any, Any, list[tuple[Any, Any]], float]
_NO_COMMS: Final[list[tuple[Any, Any]]] = []  # shared until a step records a wait (never appended to)
#: Open waits one step may hold before the readable ones are folded into one pair of seconds: a loop that runs
#: collectives but no forward (an evaluation loop of ``ctx.all_reduce`` after training) has one open step that
#: would otherwise collect a pair (two CUDA events on a GPU) for every collective, without bound.
FOLD_AT: Final = 64


@attrs.define(eq=False)
class Recorder:
    """This rank's step accounting: the hooks call `boundary`, `add_data`, `comm_begin` and `comm_end`;
    every ``window`` readable steps it calls ``on_window`` with their samples.

    Attributes:
        clock: where step and comm marks come from.
        window: steps per window.
        on_window: receives each full window's samples, in order.
        on_step: called with `steps` after each step is read (rank 0's retry of a window not yet complete).
        steps: steps read so far (the whole run).
        sums: their summed (data, compute, comm, step) seconds.
    """

    clock: Clock
    window: int
    on_window: Callable[[list[Sample]], None]
    on_step: Callable[[int], None] | None = None
    steps: int = 0
    sums: list[float] = attrs.field(factory=lambda: [0.0, 0.0, 0.0, 0.0])
    _start: Any = None  # the open step's start mark (None before the first step)
    _comms: list[tuple[Any, Any]] = _NO_COMMS
    _fold_at: int = FOLD_AT
    _comm_start: Any = None
    _data: float = 0.0
    _loop_end: Any = None  # when the open step's batch loop ran out of batches (its end, if it is the last)
    _closed: deque[_Closed] = attrs.field(factory=deque)
    _samples: list[Sample] = attrs.field(factory=list)

    def boundary(self) -> None:
        """A training forward begins: close the open step (if any) and open the next one."""
        now = self.clock.mark()
        if self._start is not None:
            self._closed.append((self._start, now, self._comms, self._data))
        # a wait before the first step is no step's; one left open (an exception inside it) ends here
        self._start, self._data, self._comms, self._comm_start = now, 0.0, _NO_COMMS, None
        self._loop_end = None
        self._fold_at = FOLD_AT
        self.drain()

    def loop_ended(self) -> None:
        """The batch loop of the open step has no batch left (``ctx.dataloader``'s iterator ran out): should no
        forward follow, this is where the run's last step ended (not at the end of the function, which may go on
        to evaluate or save)."""
        if self._start is not None:
            self._loop_end = self.clock.mark()

    def close(self) -> None:
        """The run's steps are over (the whole-run totals are taken): close the open step, which no next forward
        will, at its loop's end (`loop_ended`) or now; a forward after this opens a new step."""
        if self._start is None:
            return
        end = self._loop_end if self._loop_end is not None else self.clock.mark()
        self._closed.append((self._start, end, self._comms, self._data))
        self._start, self._data, self._comms, self._comm_start, self._loop_end = None, 0.0, _NO_COMMS, None, None

    @property
    def unread(self) -> int:
        """Steps not read yet: closed ones whose marks are pending, and the open one."""
        return len(self._closed) + (self._start is not None)

    def add_data(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a batch (before the first step: start-up, not counted)."""
        if self._start is not None:
            self._data += seconds

    def comm_begin(self) -> None:
        """A wait for the other ranks begins: DDP's end-of-backward wait for the all-reduce, or a ``ctx``
        collective. A nested one (a collective inside a collective) is part of the outer one."""
        if self._comm_start is None:
            self._comm_start = self.clock.mark()

    def comm_end(self) -> None:
        """The wait `comm_begin` started is over."""
        if self._comm_start is not None:
            if self._comms is _NO_COMMS:
                self._comms = []
            self._comms.append((self._comm_start, self.clock.mark()))
            self._comm_start = None
            if len(self._comms) >= self._fold_at:
                self._fold()

    def _fold(self) -> None:
        """Replace the open step's readable waits by one pair holding their seconds (see `FOLD_AT`). Waits the
        GPU has not passed stay; if many remain, the next fold waits until the list has doubled, so a GPU that
        is far behind costs no more than one pass per doubling."""
        clock, seconds, kept = self.clock, 0.0, []
        for begin, done in self._comms:
            if begin is None:
                seconds += done
            elif clock.ready(done):
                seconds += clock.seconds(begin, done)
            else:
                kept.append((begin, done))
        kept.append((None, seconds))
        self._comms = kept
        self._fold_at = max(FOLD_AT, 2 * len(kept))

    def drain(self, *, block: bool = False) -> None:
        """Read the closed steps whose marks have completed (``block``: wait for all of them)."""
        clock, closed, sums = self.clock, self._closed, self.sums
        while closed:
            start, end, comms, data = closed[0]
            if block:
                clock.wait(end)
            elif not clock.ready(end):
                return  # the GPU is still behind: read it at a later boundary
            closed.popleft()
            total = clock.seconds(start, end)
            comm = 0.0
            for begin, done in comms:
                comm += done if begin is None else clock.seconds(begin, done)
            data = min(data, total)
            compute = max(0.0, total - data - comm)
            sums[0] += data
            sums[1] += compute
            sums[2] += comm
            sums[3] += total
            self.steps += 1
            self._samples.append((data, compute, comm, total))
            if len(self._samples) >= self.window:
                samples, self._samples = self._samples, []
                self.on_window(samples)
            elif self.on_step is not None:
                self.on_step(self.steps)


#: Models inside a ``with acc:`` micro-batch that does not open its accumulation window (`continue_step`): their
#: training forward continues the open step instead of starting one, so a step is an optimizer step.
_MID_WINDOW: Final[weakref.WeakSet[nn.Module]] = weakref.WeakSet()


def continue_step(model: nn.Module, mid_window: bool) -> None:
    """``ctx.accumulate``'s micro-batches: while ``mid_window``, a forward of ``model`` is no step boundary (the
    step runs from the forward opening one window to the next, one optimizer step, not one micro-batch)."""
    if mid_window:
        _MID_WINDOW.add(model)
    else:
        _MID_WINDOW.discard(model)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """A tensor of a forward's output that backward will go through (the output itself, usually)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    return None


@attrs.define(eq=False)
class _ModelHooks:
    """The forward hooks on the watched model and the autograd callbacks they queue (see the module docstring)."""

    recorder: Recorder
    _engine: Any = attrs.field(factory=lambda: torch.autograd.Variable._execution_engine)

    def install(self, model: nn.Module, *, bracket: bool = True) -> None:
        """Hook ``model``; ``bracket``: also time the end-of-backward wait (only worth its cost, about half of the
        accounting's per step, when there are other ranks to wait for)."""
        # torch.compile of the wrapped model would trace into the hooks and warn about time.perf_counter; run them
        # eagerly instead (a clean graph break at the model's edges; ~2 us per call in eager mode, measured)
        model.register_forward_pre_hook(torch.compiler.disable(self._pre_forward))
        if not bracket:
            return
        from .fsdp_hooks import bracket_final_callback  # free: it imports nothing

        # FSDP2 queues its end-of-backward callback from a tensor hook, which the engine runs before our node
        # pre-hook, so a callback of ours would come after its wait: bracket FSDP's own callback instead (issue 42)
        if bracket_final_callback(model, self._comm_begin, self._comm_end):
            return
        # DDP queues its end-of-backward callback when its last bucket is ready, after ours
        model.register_forward_hook(torch.compiler.disable(self._post_forward), prepend=True)

    def _comm_begin(self) -> None:
        if not capturing():
            self.recorder.comm_begin()

    def _comm_end(self) -> None:
        if not capturing():
            self.recorder.comm_end()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        # an evaluation forward is no step, nor one inside an accumulation window it did not open
        if module.training and torch.is_grad_enabled() and not capturing() and module not in _MID_WINDOW:
            self.recorder.boundary()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled() and not capturing():
            tensor = _first_grad_tensor(output)
            if tensor is None:
                return
            # A pre-hook on the output's autograd node: measured ~3x cheaper per step than Tensor.register_hook
            # (which builds a hook dict and a handle each time); a leaf output has no node, so it gets the latter.
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(self._backward_started)
            else:
                tensor.register_hook(self._backward_started)

    def _backward_started(self, *grads: Any) -> None:
        # Queued before DDP queues its end-of-backward callback (when its last bucket is ready), so it runs
        # first; it queues the second one, which the engine runs after DDP's.
        self._engine.queue_callback(self._compute_done)

    def _compute_done(self) -> None:
        self._comm_begin()
        self._engine.queue_callback(self._comm_end)


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (a user's ``torch.cuda.graph`` around a
    step): no timing event is recorded then (CUDA may refuse an event record during capture, and the ``query()`` of
    one captured never becomes true); the replayed step runs no hooks anyway. Cheap when CUDA is not initialised."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# -- getting the rows to rank 0 -------------------------------------------------------------------------------------
@attrs.frozen
class _Rows:
    """The timings' protocol on the run's channel: every rank posts JSON rows, rank 0 reads the others' without
    blocking (``channel`` ``None``: a world of one, or no store; rank 0 then sees only its own rows)."""

    channel: Channel | None
    rank: int

    def publish(self, name: str, payload: dict[str, Any]) -> None:
        if self.channel is not None:
            self.channel.post(name, json.dumps(payload))

    def read(self, name: str) -> list[dict[str, Any]] | None:
        """The other ranks' payloads (rank order) when all have posted ``name``, else ``None``."""
        if self.channel is None:
            return []
        found = self.channel.read_all(name, self.channel.others())
        return None if found is None else [json.loads(raw) for raw in found.values()]

    def wait(self, name: str, seconds: float) -> list[dict[str, Any]]:
        """The other ranks' payloads under ``name`` that were posted within ``seconds`` (rank 0, end of run)."""
        if self.channel is None:
            return []
        return [json.loads(raw) for raw in self.channel.wait_all(name, seconds, self.channel.others()).values()]


# -- the run's facade ---------------------------------------------------------------------------------------------
def _display(message: str) -> None:
    logger.warning(message)


@attrs.define(eq=False)
class Timings:
    """One run's timing accounting on one rank (``ctx.run.timings``; ``ctx.timings()`` reads it).

    Attributes:
        enabled: measure at all (``DISTFN_TIMINGS``, on by default).
        window: steps per window; ``None``: ``DISTFN_TIMINGS_WINDOW``, else `WINDOW`, read when the first model is
            watched (so a bad value fails ``ctx.wrap`` with a `ConfigError`, inside the function, not the bootstrap).
        display: where rank 0's straggler warning goes: ``ctx.progress`` sets its own writer while a loop runs
            under it (so the line does not break the bar); otherwise a loguru warning.
        latest: rank 0's table of the newest window every rank has reported (``None`` elsewhere, or before).
        channel: where the rows travel: the run's (``run.channel.child("timings")``, set when the run opens);
            ``None``: the process group's store, if any, when the first model is watched.
        history: rank 0's record of every window so far (bounded; `distfn.timings_plot.History`), what
            ``ctx.timings(plot=...)`` draws; ``None`` before the first window and on the other ranks.
        on_table: called on rank 0 with each window's table as it completes (the run hands it to the trackers,
            `distfn.timings_plot.metrics`); an exception there is logged once and never reaches training.
    """

    enabled: bool = attrs.field(factory=enabled_by_env)
    window: int | None = None
    display: Callable[[str], None] = _display
    latest: TimingTable | None = None
    channel: Channel | None = None
    history: History | None = None
    on_table: Callable[[TimingTable], None] | None = None
    #: the tensor-parallel groups of the run's mesh (`distfn.stragglers.find_straggler`), empty without ``tp``
    groups: tuple[tuple[int, ...], ...] = ()
    _recorder: Recorder | None = None
    _exchange: _Rows | None = None
    _host: str = attrs.field(factory=socket.gethostname)
    _windows: int = 0  # windows this rank has written
    _unread: deque[tuple[int, RankTimes]] = attrs.field(factory=deque)  # rank 0: its own rows not yet matched
    _detector: Detector = attrs.field(factory=Detector)
    _retry: tuple[int, int] = (0, 0)  # rank 0: (step of the next read attempt, gap after it), while a window waits
    _totals: int = 0  # whole-run tables asked for so far
    _summarised: int = -1  # steps the last whole-run table covered (the end-of-run log skips a repeat)
    _plot_warned: set[tuple[str, str]] = attrs.field(factory=set)  # (path, error) already said by `plot`
    _plotted: tuple[str, int] | None = None  # (path, windows) `plot` last drew

    @property
    def recorder(self) -> Recorder | None:
        """What the hooks feed, from the first watched model on (``None`` before, and when switched off);
        `distfn.run.Run.collective` times a collective's wait through it."""
        return self._recorder

    # -- the hooks' entry points ----------------------------------------------------------------------------
    def watch(self, model: nn.Module, device: torch.device, *, bracket: bool | None = None) -> None:
        """Measure the steps of ``model`` (what ``ctx.wrap`` returned). Only the run's first model is watched:
        with two (a GAN), the second one's forward and backward count as compute of the first one's steps.

        Args:
            model: the wrapped model.
            device: this rank's device (CUDA: event marks).
            bracket: time the end-of-backward wait for the gradient all-reduce; ``None``: when the process group
                has other ranks (in a world of one there is nothing to wait for, so that part is not installed).
        """
        if not self.enabled or self._recorder is not None:
            return
        active = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if active else (0, 1)
        channel = self.channel if self.channel is not None else default_store() if active else None
        recorder = self.start(rank, world, channel, clock_for(device))
        _ModelHooks(recorder).install(model, bracket=world > 1 if bracket is None else bracket)

    def start(self, rank: int, world_size: int, store: Any, clock: Clock) -> Recorder:
        """Begin this rank's accounting on ``store`` (a `distfn.rankstore.Channel`, or a bare store that gets a
        channel of its own; ``None``: this rank's rows only); returns the recorder the hooks feed. `watch` calls
        it with the process group's facts."""
        if self.window is None:
            self.window = window_from_env()
        if store is None or world_size < 2:
            channel = None
        else:  # the run's channel, or (a plain script, a test) one of its own on a bare store
            channel = store if isinstance(store, Channel) else Channel.open(store, rank, world_size, "timings")
        self._exchange = _Rows(channel, rank)
        self._recorder = Recorder(clock, self.window, self._window_done,
                                  on_step=self._retry_read if rank == 0 and world_size > 1 else None)
        return self._recorder

    def timed_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, timing each ``next()`` as data wait (``ctx.dataloader`` passes its iterator through)."""
        if not self.enabled:
            yield from batches
            return
        iterator = iter(batches)
        clock = time.perf_counter
        while True:
            started = clock()
            try:
                batch = next(iterator)
            except StopIteration:
                if self._recorder is not None:
                    self._recorder.loop_ended()
                return
            if self._recorder is not None:
                self._recorder.add_data(clock() - started)
            yield batch

    # -- windows ------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank (0 before a model is watched)."""
        return self._exchange.rank if self._exchange is not None else 0

    def _window_done(self, samples: list[Sample]) -> None:
        assert self._exchange is not None  # set with the recorder
        row = stragglers.summarise(samples, rank=self.rank, host=self._host)
        number, self._windows = self._windows, self._windows + 1
        if self.rank != 0:
            self._exchange.publish(f"w{number % SLOTS}", {"window": number, "row": stragglers.to_payload(row)})
            return
        self._unread.append((number, row))
        if len(self._unread) > SLOTS - 1:  # the others' slots for the oldest have been overwritten by now
            self._unread.popleft()
        self._read_windows()
        # The others finish the same window within a step or so of rank 0: look again 1, 2, 4, ... steps later
        # (a few store round trips per window at most) rather than a whole window later.
        self._retry = (row.steps * (number + 1) + 1, 2)

    def _retry_read(self, steps: int) -> None:
        """Rank 0, after each step: read a window that was not complete when rank 0 finished it."""
        due, gap = self._retry
        if not self._unread or steps < due:
            return
        self._read_windows()
        self._retry = (steps + gap, min(2 * gap, self.window or WINDOW))

    def _read_windows(self) -> None:
        """Rank 0: turn every window all ranks have written into a table, oldest first."""
        assert self._exchange is not None
        while self._unread:
            number, mine = self._unread[0]
            payloads = self._exchange.read(f"w{number % SLOTS}")
            if payloads is None or any(p["window"] != number for p in payloads):
                return  # a rank has not written this window yet: try again at the next one
            rows = [mine, *(stragglers.from_payload(p["row"]) for p in payloads)]
            self._unread.popleft()
            straggler = stragglers.find_straggler(rows, self.groups)
            self.latest = TimingTable(tuple(rows), steps=mine.steps, window=number, straggler=straggler)
            self._record(self.latest)
            warn = self._detector.observe(straggler)
            if warn is not None:
                self.display(warn.message)

    def _record(self, table: TimingTable) -> None:
        """Rank 0: keep the window for the picture and hand it to `on_table` (never failing the step)."""
        try:
            if self.history is None:
                from .timings_plot import History  # deferred: only rank 0, at its first window

                self.history = History()
            self.history.add(table)
        except Exception as exc:  # noqa: BLE001 - the picture's record must never fail a training step
            logger.debug("timings: window {} not recorded for the picture: {}", table.window, exc)
        if self.on_table is not None:
            try:
                self.on_table(table)
            except Exception as exc:  # noqa: BLE001 - the trackers' copy must never fail a training step
                logger.warning("timings: the window's numbers could not be handed to the trackers ({}: {}); "
                               "they are not sent again", type(exc).__name__, exc)
                self.on_table = None

    def plot(self, path: str | os.PathLike[str]) -> Path | None:
        """Rank 0: write the picture of every window so far to ``path`` (`distfn.timings_plot.write`); the path
        written, or ``None`` before the first window, on the other ranks, and when the write failed.

        What the path alone tells (a suffix other than ``.svg``/``.png``, a ``.png`` without matplotlib, no text)
        is a `ConfigError` on every rank, at the first call. A write that fails on rank 0 (a folder in the way, no
        permission, a full disk, the drawing itself) is a warning (once per path and error) and ``None``: the
        picture is side work, and an exception on rank 0 alone would leave the other ranks waiting at their next
        collective."""
        from .timings_plot import check, write

        target = check(path)
        if not self.enabled and ("off", "") not in self._plot_warned:
            self._plot_warned.add(("off", ""))
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                logger.warning("ctx.timings(plot={}): {}=0 switches the timings off, so there is no picture to draw; "
                               "unset it to measure", str(target), ENV_SWITCH)
        if self.history is None:
            return None
        drawn = (str(target), self.history.added)
        if drawn == self._plotted and target.is_file():
            return target  # called every step: the picture is drawn again only once a new window came in
        try:
            written = write(self.history.points, target)
            self._plotted = drawn
            return written
        except Exception as exc:  # noqa: BLE001 - the picture must never fail (or desynchronise) the training
            said = (str(target), type(exc).__name__)
            if said not in self._plot_warned:
                self._plot_warned.add(said)
                logger.warning("timings: the picture could not be written to {} ({}: {}); training goes on",
                               target, type(exc).__name__, exc)
            return None

    # -- the whole run ----------------------------------------------------------------------------------------
    def whole_run(self, *, wait: float = FINAL_WAIT_S) -> TimingTable | None:
        """Every rank's totals since the start, on rank 0 (``None`` elsewhere, or when nothing was measured).

        Every rank must call it (each writes its totals; rank 0 waits up to ``wait`` seconds for all of them and
        leaves out a rank that did not write in time). On CUDA it waits for the last steps' events.
        """
        recorder, exchange = self._recorder, self._exchange
        if recorder is None or exchange is None:
            return None
        recorder.close()  # the last step: no forward follows to close it
        recorder.drain(block=True)
        number, self._totals, self._summarised = self._totals, self._totals + 1, recorder.steps
        mine = {"steps": recorder.steps, "sums": recorder.sums, "host": self._host, "rank": exchange.rank}
        if exchange.rank != 0:
            exchange.publish(f"total{number}", mine)
            return None
        payloads = [mine, *exchange.wait(f"total{number}", wait)]
        rows = [stragglers.totals_row(p["sums"], p["steps"], rank=p["rank"], host=p["host"])
                for p in payloads if p.get("steps")]  # a rank that failed sent no steps
        if not rows:
            return None
        found = stragglers.find_straggler(rows, self.groups)
        if found is not None and self._windows >= self._detector.windows and not self._detector.warned(found):
            # Over a run long enough for the persistent rule, a straggler it never named is a few slow steps
            # (start-up, a checkpoint save on rank 0) weighing on the means: not the rank the job waited for.
            found = None
        return TimingTable(tuple(rows), steps=recorder.steps, straggler=found)

    def finish(self, *, failed: bool = False) -> None:
        """End of the run: rank 0 logs the whole-run summary table (every rank takes part; no collective).

        Skipped when nothing was measured, or when the function itself took the whole-run table after its last
        step (``distfn test`` prints it in its report). A rank that ``failed`` sends empty totals instead, so that
        rank 0 (whose own function may have returned) does not wait `FINAL_WAIT_S` for them."""
        recorder, exchange = self._recorder, self._exchange
        if failed:
            if exchange is not None and exchange.rank != 0:
                with contextlib.suppress(Exception):  # the store may be gone with the failure
                    exchange.publish(f"total{self._totals}", {"steps": 0})
            return
        if recorder is None or recorder.steps + recorder.unread in (0, self._summarised):
            return
        try:
            table = self.whole_run()
        except Exception as exc:  # noqa: BLE001 - the summary must never fail a run that succeeded
            logger.debug("timings: no end-of-run summary: {}", exc)
            return
        if table is not None:
            logger.info("{}", table.format())
