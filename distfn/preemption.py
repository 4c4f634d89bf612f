"""Graceful stop on SIGTERM / SIGUSR2: the state behind ``ctx.should_stop``.

Schedulers warn a job before they end it: SLURM sends SIGTERM at the time limit or on preemption (then SIGKILL
after ``KillWait``, 30 s by default), and ``sbatch --signal=USR2@120`` sends SIGUSR2 two minutes earlier. Each
rank installs a handler for both (in its main thread only: Python runs signal handlers there) that records
the signal in the run's `StopSignals` (`install`; ``ctx.run.stop``). `StopSignals.should_stop` all-reduces that
record with MAX, so every rank sees ``True`` at the same step
boundary even when the signal reached only some of them (the launching process forwards it to its workers,
and SLURM signals every process of a step), and the loop can save a checkpoint and return together.

SIGTERM is the one signal that also means "end now" (``kill``, torchrun and distfn itself stop ranks with it).
A rank whose function does not poll ``should_stop`` (its code never mentions it, and it has not read it yet)
raises `distfn.errors.Terminated` on the first SIGTERM instead, so ``finally`` blocks run and the rank
exits; a function that polls only gets the flag set, and the loop decides. Either way a rank that ignores the
request is killed by whoever sent it after a grace.

With ``@distributed(requeue=True)`` a Slurm job that stopped this way is put back in the queue once it returned
(`requeue`, called by rank 0 from `distfn.worker.run`).

`set_handlers` / `restore_handlers` are the one way distfn installs and gives back signal handlers (here, and in
the launching process's forwarder).
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from loguru import logger

from . import collectives
from .errors import Terminated

#: The signals that ask the job to stop at the next step boundary.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR2)


@attrs.define(eq=False)
class StopSignals:
    """One run's record of the stop signals this process received; its `on_signal` is the installed handler.

    The run holds it (`distfn.run.Run.stop`) and `ctx.should_stop` asks it. The handler is this object's bound
    method, so the signal handler reaches the state through the handler itself, with no module global: `install`
    finds the object of a handler installed earlier (a self-spawned worker installs one first thing, before the
    run exists) by asking `signal.getsignal` for it.
    """

    signal: str | None = None  # name of the first stop signal received
    polled: bool = False  # the function called should_stop(): SIGTERM no longer raises
    raised: bool = False  # Terminated was raised once; later SIGTERMs must not interrupt the finally blocks
    stopped: bool = False  # should_stop() returned True: the ranks agreed to stop (what requeue= acts on)

    def on_signal(self, signum: int, frame: Any) -> None:
        """The handler of `STOP_SIGNALS`: record the first, and raise `Terminated` on SIGTERM unless polled."""
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        if signum == signal.SIGTERM and not self.polled and not self.raised:
            self.raised = True
            raise Terminated(
                "received SIGTERM (a scheduler time limit or preemption, `kill`, or the launcher stopping the job); "
                "poll ctx.should_stop at step boundaries to save and return instead"
            )

    def should_stop(self, device: Any = None) -> bool:
        """True on every rank once any rank received SIGTERM or SIGUSR2 (a collective: all ranks must call it).

        ``device`` is where the flag travels for the all-reduce (a CUDA device under NCCL; the CPU otherwise).
        """
        self.polled = True
        local = self.signal is not None
        agreed = local if not collectives.active() else bool(
            collectives.all_reduce(int(local), op="max", device=device))
        self.stopped = self.stopped or agreed
        return agreed


def polls(fn: Any) -> bool:
    """True when ``fn``'s code (or a function nested in it) reads an attribute named ``should_stop``.

    Such a function stops by itself, so SIGTERM must not raise in it even before its first poll (a loop that
    checks once per epoch would otherwise get ``Terminated`` during the first epoch).
    """
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        if "should_stop" in code.co_names:
            return True
        stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return False


def set_handlers(handlers: Mapping[int, Any]) -> dict[int, Any]:
    """Install ``{signal: handler}`` and return the handlers they replaced, for `restore_handlers`.

    Python runs signal handlers in the main thread only and refuses to set them from another one: outside the
    main thread nothing is installed and ``{}`` is returned.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}


def restore_handlers(previous: Mapping[int, Any] | None) -> None:
    """Give back the handlers that `set_handlers` replaced (``None``, one set from C, becomes the default)."""
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def install(opt_in: bool = False) -> tuple[StopSignals, dict[int, Any] | None]:
    """Handle the stop signals in this process with a fresh record; returns the record and the handlers to give
    back (with `restore_handlers`).

    ``opt_in``: the function polls ``should_stop`` (see `polls`), so SIGTERM only sets the flag.
    When a `StopSignals` handler is installed already (a self-spawned worker installs one first thing), its
    record is kept, with what arrived since, and ``{}`` comes back as the handlers. Outside the main thread, where
    Python cannot set handlers, nothing is installed: a fresh record and ``None``.
    """
    if threading.current_thread() is not threading.main_thread():
        return StopSignals(polled=opt_in), None
    current = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(current, StopSignals):
        current.polled = current.polled or opt_in
        return current, {}
    stop = StopSignals(polled=opt_in)
    return stop, set_handlers(dict.fromkeys(STOP_SIGNALS, stop.on_signal))


def slurm_job_id(env: Mapping[str, str]) -> str:
    """This Slurm job's id (``<array job>_<task>`` for one task of an array), ``""`` outside Slurm. A requeued job
    keeps it, which is why experiment tracking keys its run by it (`distfn.tracking.key`)."""
    job = env.get("SLURM_JOB_ID", "").strip()
    array_job, task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and task:
        return f"{array_job}_{task}"  # one task of an array, not the whole array
    return job


def requeue(env: Mapping[str, str], run: Callable[..., Any] = subprocess.run, *,
            signal_name: str | None = None) -> bool:
    """Put this Slurm job back in the queue (``scontrol requeue``); returns whether Slurm accepted it.

    Called once, by rank 0, after the function returned because of a stop signal (``requeue=True``). Slurm then
    ends this run at once (the job shows "CANCELLED ... DUE TO JOB REQUEUE") and starts it again later with
    ``SLURM_RESTART_COUNT`` one higher, so it must come after the checkpoint is written. The job must be
    requeueable (``#SBATCH --requeue``, or the cluster's ``JobRequeue=1``). Outside Slurm, or when ``scontrol``
    fails, a warning says so and nothing else happens. ``signal_name``: the stop signal this rank received (for
    the log line), if any.
    """
    job = slurm_job_id(env)
    if not job:
        logger.warning("requeue=True but this is not a Slurm job (SLURM_JOB_ID is unset): not requeued")
        return False
    try:
        done = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("requeue=True but `scontrol requeue {}` could not run: {}", job, exc)
        return False
    if done.returncode != 0:
        logger.warning("`scontrol requeue {}` failed ({}): {}; is the job requeueable (#SBATCH --requeue)?", job,
                       done.returncode, (done.stderr or done.stdout or "").strip())
        return False
    logger.info("stopped by {}: job {} requeued (it resumes from its newest checkpoint)", signal_name or "a "
                "stop signal on another rank", job)
    return True
