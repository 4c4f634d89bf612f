"""The tracking of one run on rank 0 (``ctx.run.tracking``): what ``ctx.log_metrics`` / ``ctx.log_params`` feed.

Other ranks have no session at all (``None``): their calls return at once, before looking at the values, so they
open no file, start no thread or process, import no tracker package and never synchronise a GPU.

On rank 0 a call turns tensors into floats (``.item()``: on rank 0 only, the one GPU sync the user asked for by
logging a tensor) and appends one entry to a queue; a daemon thread, started at the first call, does the rest:

* **opens the run** of every backend with the job key (`distfn.tracking.key`), at the first call, so that a
  ``ctx.resume`` before the loop can hand over the key of the run its checkpoint belongs to (`Session.adopt`);
* **sends** every ``flush_every`` seconds what came in, in batches (one ``log_batch`` per flush for MLflow, not
  a request per value), the job's cfg first as parameters (`distfn.tracking.params.flatten`);
* **keeps steps going forward**: a step below the highest one logged in this attempt is dropped (one warning),
  and rows at or below a backend's *floor* (the highest step its run held when it opened, or the checkpoint's
  record for a backend that cannot tell) are replays of steps logged before a restart and are not sent again;
* **survives its backends**: an open or a send that raises logs one warning per backend (and one line when it
  works again); ``on_error="buffer"`` keeps what was not sent (at most `MAX_PENDING` rows, the oldest dropped
  beyond) and tries again at each flush, ``"drop"`` throws it away. An open that raises `ConfigError` (settings
  that can never work, such as an MLflow URI MLflow refuses) turns the backend off for the run, said once, at
  once. A backend whose ``floor`` or ``ids`` raises is told about and goes on without them. Nothing a backend
  does reaches training;
* **flushes at a checkpoint**: ``ctx.save`` (`stamp`) waits, at most `SAVE_FLUSH_WAIT` s, until the rows logged
  before it are sent, so a job killed later and resumed from that checkpoint has lost none of them (the rows
  after the checkpoint are logged again by the resumed attempt);
* **closes** the runs FINISHED / FAILED / KILLED when the function ends (`close`, from `distfn.worker.run`), with
  a bounded wait, and never raises there: the job's own failure stays the one reported. A backend that did not
  record every row says how many it lost.

Imports: `tracking.base`, `tracking.key`, `tracking.params` (and the torch ``Tensor`` type).
"""

from __future__ import annotations

import collections
import numbers
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from loguru import logger

from ..errors import ConfigError, Terminated
from .base import Backend, Handle, Row, RunInfo, Status
from .key import RECORD_KEY, BadRecord, job_key, key_in, record, tags
from .params import flatten

#: The prefix of the names `Session.log_beside` writes (distfn's per-rank timings).
BESIDE_PREFIX: Final = "timings/"

#: Entries waiting for the tracking thread beyond which `Session.log_beside` queues nothing (the thread is stuck).
BESIDE_BACKLOG: Final = 256

#: Seconds between two sends of the tracking thread.
FLUSH_EVERY: Final = 1.0

#: The most rows a backend keeps while it cannot send (``on_error="buffer"``); older ones are dropped beyond.
MAX_PENDING: Final = 100_000

#: Seconds `Session.close` waits for the last send and the runs' end after a normal end / after a failure: the
#: launcher stops the other ranks of a failed attempt with SIGTERM and kills them 2 s later
#: (`distfn.launch.local.WorkerGroup.stop`), so the wait ends before that and its warning is still written. The
#: rows logged before the last checkpoint were sent at that ``ctx.save`` already (`Session.stamp`).
CLOSE_WAIT: Final = 30.0
CLOSE_WAIT_FAILED: Final = 1.5

#: The longest ``ctx.save`` waits on rank 0 for the rows logged before it to be sent (the first save may include
#: opening the run: importing mlflow takes 2-5 s). A backend already failing is not waited for.
SAVE_FLUSH_WAIT: Final = 10.0


def status_of(exc: BaseException | None, stopped: bool) -> Status:
    """How a run ended: FAILED for an exception, KILLED for a stop from outside (Ctrl-C, SIGTERM) or a function
    that returned after a stop signal (preemption, requeue), FINISHED otherwise."""
    if exc is None:
        return "KILLED" if stopped else "FINISHED"
    return "KILLED" if isinstance(exc, (KeyboardInterrupt, Terminated)) else "FAILED"


