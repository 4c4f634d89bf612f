"""The cross-rank hang report under every launcher, over the process group's own store.

When a collective (or the rendezvous) times out on a rank, the report names the timeout, the ranks that had not
reached a collective and where they were, which collective each rank's ledger says it is in (`distfn.ledger`),
and every rank's Python stack at that moment. Self-spawned jobs used to get it from the launching process
(`distfn.launch.local` signals its workers); torchrun, srun, mpirun, env:// pods, per-node launches and Ray have no
process that owns every rank, but every rank has the process group's key-value store. So:

* each rank runs a `Responder`, a daemon thread started once the process group is up. It polls one key of the
  store (``request``, every `POLL_S`) on its own connection (`Store.clone`: a second thread must not share the
  main thread's socket). Asked, it writes every thread's stack (``faulthandler``, most recent call first) and
  its ledger to ``answer/<rank>``. A Python thread runs while the main thread is blocked in a gloo/NCCL call or a
  sleep (they release the GIL); a rank stuck in C code that holds the GIL cannot answer and is named so;
* a rank whose collective timed out (`Responder.on_failure`, from the bootstrap's error path) writes its own
  answer (its traceback), then claims the report (the lowest rank that failed at about the same time, once). The
  reporter writes ``request``, waits at most `ANSWER_WAIT_S` for the answers, builds the report
  (`distfn.failures.diagnose` plus the ledger line and the ranks that did not answer) and publishes it under
  ``report``; the other ranks that timed out pick it up. A rank that did not answer is named dead when its process
  is gone (its pid, posted at start, is checked on its host by any rank there that answers), as having left the
  function when its check-in says so, else as "no answer";
* every rank then ends: the failing ones raise as before; a rank that only answered (rank 1 sleeping in user
  code) waits `EXIT_GRACE_S` for its launcher to stop it, and else reports itself as ended by the hang report and
  exits, so no rank waits for the 30-minute default.

Under NCCL the watchdog aborts a timed-out rank from its own thread, before Python sees an error. So with NCCL
the process group's timeout is distfn's plus `NCCL_MARGIN_S` (`group_timeout`), and the responder itself notices a
ctx collective open for longer than distfn's timeout (the ledger's ``inside_since``), or one whose host call
returned at once but that the GPU has not finished after that timeout (the ledger's CUDA events, `Ledger.gpu_event`:
a CUDA tensor's ``ctx.all_reduce``), and reports then, before the watchdog fires (`nccl_abort_after`).

Cost: one store ``check`` per rank every `POLL_S` (0.5 s) while the function runs; nothing on the training path.

Imports: `failures` (the diagnosis and the in-place report), `ledger`, `rankstore` (the run's channel).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
from loguru import logger

from . import failures, process
from .ledger import LEDGER, Ledger, RankState, disagreement
from .rankstore import Channel, poll

__all__ = ["ANSWER_WAIT_S", "EXIT_GRACE_S", "NCCL_MARGIN_S", "POLL_S", "STOP_WAIT_S", "EndedByHang", "Responder",
           "group_timeout", "nccl_abort_after"]

#: Seconds between two looks of a rank's responder at the store.
POLL_S: Final = 0.5
#: Seconds a failing rank waits for lower ranks that fail at the same time (the lowest one reports).
CLAIM_WINDOW_S: Final = 0.5
#: Seconds the reporting rank waits for the other ranks' answers.
ANSWER_WAIT_S: Final = 5.0
#: Seconds a rank that only answered waits for its launcher to stop it before it ends itself.
EXIT_GRACE_S: Final = 5.0
#: How long the end of a run waits for the responder's thread to leave its store call (one ``check``: milliseconds).
STOP_WAIT_S: Final = 5.0
#: Seconds NCCL's own timeout is set after distfn's, so that the report is collected before the watchdog aborts.
NCCL_MARGIN_S: Final = 15.0
#: torch's default of ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (ProcessGroupNCCL.cpp, ``HeartbeatMonitor``: 15 * 1000).
_NCCL_DUMP_MS: Final = 15_000


class EndedByHang(RuntimeError):
    """This rank was ended because another rank reported a hang of the job (the report is on that rank)."""


def group_timeout(timeout: datetime.timedelta, backend: str | None) -> datetime.timedelta:
    """The process group's timeout: distfn's, plus `NCCL_MARGIN_S` under NCCL (see the module docstring)."""
    if backend is not None and "nccl" in backend.lower():
        return timeout + datetime.timedelta(seconds=NCCL_MARGIN_S)
    return timeout


def nccl_abort_after(environ: Any = None) -> float | None:
    """Seconds from distfn's deadline to the NCCL watchdog's abort of a rank whose collective timed out, with this
    process's settings; ``None`` when the watchdog does not tear the process down.

    The watchdog (ProcessGroupNCCL.cpp, ``Watchdog::runLoop``; torch 2.13's header declares each piece) notices the
    timeout at the group's timeout, `NCCL_MARGIN_S` after distfn's, measured from the collective's enqueue; it then
    calls ``broadcastDumpSignal()``, sleeps ``getDumpTimeout() * 4`` (``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 15 s by
    default: 60 s) and only then ``handleException``, whose rethrow from its own thread ends the process (SIGABRT)
    unless ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 0 (NoHandling) or 2 (CleanUpOnly): ``SHOULD_TEAR_DOWN``. With the
    defaults: 15 + 60 = 75 s after distfn's deadline (plus the watchdog's 100 ms poll)."""
    env = os.environ if environ is None else environ
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING", "3")).strip()
    if handling in ("0", "2"):
        return None
    try:
        dump_ms = max(0, int(env.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", _NCCL_DUMP_MS)))
    except ValueError:
        dump_ms = _NCCL_DUMP_MS
    return NCCL_MARGIN_S + 4 * dump_ms / 1000


def _watch_gpu(ledger: Ledger) -> None:
    """Under NCCL with CUDA in use, let the ledger note a CUDA event after each collective (`Ledger.gpu_event`)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        def recorded() -> Any:
            if torch.cuda.is_current_stream_capturing():  # an event captured into a graph is never passed
                return None
            event = torch.cuda.Event()
            event.record()  # the current stream: the collective's result is ready for it once this is passed
            return event

        ledger.gpu_event = recorded


