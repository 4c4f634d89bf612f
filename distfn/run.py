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
worker's stack pipe (`distfn.launch.local`) and the ledger of the main thread's collectives (`distfn.ledger`,
which `collectives` writes; the run holds it as ``run.ledger`` and `Run.open` resets it).

The run also owns its lifecycle and the order of its services: `Run.open` (before the process group: the
ledger, rank 0's tracking, the background saves, the timings), `Run.connect` (once the group is up: the run's
store channel, `distfn.rankstore`, and on it the check-in, the start-up fingerprint and the hang responder), then
the user's function, then `Run.fail` (the function raised: each service's failure step, before the failure is
reported) and always `Run.close` (each service's end); both in the reverse order of the services' start. Each service
registers its steps once, where it starts (`_Service`); a new one is one registration. `Run.collective` is the one
hook around every collective distfn starts (the ``ctx`` ones and the checkpoint's): the sync point, the ledger
entry the hang report reads and the step's comm time.

Imports: `boundary`, `checkin`, `checkpoint.background`, `data`, `fingerprint`, `fsdp_options`, `hangs`, `ledger`,
`options`, `preemption`, `rankstore`, `rng`, `timings`, `topology` (types), `tracking.session` (the types of its parts
and the rules that pick them); nothing imports it but `context`, `worker` and `checkpointing` (and, for annotations,
the services it is passed to).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
from loguru import logger
from torch import nn

from . import hangs
from .boundary import Boundaries
from .checkin import RULES, CheckIn
from .checkpoint.background import Saves
from .data import LastLoader
from .fingerprint import Agreement
from .fsdp_options import FsdpOptions
from .ledger import LEDGER, Ledger
from .mesh import Mesh
from .options import DEFAULT_TIMEOUT, Mode, shards_state
from .preemption import StopSignals
from .rankstore import Channel, default_store
from .rng import gather_wait
from .timings import Timings, capturing
from .tracking.session import Session, open_session, status_of

if TYPE_CHECKING:
    from .options import Options
    from .topology import Topology

#: Seconds a rank whose function ended normally waits for peers that have not yet started their process group.
PEER_START_WAIT: Final = 60.0
#: The same wait after the function failed (its report is out already, so the launcher may end it sooner): a rank
#: that fails at once and leaves broke a peer still in gloo's mesh set-up, whose C++ "connectFullMesh failed ...
#: Connection closed by peer" line then came before the user's error on stderr, with a second, misleading failure.
PEER_START_WAIT_FAILED: Final = 5.0


@attrs.frozen
class _Service:
    """One service's steps in the run's lifecycle, each run in the reverse order of the services' start (the last
    started ends first): ``fail`` when the function raised (before the failure is reported), ``close`` when the
    run ends (always)."""

    name: str
    fail: Callable[[BaseException], None] | None = None
    close: Callable[[BaseException | None], None] | None = None


class _Collective:
    """The ``with`` block of one kind of collective on one run (`Run.collective`): one instance per op, reused,
    a plain class (a generator-based context manager costs about twice as much per call)."""

    __slots__ = ("_entry", "_recorder", "_run")

    def __init__(self, run: Run, op: str) -> None:
        self._run = run
        # the ledger entry only where the run has ranks to disagree with (`Run.connect`); a plain
        # `distfn.collectives` call inside records nothing then (nested), and itself where this does not
        self._entry = run.ledger.entered(op) if run.channel is not None else contextlib.nullcontext()
        self._recorder: Any = None

    def __enter__(self) -> None:
        run = self._run
        run.sync_point()  # first: a rank that skipped another's checkpoint call raises here, before any wait
        self._entry.__enter__()
        # no marks while a CUDA graph is captured: an event recorded into a graph is never passed (issue 42)
        recorder = self._recorder = None if capturing() else run.timings.recorder
        if recorder is not None:
            recorder.comm_begin()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> None:
        if self._recorder is not None:
            self._recorder.comm_end()
        self._entry.__exit__(kind, value, tb)


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
        rank: this rank; world_size: the number of ranks.
        timeout_s: distfn's deadline for every collective, in seconds (``@distributed(timeout=)``): no checked
            call waits longer.
        channel: the run's keys on the process group's store (`distfn.rankstore.Channel`), from `connect`
            (multi-rank runs with a store); every cross-rank service speaks through its own child of it.
        checkin: this rank's side of the "did every rank call this?" protocol, from `connect` to `close`;
            ``None`` otherwise.
        agreement: the start-up comparison of the ranks' cfg and models that every ``ctx.wrap`` runs
            (`distfn.fingerprint`), from `connect`; ``None`` otherwise.
        responder: this rank's side of the cross-rank hang report (`distfn.hangs`), from `connect`.
        tracking: rank 0's experiment tracking (``ctx.log_metrics``, ``track=``), ``None`` on the other ranks
            (whose log calls then cost nothing); ``ctx.save`` stores its run's key, ``ctx.resume`` hands it back.
        saves: this rank's background checkpoint writer (``ctx.save(..., blocking=False)``, ``ctx.saves``), which
            every later checkpoint call, a true ``ctx.should_stop`` and the bootstrap (before the process group
            goes) wait for.
        timings: this rank's step accounting (data wait / compute / comm, `distfn.timings`): ``ctx.wrap`` and
            ``ctx.dataloader`` feed it, ``ctx.timings()`` reads it, `close` logs its summary on rank 0.
        ledger: the ledger of this process's main-thread collectives (`distfn.ledger`), which the hang report reads.
        mesh: the run's named device mesh (`distfn.mesh.Mesh`: ``mesh=``, else one ``dp_shard`` dimension over
            every rank), made at start-up on every rank of a multi-rank run that shards or names its mesh, and at
            first use where it is the default mesh of a run that does neither (a DDP job: `defer_mesh`);
            ``None`` in one process.
        boundaries: this rank's generator snapshots at each ``ctx.step`` (`distfn.boundary`), which a save on rank 0
            alone writes for every rank; the answering thread runs from `connect` to `close`.
        rank_seed: this rank's own seed under ``@distributed(seed=..., rank_seeds=True)`` (``seed + rank``), else
            ``None``: what a rank the checkpoint has no stream for starts from.
    """

    mode: Mode = "single"
    fsdp: FsdpOptions = attrs.field(factory=FsdpOptions)
    stop: StopSignals = attrs.field(factory=StopSignals)
    loaders: LastLoader = attrs.field(factory=LastLoader)
    wrapped: weakref.WeakSet[nn.Module] = attrs.field(factory=weakref.WeakSet)
    timeout_s: float = DEFAULT_TIMEOUT.total_seconds()
    rank: int = 0
    world_size: int = 1
    channel: Channel | None = None
    checkin: CheckIn | None = None
    agreement: Agreement | None = None
    responder: hangs.Responder | None = None
    saves: Saves = attrs.field(factory=Saves)
    tracking: Session | None = None
    timings: Timings = attrs.field(factory=Timings)
    ledger: Ledger = LEDGER
    _mesh: Mesh | None = attrs.field(default=None, alias="mesh")
    boundaries: Boundaries = attrs.field(factory=Boundaries)
    rank_seed: int | None = None
    _services: list[_Service] = attrs.field(factory=list, init=False)
    _blocks: dict[str, _Collective] = attrs.field(factory=dict, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _mesh_factory: Callable[[], Mesh] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def mesh(self) -> Mesh | None:
        """See the class's attributes; a mesh deferred by `defer_mesh` is made here, at its first use."""
        if self._mesh is None and self._mesh_factory is not None:
            factory, self._mesh_factory = self._mesh_factory, None
            self._mesh = factory()
        return self._mesh

    @mesh.setter
    def mesh(self, value: Mesh | None) -> None:
        self._mesh, self._mesh_factory = value, None

    @property
    def mesh_if_made(self) -> Mesh | None:
        """The mesh without making a deferred one (`defer_mesh`), for what only its layout and data-parallel group
        decide (``ctx.all_reduce``, ``ctx.gather_for_metrics``, the sampler's shard): a deferred mesh is the default
        one, whose answers are those of no mesh (every rank data-parallel, the world's group)."""
        return self._mesh

    def defer_mesh(self, factory: Callable[[], Mesh]) -> None:
        """Make the mesh at its first use (``ctx.mesh``, ``ctx.gather_for_metrics``), not at start-up.

        Why: ``init_device_mesh`` costs ~5 ms of CPU in every rank (torch's layout algebra), on every launch's
        critical path, and a DDP job rarely asks for its mesh (issue 46 item 2). Only for the default mesh, one
        dimension over every rank, which torch builds on the default process group without a collective, so one
        rank may make it while another never does; a named or sharded mesh (new process groups: every rank at the
        same point) is still made at start-up."""
        self._mesh, self._mesh_factory = None, factory

    # -- the lifecycle ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, opts: Options, cfg: Any, topology: Topology, *, stop: StopSignals) -> Run:
        """Start a run on this rank, before its process group: the ledger afresh, rank 0's tracking session, and
        the services every run has (the background saves, the timings)."""
        run = cls(mode=opts.mode, fsdp=opts.fsdp or FsdpOptions(), stop=stop, timeout_s=opts.timeout.total_seconds(),
                  rank=topology.rank, world_size=topology.world_size,
                  tracking=open_session(opts.track, cfg, topology.rank),
                  boundaries=Boundaries(topology.rank, topology.world_size),
                  rank_seed=None if opts.seed is None or not opts.rank_seeds else opts.seed + topology.rank)
        run.ledger.reset()
        if run.tracking is not None:  # FINISHED / FAILED / KILLED, once; after a failure, before it is reported
            session = run.tracking
            run.register("tracking", fail=lambda exc: session.close(status_of(exc, run.stop.stopped)),
                         close=lambda error: session.close(status_of(error, run.stop.stopped)))
        run.register("timings", close=lambda error: run.timings.finish(failed=error is not None))
        if run.tracking is not None and run.tracking.active:  # rank 0: each window's per-rank numbers to the trackers
            run.timings.on_table = _TrackWindows(run.tracking)
        # a failure: the last asynchronous save still lands (this failure is the one reported)
        run.register("saves", fail=lambda _: run.saves.wait(timeout=60))
        return run

    def connect(self, cfg: Any, *, backend: str, report: Callable[[BaseException], None] | None = None,
                bootstrap: Sequence[Callable[..., Any]] = ()) -> None:
        """The services that speak through the process group's store, once the group is up (no collective): the
        run's channel, the check-in, the start-up fingerprint and the hang responder.

        Args:
            cfg: the call's cfg (what the fingerprint compares).
            backend: the group's backend (under NCCL the responder watches distfn's deadline itself).
            report: how this rank's failure reaches a distfn launcher, else ``None`` (see `distfn.hangs.Responder`).
            bootstrap: distfn's frames below the user's function (the hang report's stacks are cut there).
        """
        store = default_store()
        if store is None:
            if shards_state(self.mode):  # elsewhere only rng=True saves check in: not worth a warning every start
                logger.warning("fsdp: the process group has no store; ctx.save on rank 0 only cannot be detected")
            return
        self.channel = channel = Channel.open(store, self.rank, self.world_size)
        self._blocks.clear()  # made before the channel: they would not enter the ledger
        wait, longer = self._check_in_wait()
        self.checkin = checkin = CheckIn.start(self.rank, self.world_size, wait, channel.child("checkin"),
                                               longer=longer)
        # peers waiting in a check-in learn that this rank will never join it, once every rank's process group is
        # up (after a failure too, for a while), so an immediate return cannot break a peer's set-up (CheckIn.finish)
        self.register("checkin", close=lambda error: checkin.finish(
            wait_for_peers=PEER_START_WAIT_FAILED if error is not None else PEER_START_WAIT))
        self.responder = responder = hangs.Responder.start(
            channel.child("hang"), timeout_s=self.timeout_s, left=checkin.finished_ranks, ledger=self.ledger,
            bootstrap=bootstrap, report=report, deadline="nccl" in backend.lower())
        # a timeout or a lost peer: the cross-rank report goes with the exception
        self.register("hang responder", fail=responder.on_failure, close=lambda _: responder.stop())
        self.agreement = Agreement.start(channel.child("fingerprint"), cfg, self.timeout_s)
        self.timings.channel = channel.child("timings")
        self.boundaries.connect(channel.child("boundary"), wait_s=min(gather_wait(), self.timeout_s))
        self.register("boundaries", close=lambda _: self.boundaries.close())

    def register(self, name: str, *, fail: Callable[[BaseException], None] | None = None,
                 close: Callable[[BaseException | None], None] | None = None) -> None:
        """Add a service's steps to the lifecycle (see `_Service`); call it where the service starts."""
        self._services.append(_Service(name, fail, close))

    def fail(self, exc: BaseException) -> None:
        """The function raised ``exc``: each service's failure step, in the reverse order of their start (the hang
        responder's report first, then the last asynchronous save, then tracking's ``FAILED``; never raises)."""
        for service in reversed(self._services):
            if service.fail is not None:
                _quietly(service.fail, exc, what=service.name)

    def close(self, error: BaseException | None = None) -> None:
        """End the run on this rank (once; never raises): each service's end, in the reverse order of their start.
        Ranks still waiting in a check-in learn that this one will never join it."""
        if self._closed:
            return
        self._closed = True
        for service in reversed(self._services):
            if service.close is not None:
                _quietly(service.close, error, what=service.name)

    def finish(self, *, failed: bool = False) -> None:
        """`close` with the outcome only (``failed``: the function raised)."""
        self.close(RuntimeError("the function failed") if failed else None)

    def _check_in_wait(self) -> tuple[float, str | None]:
        """Seconds a checked call waits, and how to wait longer when distfn's deadline is what bounds it.

        In ``mode="fsdp"`` every checkpoint call checks in and waits ``fsdp.save_timeout``; in the other modes
        only ``ctx.save(..., rng=True)`` does, and rank 0 waits `distfn.rng.gather_wait` seconds. Either is cut
        to the run's collective deadline (``timeout=``), which covers every collective distfn starts.
        """
        wait = self.fsdp.save_timeout if shards_state(self.mode) else gather_wait()
        if wait <= self.timeout_s:
            return wait, None
        rule = RULES["ctx.save" if shards_state(self.mode) else "ctx.save(..., rng=True)"]
        return self.timeout_s, (f"raise @distributed(timeout=...), distfn's deadline for every collective, which "
                                f"ended this wait (then {rule.longer})")

    # -- during the function ------------------------------------------------------------------------------------
    def start_check_in(self, rank: int, world_size: int) -> None:
        """Start the check-in alone on the process group's store (a test's run; the bootstrap's is `connect`)."""
        store = default_store()
        if store is not None:
            wait, longer = self._check_in_wait()
            self.checkin = checkin = CheckIn.start(rank, world_size, wait, store, longer=longer)
            self.register("checkin", close=lambda error: checkin.finish(
                wait_for_peers=PEER_START_WAIT_FAILED if error is not None else PEER_START_WAIT))

    def agree(self, model: nn.Module) -> None:
        """Before ``ctx.wrap``: raise `distfn.errors.ConfigError` when the ranks' cfg or ``model`` differ
        (`distfn.fingerprint`; no collective)."""
        if self.agreement is not None and isinstance(model, nn.Module):
            self.agreement.check(model)

    def collective(self, op: str) -> contextlib.AbstractContextManager[None]:
        """The one hook around a collective distfn starts (a ``ctx`` collective, a checkpoint's gather), as
        ``with run.collective("all_reduce"):``: the sync point (`sync_point`), the ledger entry the hang report
        and the NCCL deadline read (``op``, the caller's line), and the wait counted as the step's comm time."""
        try:
            return self._blocks[op]
        except KeyError:
            block = self._blocks[op] = _Collective(self, op)
            return block

    def sync_point(self) -> None:
        """A point every rank passes equally often (a distfn collective, a forward of a sharded model): in
        ``mode="fsdp"`` it is noted, and raises when another rank waits in a checkpoint call this rank skipped."""
        if self.checkin is not None and shards_state(self.mode):
            self.checkin.note_progress()

    def check_in(self, call: Literal["ctx.save", "ctx.load"], *, rng: bool = False) -> bool:
        """Check every rank in before the collectives of ``call`` (see `distfn.checkin`); returns whether it did.

        ``mode="fsdp"``: every checkpoint call with sharded objects is a collective. The other modes: only
        ``ctx.save(..., rng=True)`` (``rng``) is, by its gather of every rank's generator states. Without a process
        group there is nothing to check. The wait is in the ledger, as the call's name: a hang report then says
        which rank waits in which checkpoint call.
        """
        if self.checkin is None:
            return False
        if shards_state(self.mode):
            with self.ledger.entered(call):
                self.checkin.check_in(call)
            return True
        if rng and call == "ctx.save":
            with self.ledger.entered("ctx.save(..., rng=True)"):
                self.checkin.check_in("ctx.save(..., rng=True)")
            return True
        return False


@attrs.frozen
class _TrackWindows:
    """Rank 0: each window's per-rank timings to the trackers, at the user's latest step (`Timings.on_table`)."""

    session: Session

    def __call__(self, table: Any) -> None:
        from .timings_plot import metrics  # already loaded: rank 0's first window loaded it for its history

        if self.session.beside_due:  # one row per user step: the others are not even built
            self.session.log_beside(metrics(table))


def _quietly(step: Callable[..., Any], *args: Any, what: str = "a service", **kwargs: Any) -> None:
    """Run one lifecycle step; its failure is logged, never raised: the run's own outcome is what counts."""
    try:
        step(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a service's end must not hide the function's result or error
        logger.debug("run: {} failed to end cleanly: {}", what, exc)