def _number(name: str, value: Any) -> float:
    """A logged value as a float: a one-element tensor (``.item()``), a Python or NumPy number.

    Exact ``float`` / ``int`` first: an ``isinstance`` against the ``numbers`` ABCs costs more than the rest of
    a call (this runs on rank 0 every step, in the training thread).
    """
    kind = type(value)
    if kind is float:
        return value
    try:
        if kind is int:
            return float(value)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(f"ctx.log_metrics: {name!r} is a tensor of shape {tuple(value.shape)}; log one "
                                "value per name (e.g. loss.mean(), or ctx.all_reduce(loss) for the mean over ranks)")
            return float(value.item())  # item() never records autograd history: no detach() needed
        if isinstance(value, (numbers.Real, bool)):
            return float(value)
    except OverflowError:  # an int beyond a float's range (10**400)
        raise TypeError(f"ctx.log_metrics: {name!r} is {_short(value)}, too large for a float (metrics are "
                        "floats)") from None
    raise TypeError(f"ctx.log_metrics: {name!r} is {type(value).__name__} ({_short(value)}); metrics are numbers or "
                    "one-element tensors (log text with ctx.log_params)")


class _Channel:
    """One backend's side of the session: its open run, what waits to be sent, and whether it is failing."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.handle: Handle | None = None
        self.rows: collections.deque[Row] = collections.deque(maxlen=MAX_PENDING)
        self.params: dict[str, str] = {}
        self.failing = False
        self.replays = 0  # rows not sent because an earlier attempt had logged their step
        self.floor: int | None = None  # the handle's floor, read once when the run opened
        self.off: str | None = None  # why the backend is off for this run (its open raised ConfigError)
        self.dropped = 0  # rows this backend will never get (on_error="drop", beyond MAX_PENDING, off)
        self.cause = ""  # the last failure, for the count of lost rows at the end
        self.ids_warned = False

    @property
    def name(self) -> str:
        return self.backend.name

    def keep(self, rows: Sequence[Row]) -> None:
        """Put ``rows`` (not sent) back before the waiting ones, counting what `MAX_PENDING` pushes out."""
        over = len(rows) + len(self.rows) - MAX_PENDING
        self.dropped += max(0, over)
        self.rows = collections.deque([*rows, *self.rows], maxlen=MAX_PENDING)

    def failed(self, what: str, exc: BaseException) -> None:
        self.cause = f"its last try to {what} failed: {type(exc).__name__}: {exc}"
        if not self.failing:
            if self.backend.on_error == "buffer":
                keep = f"the rows are kept (at most {MAX_PENDING:,}) and sent once it works"
            else:
                keep = "the rows are dropped until it works"
            logger.warning("tracking: {} could not {} ({}: {}); training goes on, but {} records nothing for now: {}, "
                           "tried again every {:g} s (on_error={!r})", self.name, what, type(exc).__name__, exc,
                           self.name, keep, FLUSH_EVERY, self.backend.on_error)
        self.failing = True
        if self.backend.on_error == "drop":
            self.dropped += len(self.rows)
            self.rows.clear()
            self.params.clear()

    def turn_off(self, exc: ConfigError) -> None:
        """The backend can never work with its settings: off for the run, said now, its rows counted as lost."""
        self.off = str(exc)
        self.cause = f"it was off: {exc}"
        logger.warning("tracking: {} is off for this run: {}. Training goes on; what is logged is not recorded "
                       "there (the count is given at the end)", self.name, exc)
        self.dropped += len(self.rows)
        self.rows.clear()
        self.params.clear()

    def recovered(self) -> None:
        if self.failing:
            logger.info("tracking: {} works again", self.name)
        self.failing = False

    def run_ids(self) -> dict[str, str] | None:
        """The open run's ``ids`` as plain strings (for the checkpoint record), ``None`` when it cannot tell."""
        if self.handle is None:
            return None
        try:
            return {str(k): str(v) for k, v in dict(self.handle.ids).items()}
        except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches ctx.save
            if not self.ids_warned:
                self.ids_warned = True
                logger.warning("tracking: {} could not name its run for the checkpoint ({}: {}); the checkpoint "
                               "records the run's key without it", self.name, type(exc).__name__, exc)
            return None

    def lost(self) -> None:
        """At the end: one warning counting the rows this backend never recorded (none: silent)."""
        count = self.dropped + len(self.rows)
        if count:
            logger.warning("tracking: {} did not record {:,} row(s) of this run ({}); they are lost", self.name,
                           count, self.cause or "not sent before the end")


