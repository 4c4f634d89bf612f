"""`Run`: the mutable state of one decorated call on one rank, in one object instead of module globals.

The rank bootstrap (`distfn.worker.run`) makes a `Run` for each call, starts its check-in once the process
group is up, hands it to the `Context` (``ctx.run``) and finishes it when the function is over. Every service
that needs per-run state gets it from the `Context` that calls it, never from a global: ``ctx.wrap`` reads the
run's ``fsdp={...}`` options and registers the run's progress hook, ``ctx.save`` / ``ctx.load`` check in through
the run's `distfn.checkin.CheckIn`, ``ctx.accumulate`` and ``ctx.gather_for_metrics`` ask the run's
`distfn.data.LastLoader`, ``ctx.should_stop`` asks the run's `distfn.preemption.StopSignals`. Two runs in one
process (sequential decorated calls, a test) therefore never see each other's state.

Code that runs outside any `Context` finds no run, on purpose, and there is no "current run" slot: the stop
signal handler is the bound method of the run's `StopSignals` (so the handler reaches its record through
itself, and `distfn.preemption.install` finds a record installed before the run through `signal.getsignal`);
a service used from a plain script takes its state as an argument (`distfn.data.gather_for_metrics`' loader,
`distfn.accumulation.Accumulator`'s ``loaders``, `distfn.fsdp.wrap`'s ``on_forward``) and does without it when
none is given. What stays module-level is per process, not per run: the loguru configuration
(`distfn.logs`), the nested-launch guard (`distfn.worker`), the fork server (`distfn.launch.forkserver`), the
worker's stack pipe (`distfn.launch.local`) and the ledger of the main thread's collectives (`distfn.ledger`, reset
by the bootstrap for each run).

Imports: `checkin`, `checkpoint.background`, `data`, `fingerprint`, `fsdp_options`, `options`, `preemption`,
`rng`, `timings`, `tracking.session` (the types of its parts and the rules that pick them); nothing imports it but
`context`, `worker` and
`checkpointing` (and, for annotations, the services it is passed to).
"""

from __future__ import annotations

import weakref
from typing import Final, Literal

import attrs
from loguru import logger
from torch import nn

from .checkin import CheckIn, default_store
from .checkpoint.background import Saves
from .data import LastLoader
from .fingerprint import Agreement
from .fsdp_options import FsdpOptions
from .options import Mode, shards_state
from .preemption import StopSignals
from .rng import gather_wait
from .timings import Timings
from .tracking.session import Session

#: Seconds a rank whose function ended normally waits for peers that have not yet started their process group.
PEER_START_WAIT: Final = 60.0


@attrs.define(eq=False)
class Run:
    """One rank's state of one decorated call (``ctx.run``).

    Attributes:
        mode: the run's mode (what decides which calls check in, and whether progress is tracked).
        fsdp: the run's ``fsdp={...}`` options (the defaults when none were given): what ``ctx.wrap`` shards by,
            overridden per call by its keyword arguments.
        stop: the stop signals this process received (``ctx.should_stop``, ``requeue=``).
        loaders: which of the run's loaders handed out a batch last (``ctx.gather_for_metrics``,
            ``ctx.accumulate``).
        wrapped: the models ``ctx.wrap`` sharded in this run (weakly held), where ``ctx.save`` / ``ctx.load``
            look for the model an optimizer in the state belongs to.
        checkin: this rank's side of the "did every rank call this?" protocol, from `start_check_in` (multi-rank
            runs with a store) to `finish`; ``None`` otherwise.
        agreement: the start-up comparison of the ranks' cfg and models that every ``ctx.wrap`` runs
            (`distfn.fingerprint`), from the bootstrap once the process group is up; ``None`` otherwise.
        tracking: rank 0's experiment tracking (``ctx.log_metrics``, ``track=``), ``None`` on the other ranks
            (whose log calls then cost nothing); ``ctx.save`` stores its run's key, ``ctx.resume`` hands it back.
        saves: this rank's background checkpoint writer (``ctx.save(..., blocking=False)``, ``ctx.saves``), which
            every later checkpoint call, a true ``ctx.should_stop`` and the bootstrap (before the process group
            goes) wait for.
        timings: this rank's step accounting (data wait / compute / comm, `distfn.timings`): ``ctx.wrap`` and
            ``ctx.dataloader`` feed it, ``ctx.timings()`` reads it, `finish` logs its summary on rank 0.
    """

    mode: Mode = "single"
    fsdp: FsdpOptions = attrs.field(factory=FsdpOptions)
    stop: StopSignals = attrs.field(factory=StopSignals)
    loaders: LastLoader = attrs.field(factory=LastLoader)
    wrapped: weakref.WeakSet[nn.Module] = attrs.field(factory=weakref.WeakSet)
    checkin: CheckIn | None = None
    agreement: Agreement | None = None
    saves: Saves = attrs.field(factory=Saves)
    tracking: Session | None = None
    timings: Timings = attrs.field(factory=Timings)

    def start_check_in(self, rank: int, world_size: int) -> None:
        """Start the check-in (call on every rank right after the process group is up; no collective).

        In ``mode="fsdp"`` every checkpoint call checks in and waits ``fsdp.save_timeout``; in the other modes only
        ``ctx.save(..., rng=True)`` does, and rank 0 waits `distfn.rng.gather_wait` seconds.
        """
        store = default_store()
        if store is None:
            if shards_state(self.mode):  # elsewhere only rng=True saves check in: not worth a warning every start
                logger.warning("fsdp: the process group has no store; ctx.save on rank 0 only cannot be detected")
            return
        timeout = self.fsdp.save_timeout if shards_state(self.mode) else gather_wait()
        self.checkin = CheckIn.start(rank, world_size, timeout, store)

    def finish(self, *, failed: bool = False) -> None:
        """End the run on this rank: ranks still waiting in a check-in learn that this one will never join it.
        After a normal end it first waits (at most `PEER_START_WAIT` s) until every rank's process group is up, so
        an immediate return cannot break a peer's group set-up (see `distfn.checkin.CheckIn.finish`)."""
        self.timings.finish(failed=failed)  # rank 0's end-of-run summary table (the other ranks send their totals)
        if self.checkin is not None:
            self.checkin.finish(wait_for_peers=0.0 if failed else PEER_START_WAIT)

    def agree(self, model: nn.Module) -> None:
        """Before ``ctx.wrap``: raise `distfn.errors.ConfigError` when the ranks' cfg or ``model`` differ
        (`distfn.fingerprint`; no collective)."""
        if self.agreement is not None and isinstance(model, nn.Module):
            self.agreement.check(model)

    def sync_point(self) -> None:
        """A point every rank passes equally often (a distfn collective, a forward of a sharded model): in
        ``mode="fsdp"`` it is noted, and raises when another rank waits in a checkpoint call this rank skipped."""
        if self.checkin is not None and shards_state(self.mode):
            self.checkin.note_progress()

    def check_in(self, call: Literal["ctx.save", "ctx.load"], *, rng: bool = False) -> bool:
        """Check every rank in before the collectives of ``call`` (see `distfn.checkin`); returns whether it did.

        ``mode="fsdp"``: every checkpoint call with sharded objects is a collective. The other modes: only
        ``ctx.save(..., rng=True)`` (``rng``) is, by its gather of every rank's generator states. Without a process
        group there is nothing to check.
        """
        if self.checkin is None:
            return False
        if shards_state(self.mode):
            self.checkin.check_in(call)
            return True
        if rng and call == "ctx.save":
            self.checkin.check_in("ctx.save(..., rng=True)")
            return True
        return False