def _passed(event: Any) -> bool:
    """Whether the GPU has passed ``event``, asked from the responder's thread under the event's device (a query
    with no current device would open a context on cuda:0, another rank's GPU)."""
    device = getattr(event, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        with torch.cuda.device(device):
            return bool(event.query())
    return bool(event.query())


def _abort_phrase() -> str:
    after = nccl_abort_after()
    if after is None:
        return "NCCL's watchdog does not end this rank (TORCH_NCCL_ASYNC_ERROR_HANDLING); its launcher or distfn does"
    return (f"NCCL's watchdog aborts this rank about {after:g} s later: it notices the timeout after "
            f"{NCCL_MARGIN_S:g} s, then waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC for flight-recorder dumps")


def _is_hang(exc: BaseException) -> bool:
    """A collective that timed out (gloo, NCCL's blocking wait), or a lost peer: the failures a report explains
    (a timeout of the user's own, an HTTP request, has no collective frame and gets none)."""
    failure = failures.Failure.from_exception(0, exc)
    timed_out = failures.hang_kind(failure, timeout_s=0.0) is not None and failures.in_collective(failure)
    return timed_out or failures.peer_loss(failure)


def _dump_threads() -> str:
    """Every thread's Python stack in faulthandler's format (a real file: faulthandler writes to a descriptor)."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (a zombie too: dead, its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    found = process.stat(f"/proc/{pid}/stat")
    return found is not None and found[1] == "Z"


def _nobody_left() -> list[int]:
    return []


@attrs.define(eq=False)
class Responder:
    """This rank's side of the hang report for one run (see the module docstring).

    Attributes:
        channel: the run's hang-report keys (``run.channel.child("hang")``; the thread clones its own connection).
        timeout_s: distfn's collective timeout in seconds.
        left: the ranks that have left the function (the run's check-in knows them).
        ledger: the ledger of this rank's collectives (the run's, `distfn.ledger`).
        bootstrap: distfn's frames below the user's function (stacks are cut there).
        report: delivers this rank's failure to a distfn launcher (self-spawn, per-node, Ray), else ``None``: the
            rank reports in place (`distfn.failures.report_in_place`).
        deadline: watch ctx collectives for distfn's timeout (NCCL, whose watchdog would abort first).
    """

    channel: Channel
    timeout_s: float
    left: Callable[[], list[int]] = _nobody_left
    ledger: Ledger = LEDGER
    bootstrap: Sequence[Callable[..., Any]] = ()
    report: Callable[[BaseException], None] | None = None
    deadline: bool = False
    _stop: threading.Event = attrs.field(factory=threading.Event)
    _thread: threading.Thread | None = None
    _claimed: bool = False
    #: What this rank's deadline watch reported (`_report_overdue`), if it did: the main thread's own error for
    #: the same collective (NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1`` raises it later) is then one line.
    _deadline_report: str | None = None

    @classmethod
    def start(cls, channel: Channel, *, timeout_s: float, left: Callable[[], list[int]] = _nobody_left,
              ledger: Ledger = LEDGER, bootstrap: Sequence[Callable[..., Any]] = (),
              report: Callable[[BaseException], None] | None = None, deadline: bool = False) -> Responder:
        """Post this rank's host and pid and start its thread (call once the process group is up)."""
        self = cls(channel, timeout_s, left, ledger, tuple(bootstrap), report, deadline)
        channel.post("info", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        try:
            own = channel.clone()
        except (AttributeError, RuntimeError) as exc:  # a store type without clone(): this rank cannot answer
            logger.debug("hang responder of rank {}: no second store connection ({}); it will not answer",
                         channel.rank, exc)
            return self
        self._thread = threading.Thread(target=self._serve, args=(own,), daemon=True,
                                        name=f"distfn-hang-responder-{channel.rank}")
        if deadline:
            _watch_gpu(ledger)
        self._thread.start()
        return self

    @property
    def rank(self) -> int:
        """This rank."""
        return self.channel.rank

    def stop(self) -> None:
        """End the thread (the run is over) and wait for it, at most `STOP_WAIT_S`.

        Waited for because the thread calls the store's C++ code with the GIL released: a thread still there when
        the interpreter finalises is ended by ``pthread_exit`` as it takes the GIL back, and that unwinding through
        pybind11's ``noexcept`` frames aborts the process ("terminate called without an active exception", the
        way a gloo thread outliving its group did: `distfn.worker.leave_group`). A thread stuck on a dead store is
        not waited for longer: it is a daemon and never blocks the exit.
        """
        self._stop.set()
        self.ledger.gpu_event = None
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT_S)

    # -- the thread -------------------------------------------------------------------------------------------
    def _serve(self, ch: Channel) -> None:
        try:
            while not self._stop.wait(POLL_S):
                if ch.has("request"):
                    self._answer(ch)
                    self._end_after_report(ch)
                    return
                if self.deadline and self._overdue(time.monotonic()):
                    self._report_overdue(ch)
                    return
                on_gpu = self.ledger.gpu_overdue(time.monotonic(), self.timeout_s, _passed) if self.deadline else None
                if on_gpu is not None:
                    self.ledger.failed = True  # the report's ledger line: the rank is still in it
                    self._report_overdue(ch, on_gpu=on_gpu.text())
                    return
        except Exception as exc:  # noqa: BLE001 - the store went away (the job is being torn down): nothing to do
            logger.trace("hang responder of rank {} ends: {}", self.rank, exc)

    def _overdue(self, now: float) -> bool:
        since = self.ledger.inside_since
        return since is not None and now - since > self.timeout_s

    def _answer(self, ch: Channel, stack: str | None = None) -> None:
        """Write this rank's answer (unless its main thread, failing, wrote one already)."""
        if ch.has(f"answer/{self.rank}"):
            return
        if stack is None:
            stack = failures.main_stack(_dump_threads(), self.bootstrap, others=True)
        answer = {"stack": stack, "ledger": self.ledger.state(self.rank).to_dict(), "dead": self._dead_here(ch)}
        ch.post("answer", json.dumps(answer))

    @staticmethod
    def _infos(ch: Channel) -> dict[int, dict[str, Any]]:
        return {r: json.loads(v) for r, v in ch.read("info").items()}

    def _dead_here(self, ch: Channel) -> list[int]:
        """The ranks on this host whose process is gone."""
        host = socket.gethostname()
        return [r for r, info in self._infos(ch).items() if info["host"] == host and _gone(int(info["pid"]))]

    def _end_after_report(self, ch: Channel) -> None:
        """Another rank reported a hang: give the launcher `EXIT_GRACE_S` to stop this rank, then end it."""
        reporter = None
        try:
            for _ in poll(ANSWER_WAIT_S + 2.0):
                if self._stop.is_set():
                    break
                if ch.has("report"):
                    reporter = ch.get("by").decode()
                    break
        except Exception:  # noqa: BLE001 - the reporter hosted the store and is gone
            pass
        if self._stop.wait(EXIT_GRACE_S):
            return  # the main thread is handling it (it failed too, or finished)
        exc = EndedByHang(f"rank {reporter if reporter is not None else '?'} reported a hang of the job "
                          f"(its report has every rank's stack); this rank was ended by it")
        failures.attach_report(exc, "", "", reporter=int(reporter) if reporter is not None else -1)  # one line
        if self.report is not None:
            self.report(exc)
        else:
            failures.report_in_place(self.rank, exc)
        logger.complete()
        os._exit(1)

    def _report_overdue(self, ch: Channel, *, on_gpu: str | None = None) -> None:
        """NCCL: a ctx collective is open past distfn's timeout (or, ``on_gpu``, one the GPU has not finished that
        long after its call returned); report now, before the watchdog aborts."""
        state = self.ledger.state(self.rank)
        if on_gpu is not None:
            what = f"{on_gpu} (queued, its call returned) did not finish on the GPU"
        else:
            what = f"{state.last.text() if state.last is not None else 'a collective'} did not finish"
        exc = TimeoutError(f"{what} within the timeout of {self.timeout_s:g} s (distfn's deadline; "
                           f"{_abort_phrase()})")
        stack = failures.main_stack(_dump_threads(), self.bootstrap, others=True)
        self._deadline_report = f"{type(exc).__name__}: {exc}"
        self._collect(ch, exc, own_stack=stack)
        if self.report is not None:
            self.report(exc)
        else:
            failures.report_in_place(self.rank, exc)
        # out now: the watchdog's abort (SIGABRT) would drop whatever the log sinks and stdio still buffer
        logger.complete()
        for stream in (sys.stderr, sys.stdout):
            with contextlib.suppress(Exception):
                stream.flush()

    # -- the failing rank -------------------------------------------------------------------------------------
    def on_failure(self, exc: BaseException) -> None:
        """The main thread failed with ``exc``: for a timeout or a lost peer, take part in the report (collect it,
        or wait for the rank that does) and attach it to ``exc`` (`distfn.failures.attach_report`)."""
        self.stop()
        if self._deadline_report is not None and _is_hang(exc):
            # the collective this rank's deadline watch already reported failed in the main thread too (NCCL's
            # blocking wait): the job's output has that report once, this error points at it in one line
            failures.attach_report(exc, f"rank {self.rank} reported this hang at distfn's deadline: "
                                        f"{self._deadline_report}", "", reporter=-1)
            return
        if self._claimed or not _is_hang(exc):
            return
        try:
            self._collect(self.channel, exc, own_stack="".join(traceback.format_exception(exc)))
        except Exception as err:  # noqa: BLE001 - never hide the rank's own failure behind the report's
            logger.debug("rank {}: could not collect the hang report: {}", self.rank, err)

    def _collect(self, ch: Channel, exc: BaseException, *, own_stack: str) -> None:
        self._claimed = True
        self._answer(ch, stack=own_stack)
        if not self._claim(ch):
            self._pick_up_report(ch, exc)
            return
        ch.set("by", str(self.rank))
        ch.set("request", str(self.rank))
        answers, dead, silent, left = self._gather(ch)
        first = failures.Failure.from_exception(self.rank, exc)
        text = _report(first, answers, self.ledger.state(self.rank), dead=dead, silent=silent, left=left,
                       timeout_s=self.timeout_s)
        ch.set("report", json.dumps([text.diagnosis, text.stacks]))
        failures.attach_report(exc, text.diagnosis, text.stacks, reporter=self.rank)

    def _claim(self, ch: Channel) -> bool:
        """Whether this rank reports: the lowest rank that failed within `CLAIM_WINDOW_S` of the others (ranks
        waiting in one collective time out together), and the first to claim (``store.add``) after that."""
        ch.post("failed", "1")
        time.sleep(CLAIM_WINDOW_S)
        if ch.read("failed", range(self.rank)):
            return False
        return ch.add("claim") == 1

    def _pick_up_report(self, ch: Channel, exc: BaseException) -> None:
        for _ in poll(ANSWER_WAIT_S + 2.0):
            if ch.has("report"):
                reporter = int(ch.get("by").decode())
                failures.attach_report(exc, _see(reporter), "", reporter=reporter)
                return

    def _gather(self, ch: Channel) -> tuple[dict[int, dict[str, Any]], dict[int, str], list[int], list[int]]:
        """Every rank's answer, within `ANSWER_WAIT_S`; and the ranks that are dead, silent, or left."""
        others = ch.others()
        answers: dict[int, dict[str, Any]] = {}
        left: list[int] = []
        pending = others
        dead_seen: set[int] = set()
        for _ in poll(ANSWER_WAIT_S, first=0.01):
            wanted = [r for r in others if r not in answers]
            answers.update({r: json.loads(v) for r, v in ch.read("answer", wanted).items()})
            left = [r for r in self.left() if r not in answers and r != self.rank]
            dead_seen = {d for a in answers.values() for d in a["dead"]} | set(self._dead_here(ch))
            pending = [r for r in others if r not in answers and r not in left and r not in dead_seen]
            if not pending:
                break
        infos = self._infos(ch)
        dead = {r: f"pid {infos[r]['pid']} on {infos[r]['host']}" for r in sorted(dead_seen)
                if r in infos and r not in answers}
        silent = [r for r in pending if r not in dead]
        return answers, dead, silent, left


def _see(reporter: int) -> str:
    """The diagnosis of a rank that failed in the same hang: where the report is (it appears once per job)."""
    return f"rank {reporter} reports this hang with every rank's stack"


@attrs.frozen
class _Text:
    diagnosis: str
    stacks: str


def _report(first: failures.Failure, answers: dict[int, dict[str, Any]], own: RankState, *, dead: dict[int, str],
            silent: list[int], left: list[int], timeout_s: float) -> _Text:
    """The report's text: `distfn.failures.diagnose`'s notes, then the ledger line and who could not answer."""
    dumps = {r: a["stack"] for r, a in answers.items()}
    diagnosed = failures.diagnose(first, timeout_s=timeout_s, stacks=lambda: dumps, returned=left)
    notes = [diagnosed.diagnosis] if diagnosed.diagnosis else []
    states = [own, *(RankState.from_dict(a["ledger"]) for a in answers.values())]
    line = disagreement(states)
    if line:
        notes.append(f"Collectives: {line}.")
    if dead:
        notes.append(" ".join(f"Rank {r} is dead ({where}: the process is gone)." for r, where in dead.items()))
    if silent:
        notes.append(f"{failures.ranks_phrase(silent).capitalize()} did not answer within {ANSWER_WAIT_S:g} s: dead, "
                     "or holding the GIL (a long C call that does not release it).")
    what = "timed out" if failures.hang_kind(first, timeout_s=timeout_s) else "failed"
    blocks = [f"Python stacks of the other ranks when rank {first.rank} {what} (most recent call first; a rank "
              "that failed too shows its traceback):"]
    for r, a in sorted(answers.items()):
        tail = ", ".join(e.text() for e in RankState.from_dict(a["ledger"]).tail)
        blocks.append(f"rank {r}:\n{a['stack'].rstrip()}" + (f"\n  last collectives: {tail}" if tail else ""))
    return _Text(" ".join(notes), "\n\n".join(blocks) if answers else "")