class Session:
    """The tracking of one run on rank 0 (see the module docstring). Made by `open_session`."""

    def __init__(self, backends: Sequence[Backend], cfg: Any, env: Mapping[str, str], *,
                 flush_every: float = FLUSH_EVERY) -> None:
        self.backends = tuple(backends)
        self.key = job_key(env)
        self._tags = tags(self.key, env)
        self._cfg = cfg
        self._flush_every = flush_every
        self.high: int | None = None  # the highest step logged in this attempt (or adopted from a checkpoint)
        self._floor: int | None = None  # the checkpoint record's step: the floor of backends that cannot tell
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self._channels = [_Channel(b) for b in self.backends]
        self._wake = threading.Event()
        self._done = threading.Event()
        self._status: Status = "FINISHED"
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._beside_step: int | None = None  # the user's step that `log_beside` last wrote at
        self._users: set[str] = set()  # names the user logged under ``timings/``: `log_beside` leaves them alone
        # flushing for ctx.save: entries queued (training thread) and handled (drained, then sent or failed, by
        # the tracking thread); the thread notifies `_handled_cond` after each round
        self._queued = 0
        self._handled = 0
        self._handled_cond = threading.Condition()

    @property
    def active(self) -> bool:
        """Whether any backend is configured (``track=`` was given)."""
        return bool(self.backends)

    @property
    def started(self) -> bool:
        """Whether the run was opened (the first log call happened)."""
        return self._thread is not None

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    # -- the training thread ------------------------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Queue ``metrics`` at ``step`` (``None``: one more than the last step logged)."""
        if type(metrics) is not dict and not isinstance(metrics, Mapping):
            raise TypeError(f"ctx.log_metrics(metrics): metrics is a mapping {{name: value}}, got "
                            f"{type(metrics).__name__} ({_short(metrics)}); e.g. ctx.log_metrics({{'loss': loss}}, "
                            "step=step)")
        if not self.backends:
            self._warn_once("no-track", "ctx.log_metrics: this job tracks nothing; pass @distributed(track=...) "
                            "('mlflow', 'wandb', 'tensorboard', 'csv'), see docs/tracking.md")
            return
        if step is None:
            step = (self.high or 0) + 1
        elif type(step) is not int:  # the exact int first: the numbers ABC check costs more than the call
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise TypeError(f"ctx.log_metrics(..., step={step!r}): step is a non-negative int (your global step)")
            step = int(step)
        elif step < 0:
            raise TypeError(f"ctx.log_metrics(..., step={step!r}): step is a non-negative int (your global step)")
        values = {name if type(name) is str else str(name): _number(str(name), value)
                  for name, value in metrics.items()}
        if self.high is not None and step < self.high:
            self._warn_once("backwards", "ctx.log_metrics: step {} comes after step {}; steps never go back, so "
                            "such rows are dropped (pass your global step as step=)", step, self.high)
            return
        self.high = step
        if self._thread is None:
            self._start()
        self._queue.append(("metrics", (step, values)))
        self._queued += 1

    @property
    def beside_due(self) -> bool:
        """Whether `log_beside` would queue a row now (a user's step with none yet): the caller may skip building
        it (at 512 ranks a window's row is 2,049 values, about 1 ms to build)."""
        if not self.backends or self.high is None or self._thread is None or self.high == self._beside_step:
            return False
        # Not while no backend takes rows, nor while the thread is behind (a backend that blocks): the user's rows
        # are kept for later (``on_error="buffer"``), distfn's side rows are not: at 512 ranks each is 2,049 values,
        # and `MAX_PENDING` counts rows, so buffering them could hold gigabytes on rank 0.
        return len(self._queue) < BESIDE_BACKLOG and not all(c.failing or c.off for c in self._channels)

    def log_beside(self, metrics: Mapping[str, float]) -> None:
        """Queue ``metrics`` (floats) at the latest step the user logged, without moving it: distfn's own numbers
        (the per-rank timings of each window) beside the user's curves. Nothing is queued before the user's first
        ``ctx.log_metrics`` (distfn does not open a run by itself, nor choose a step the user's would contradict),
        and at most one row per user step: a user who logs once an epoch would otherwise get every window of the
        epoch stacked at one step (several values at one x in TensorBoard and MLflow); the first window done at
        that step is sent, the others until the user's next step are not. A name the user logs too is left to the
        user (`_drain`)."""
        if not self.beside_due:
            return
        self._beside_step = self.high
        self._queue.append(("beside", (self.high, dict(metrics))))
        self._queued += 1

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Queue ``params`` (flattened like the cfg)."""
        if not isinstance(params, Mapping):
            raise TypeError(f"ctx.log_params(params): params is a mapping {{name: value}} (possibly nested), got "
                            f"{type(params).__name__} ({_short(params)})")
        if not self.backends:
            self._warn_once("no-track", "ctx.log_params: this job tracks nothing; pass @distributed(track=...)")
            return
        self._start()
        self._queue.append(("params", flatten(params)))
        self._queued += 1

    def adopt(self, metadata: Mapping[str, Any]) -> None:
        """Continue the run a checkpoint's metadata names (``ctx.resume``), if the run is not open yet."""
        if not self.backends:
            return
        try:
            found = key_in(metadata)
        except BadRecord as exc:  # read from a file: never trusted, never fatal
            self._warn_once("bad-record", "tracking: the resumed checkpoint's tracking record is not used ({}); this "
                            "job logs to run {} instead", exc, self.key)
            return
        if found is None:
            return
        key, step = found
        if self.started:
            if key != self.key:
                logger.warning("tracking: the checkpoint belongs to run {}, but this job already logs to run {} (it "
                               "logged before ctx.resume); call ctx.resume before logging to continue that run",
                               key, self.key)
            return
        if key != self.key:
            logger.info("tracking: continuing run {} of the resumed checkpoint", key)
        self.key, self._floor = key, step
        self._tags = {**self._tags, "distfn.key": key}

    def stamp(self, metadata: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """``metadata`` with this run's record added (``ctx.save``), so a re-run that resumes continues it; first
        the rows logged so far are sent (`flush`, at most `SAVE_FLUSH_WAIT` s). Never raises."""
        if not self.backends:
            return metadata
        if not self.flush(SAVE_FLUSH_WAIT):
            waiting = len(self._queue) + sum(len(c.rows) for c in self._channels)
            self._warn_once("save-flush", "tracking: ctx.save waited {:g} s for the backends to send the rows logged "
                            "before it; about {:,} are not sent yet: they are sent later, but lost if the job is "
                            "killed first", SAVE_FLUSH_WAIT, waiting)
        ids = {c.name: found for c in self._channels if (found := c.run_ids()) is not None}
        steps = [s for s in (self.high, self._floor) if s is not None]
        return {**(metadata or {}), RECORD_KEY: record(self.key, max(steps) if steps else None, ids)}

    def flush(self, timeout: float) -> bool:
        """Wait until the tracking thread has handled what was logged so far (sent, or failed to send), at most
        ``timeout`` s; whether it did. Backends already failing or off are not waited for."""
        thread = self._thread
        if thread is None or self._done.is_set() or all(c.failing or c.off for c in self._channels):
            return True
        target = self._queued
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._handled_cond:
            while self._handled < target:
                left = deadline - time.monotonic()
                if left <= 0 or not thread.is_alive():
                    return False
                self._handled_cond.wait(min(left, 0.5))
        return True

    def close(self, status: Status) -> None:
        """Send what is left and end every run with ``status``; waits at most `CLOSE_WAIT` s (`CLOSE_WAIT_FAILED`
        after a failure), never raises."""
        if self._thread is None or self._done.is_set():
            return
        self._status = status
        self._done.set()
        self._wake.set()
        wait = CLOSE_WAIT if status == "FINISHED" else CLOSE_WAIT_FAILED
        try:
            self._thread.join(wait)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C / SIGTERM while waiting: stop waiting, raise nothing
            logger.warning("tracking: stopped waiting for the backends ({}); what they had not sent is lost",
                           type(exc).__name__)
            return
        if self._thread.is_alive():
            waiting = len(self._queue) + sum(len(c.rows) for c in self._channels)
            logger.warning("tracking: the backends did not finish within {:g} s; what they had not sent (about {:,} "
                           "row(s)) is lost", wait, waiting)

    def _start(self) -> None:
        if self._thread is not None:
            return
        if any(b.log_cfg for b in self.backends):
            self._queue.append(("cfg", flatten(self._cfg)))
            self._queued += 1
        info = RunInfo(key=self.key, name=self.key, tags=dict(self._tags))
        self._thread = threading.Thread(target=self._loop, args=(info,), name="distfn-tracking", daemon=True)
        self._thread.start()

    # -- the tracking thread ------------------------------------------------------------------------------------
    def _loop(self, info: RunInfo) -> None:
        try:
            while True:
                done = self._done.is_set()
                drained = self._drain()
                for channel in self._channels:
                    try:
                        self._send(channel, info)
                    except Exception as exc:  # noqa: BLE001 - the last line of defence: the thread goes on
                        channel.failed("send", exc)
                with self._handled_cond:
                    self._handled += drained
                    self._handled_cond.notify_all()
                if done:
                    break
                self._wake.wait(self._flush_every)
                self._wake.clear()
            for channel in self._channels:
                if channel.handle is not None:
                    try:
                        channel.handle.close(self._status)
                    except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches the job
                        logger.warning("tracking: {} could not close its run ({}: {})", channel.name,
                                       type(exc).__name__, exc)
                channel.lost()
        except BaseException as exc:  # noqa: BLE001 - a backend's SystemExit, say: tracking stops, training goes on
            logger.warning("tracking: stopped ({}: {}); training goes on, nothing more is recorded",
                           type(exc).__name__, exc)

    def _drain(self) -> int:
        count = 0
        while self._queue:
            kind, item = self._queue.popleft()
            count += 1
            if kind == "metrics":  # here, not in ctx.log_metrics: this thread's time is not the training's
                self._users.update(name for name in item[1] if name.startswith(BESIDE_PREFIX))
            elif kind == "beside":
                item, kind = self._own(item), "metrics"
                if not item[1]:
                    continue
            for channel in self._channels:
                if channel.off:
                    channel.dropped += kind == "metrics"
                elif kind == "metrics":
                    channel.dropped += len(channel.rows) == MAX_PENDING  # the deque pushes the oldest out
                    channel.rows.append(item)
                elif kind == "params" or channel.backend.log_cfg:
                    channel.params.update(item)
        return count

    def _own(self, row: Row) -> Row:
        """A `log_beside` row without the names the user logs too (once said): the user's curve stays the user's."""
        step, values = row
        clash = self._users.intersection(values)
        if not clash:
            return row
        self._warn_once("beside-clash", "tracking: you log {} (and maybe more) under a name distfn uses for its "
                        "per-rank timings; distfn leaves those names to you and sends only its others",
                        sorted(clash)[0])
        return step, {k: v for k, v in values.items() if k not in clash}

    def _open(self, channel: _Channel, info: RunInfo) -> Handle | None:
        try:
            handle = channel.backend.open(info)
        except ConfigError as exc:  # settings that can never work: off for the run, not retried
            channel.turn_off(exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches the job
            channel.failed("open its run", exc)
            return None
        try:
            floor = handle.floor
            if floor is not None and (isinstance(floor, bool) or not isinstance(floor, numbers.Integral)):
                raise TypeError(f"floor is {_short(floor)}, not an int or None")
            channel.floor = None if floor is None else int(floor)
        except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches the job
            logger.warning("tracking: {} could not tell the highest step its run holds ({}: {}); the resumed "
                           "checkpoint's step is used instead", channel.name, type(exc).__name__, exc)
        channel.handle = handle
        return handle

    def _send(self, channel: _Channel, info: RunInfo) -> None:
        if channel.off:
            return
        handle = channel.handle if channel.handle is not None else self._open(channel, info)
        if handle is None:
            return
        floor = channel.floor if channel.floor is not None else self._floor
        rows: list[Row] = list(channel.rows)
        channel.rows.clear()
        if floor is not None:
            kept = [row for row in rows if row[0] > floor]
            if len(kept) < len(rows):
                if not channel.replays:
                    logger.info("tracking: {} already holds steps up to {} from an earlier attempt; those steps are "
                                "not sent again", channel.name, floor)
                channel.replays += len(rows) - len(kept)
            rows = kept
        failure: tuple[str, Exception] | None = None
        if channel.params:  # apart from the rows: parameters a backend refuses must not hold the metrics back
            try:
                handle.log_params(channel.params)
                channel.params = {}
            except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches the job
                failure = ("send its parameters", exc)
        if rows:
            try:
                handle.log_metrics(rows)
            except Exception as exc:  # noqa: BLE001 - a backend's failure never reaches the job
                channel.keep(rows)  # kept, in order, for the next try ("buffer"); beyond MAX_PENDING the oldest go
                failure = ("send", exc)
        if failure is not None:
            channel.failed(*failure)
        else:
            channel.recovered()


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters, for an error message (a repr that raises is not one)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message never fails
        return f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def open_session(backends: Sequence[Backend], cfg: Any, rank: int, env: Mapping[str, str] | None = None) \
        -> Session | None:
    """The run's session on rank 0, ``None`` on the other ranks (whose log calls then cost nothing)."""
    if rank != 0:
        return None
    return Session(backends, cfg, os.environ if env is None else env)
