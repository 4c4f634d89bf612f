"""``launcher="ray"``: run a job's ranks as Ray actors on a Ray cluster, the same decorated function unchanged.

    launch(fn, cfg, opts)
      ├─ connect: ``ray.init()`` (``RAY_ADDRESS``, else the cluster started on this machine, else a new local one)
      ├─ how many ranks: `ray_nprocs` (``nprocs=`` / ``DISTFN_NPROCS``, else one per GPU of the cluster)
      ├─ a placement group of one bundle per rank ({"CPU": 1, "GPU": 1} with GPUs), then one `RankActor` each
      ├─ where each actor runs -> `assign_ranks` (node ranks, local ranks, each node's CUDA_VISIBLE_DEVICES)
      ├─ rank 0's actor binds a free port on its node; every actor gets its `Topology` (launcher ``"ray"``)
      ├─ each actor runs its rank as every distfn rank does (`distfn.launch.protocol.run_rank`), in the driver's
      │  working directory where its node has it (`in_driver_dir`: relative paths mean what they meant at the
      │  driver), and answers once:
      │  ``("ok", value)`` / ``("exit", Failure)`` (``sys.exit(0)``: an early exit, no error unless a peer fails)
      │  / ``("error", Failure)``; an actor or node that died becomes a `Failure` saying so
      └─ the first failure -> `WorkerError` (root cause first); one Ctrl-C -> ``KeyboardInterrupt`` within
         `POLL_S` (`RayJob.on_sigint`); always: the actors are killed and the placement group removed, so nothing
         of the job is left on the cluster

The pure rules (how many ranks, which actor gets which rank, where relative paths go) are
`distfn.launch.ray_rules`, which planning asks without importing this module.

``max_restarts=`` has no effect here (logged at the call, `distfn.plan`): restart the job from the driver.

The function and ``cfg`` travel by Ray's own serialisation (cloudpickle: a function defined in the script you
run goes by value; one from a module must be importable on every node, as distfn itself must be). Ray is imported
only here and only when a job uses it (``import ray`` takes 1-4 s), from the optional extra ``distfn[ray]``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs
from loguru import logger

from .. import logs, preemption, process
from ..errors import ConfigError, LauncherError, WorkerError
from ..failures import Failure
from ..options import Options
from ..topology import Topology
from . import protocol
from .ray_rules import CPUS_PER_RANK, ActorPlace, Assignment, assign_ranks, choose_working_dir, ray_nprocs, topology_for

__all__ = ["POLL_S", "RankActor", "import_ray", "in_driver_dir", "launch"]

#: Seconds between the log lines while Ray has not placed the ranks yet (an autoscaler may be adding nodes).
PLACEMENT_LOG_EVERY: Final = 15.0

#: The longest the driver blocks in one Ray call: how soon it acts on Ctrl-C whatever Ray does with the signal.
POLL_S: Final = 0.5

INSTALL_HINT: Final = "pip install 'distfn[ray]'"


def import_ray() -> Any:
    """The ``ray`` module, or a `ConfigError` naming the extra that installs it."""
    try:
        import ray  # deferred: 1-4 s to import, and an optional extra; only launcher="ray" pays for it
    except ImportError:
        raise ConfigError(f"launcher='ray' needs Ray, which is not installed here: {INSTALL_HINT} "
                          "(on every node of the cluster too)") from None
    return ray


# -- the actor (runs in Ray's worker processes) -------------------------------------------------------------------
class RankActor:
    """One rank of a Ray job: made a Ray actor class by `launch` (``ray.remote``), so this module needs no Ray
    to import."""

    def __init__(self) -> None:
        # a decorated call in this process (a script re-imported here without a main guard) is a nested launch
        process.mark_active(True)
        self._listener: socket.socket | None = None

    def where(self, bundle: int) -> ActorPlace:
        """Where this actor runs (node, address, pid, the GPUs Ray assigned)."""
        import ray  # deferred: this runs inside a Ray worker, where ray is already imported

        return ActorPlace(bundle=bundle, node_id=ray.get_runtime_context().get_node_id(),
                          node_ip=ray.util.get_node_ip_address(), host=socket.gethostname(), pid=os.getpid(),
                          gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()))

    def bind_port(self) -> int:
        """Rank 0: listen on a free port of this node for the rendezvous store (held until `run`: no race)."""
        self._listener = protocol.bind_listener("")
        return int(self._listener.getsockname()[1])

    def run(self, fn: Callable[..., Any], cfg: Any, opts: Options, topology: Topology,
            visible_devices: str | None, driver_cwd: str | None = None) -> tuple[str, Any]:
        """Run this rank as every distfn rank runs (`distfn.launch.protocol.run_rank`), in the driver's working
        directory where this node has it (`in_driver_dir`; ``None``: where the actor is), and answer its one report:
        ``("ok", value or None)``, ``("exit", Failure)`` or ``("error", Failure)``."""
        protocol.export_rank_env(topology)
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices  # before anything starts CUDA in this process
        with in_driver_dir(driver_cwd, topology):
            try:
                store = self._store(topology, opts)
            except BaseException as exc:  # noqa: BLE001 - reported like a failure of the function
                return protocol.classify(topology.rank, exc)
            # the report is kept when the function fails (before the process group goes) and answered at the end
            return protocol.run_rank(fn, cfg, opts, topology, store=store, deliver=lambda message: None,
                                     pack=protocol.to_cpu)

    def _store(self, topology: Topology, opts: Options) -> Any:
        if opts.init_method is not None:
            return None  # the user's own rendezvous URL
        assert topology.master_addr is not None and topology.master_port is not None
        if topology.rank == 0 and self._listener is not None:
            store = protocol.host_store(self._listener, topology.master_addr, topology.world_size, opts.timeout)
            self._listener = None  # the store owns the socket now
            return store
        return protocol.join_store(topology.master_addr, topology.master_port, topology.world_size, opts.timeout)


@contextlib.contextmanager
def in_driver_dir(driver_cwd: str | None, topology: Topology) -> Iterator[None]:
    """Run the block in the driver's working directory where this node has it (`choose_working_dir`): a Ray
    actor starts in its raylet's directory, where a relative path of the user's function would land unseen. Where
    the node lacks it, this rank logs one warning naming both directories. The actor's own working directory comes
    back afterwards, however the block ends. ``driver_cwd=None``: stay (the driver has no directory to give)."""
    if driver_cwd is None:
        yield
        return
    here = os.getcwd()
    choice = choose_working_dir(driver_cwd, here, node=socket.gethostname(), is_dir=os.path.isdir)
    if choice.warning is not None:
        log = logs.setup(topology.rank, topology.world_size)  # the rank's own log line (distfn is quiet outside)
        try:
            log.warning("{}", choice.warning)
        finally:
            logs.teardown()
    if choice.change_to is None:
        yield
        return
    os.chdir(choice.change_to)
    try:
        yield
    finally:
        os.chdir(here)


# -- the driver ---------------------------------------------------------------------------------------------------
def _driver_cwd() -> str | None:
    """The driver's working directory, for the ranks (`in_driver_dir`); ``None`` (said once) where it was removed
    while the driver ran."""
    try:
        return os.getcwd()
    except OSError as exc:
        logger.warning("ray: the driver's working directory is gone ({}), so relative paths in the function resolve "
                       "in each Ray actor's own working directory; use absolute paths", exc)
        return None


def _connect(ray: Any) -> None:
    if not ray.is_initialized():
        # RAY_ADDRESS when set, else the cluster `ray start` began on this machine, else a new local one
        ray.init(log_to_driver=True)
    res = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("ray: {} node(s), {:g} CPU(s), {:g} GPU(s)", len(nodes), res.get("CPU", 0), res.get("GPU", 0))


@attrs.define
class RayJob:
    """The actors and placement group of one Ray job, and what the driver learns about them."""

    ray: Any
    nprocs: int
    gpus: int  # per rank: 1 or 0
    opts: Options
    pg: Any = None
    actors: list[Any] = attrs.field(factory=list)  # in rank order once placed
    assignments: list[Assignment] = attrs.field(factory=list)
    failures: list[Failure] = attrs.field(factory=list)
    early_exits: list[Failure] = attrs.field(factory=list)  # sys.exit(0): no error unless a peer fails
    returned: list[int] = attrs.field(factory=list)
    result: Any = None
    started: float = attrs.field(factory=time.time)
    interrupted: bool = False  # Ctrl-C seen by `on_sigint`, even where Ray swallowed the KeyboardInterrupt
    tearing_down: bool = False  # from then on a Ctrl-C is only recorded: the clean-up must not stop half-way

    def on_sigint(self, signum: int, frame: Any) -> None:
        """The driver's SIGINT handler while the job runs (`_interruptible`): records the Ctrl-C, then raises as
        Python's own handler does. Ray's blocking calls run Python's signal handlers from C++ and turn the
        KeyboardInterrupt into a status that some of them drop (a Ctrl-C then seemed to need a second one); the
        record makes the driver's next check (`check_interrupt`, at most `POLL_S` later) raise it again."""
        self.interrupted = True
        if not self.tearing_down:
            raise KeyboardInterrupt

    def check_interrupt(self) -> None:
        """Raise ``KeyboardInterrupt`` when a Ctrl-C came, whatever Ray did with it."""
        if self.interrupted:
            raise KeyboardInterrupt

    def ready(self, refs: list[Any], timeout: float) -> bool:
        """Wait until every one of ``refs`` is ready (``True``) or ``timeout`` seconds passed (``False``), in
        slices of `POLL_S`, acting on Ctrl-C between them (`check_interrupt`)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_interrupt()
            left = deadline - time.monotonic()
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(POLL_S, left)))
            self.check_interrupt()
            if len(ready) == len(refs):
                return True
            if left <= 0:
                return False

    def place(self) -> None:
        """Reserve one bundle per rank (waiting for the cluster to have room), start the actors, find them."""
        from ray.util.placement_group import placement_group  # deferred: part of ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": CPUS_PER_RANK, **({"GPU": self.gpus} if self.gpus else {})}
        self.pg = placement_group([dict(bundle)] * self.nprocs, strategy="PACK")
        deadline = time.monotonic() + self.opts.timeout.total_seconds()
        while True:
            if self.ready([self.pg.ready()], timeout=PLACEMENT_LOG_EVERY):
                break
            if time.monotonic() > deadline:
                raise LauncherError(
                    f"Ray could not place {self.nprocs} rank(s) of {bundle} within the timeout "
                    f"({self.opts.timeout.total_seconds():g} s); the cluster has {self.ray.cluster_resources()} "
                    f"(available now: {self.ray.available_resources()}). Ask for fewer ranks (nprocs=) or add nodes")
            logger.info("ray: waiting for room for {} rank(s) of {} (available: {})", self.nprocs, bundle,
                        self.ray.available_resources())
        cls = self.ray.remote(RankActor)
        actors = [cls.options(num_cpus=CPUS_PER_RANK, num_gpus=self.gpus, scheduling_strategy=
                              PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)).remote()
                  for i in range(self.nprocs)]
        self.actors = actors
        where = [a.where.remote(i) for i, a in enumerate(actors)]
        timeout = self.opts.timeout.total_seconds()
        try:
            if not self.ready(where, timeout):
                raise LauncherError(f"Ray could not start the ranks' actors within the timeout ({timeout:g} s). "
                                    "distfn (and torch) must be installed in the Python environment of every node")
            places = self.ray.get(where)
        except self.ray.exceptions.RayError as exc:
            raise LauncherError(f"Ray could not start the ranks' actors: {_first_lines(exc)}. distfn (and torch) "
                                "must be installed in the Python environment of every node") from None
        self.assignments = assign_ranks(places)
        self.actors = [actors[a.place.bundle] for a in self.assignments]

    def start(self, fn: Callable[..., Any], cfg: Any) -> dict[Any, int]:
        """Start every rank; returns ``{result ref: rank}``."""
        first = self.assignments[0]
        port_ref = self.actors[0].bind_port.remote()
        if not self.ready([port_ref], self.opts.timeout.total_seconds()):
            raise LauncherError(f"rank 0's Ray actor did not bind the rendezvous port within the timeout "
                                f"({self.opts.timeout.total_seconds():g} s)")
        port = self.ray.get(port_ref)
        layout = ", ".join(f"node {a.place.node_ip} ({a.place.node_id[:8]}): ranks "
                           f"{a.rank}-{a.rank + a.local_world_size - 1}" for a in self.assignments if a.local_rank == 0)
        logger.info("ray: {} rank(s) on {} node(s) ({}); rendezvous {}:{}", self.nprocs, first.num_nodes, layout,
                    first.place.node_ip, port)
        fn_ref, cfg_ref = self.ray.put(fn), self.ray.put(cfg)  # serialised once, not once per rank
        cwd = _driver_cwd()
        return {actor.run.remote(fn_ref, cfg_ref, self.opts, topology_for(a, self.nprocs, first.place.node_ip, port),
                                 a.visible_devices, cwd): a.rank
                for actor, a in zip(self.actors, self.assignments, strict=True)}

    def wait(self, refs: dict[Any, int]) -> None:
        """Collect the ranks' answers until all returned or one failed (then give the others a moment)."""
        pending = dict(refs)
        settle_until: float | None = None
        while pending and (settle_until is None or time.monotonic() < settle_until):
            self.check_interrupt()
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=0.2 if settle_until else POLL_S)
            self.check_interrupt()
            for ref in ready:
                self._receive(ref, pending.pop(ref))
            if self.failures and settle_until is None:
                settle_until = time.monotonic() + protocol.SETTLE_WINDOW  # the root cause from its consequences

    def _receive(self, ref: Any, rank: int) -> None:
        try:
            kind, data = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            self.failures.append(self._actor_died(rank, exc))
            return
        except self.ray.exceptions.RayError as exc:
            place = self.assignments[rank].place
            self.failures.append(Failure(rank, place.host, place.pid, type(exc).__name__, _first_lines(exc)))
            return
        if kind == "ok":
            self.returned.append(rank)
            if rank == 0:
                self.result = data
        elif kind == "exit":
            self.early_exits.append(data)
        else:
            self.failures.append(data)

    def _actor_died(self, rank: int, exc: BaseException) -> Failure:
        place = self.assignments[rank].place
        text = _first_lines(exc, 6)
        node = next((n for n in self._nodes() if n.get("NodeID") == place.node_id), None)
        node_dead = (node is not None and not node.get("Alive", True)) or "node has died" in text.lower() \
            or "node died" in text.lower()
        if node_dead:
            why = (node or {}).get("DeathReasonMessage") or "no reason given"
            return Failure(rank, place.node_ip, place.pid, "NodeDied",
                           f"the Ray node {place.node_ip} ({place.node_id[:8]}) running this rank died ({why})",
                           traceback=text)
        return Failure(rank, place.node_ip, place.pid, "ActorDied",
                       "this rank's Ray actor died without reporting (killed, out of memory, or a crash in native "
                       "code; see its log above)", traceback=text)

    def _nodes(self) -> list[dict[str, Any]]:
        try:
            return list(self.ray.nodes())
        except Exception:  # noqa: BLE001 - only to say whether the node died
            return []

    def teardown(self) -> None:
        """Kill every actor and remove the placement group (after a result too: nothing stays on the cluster)."""
        self.tearing_down = True
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group  # deferred: part of ray

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster is gone
                pass

    def outcome(self) -> Any:
        """Rank 0's value, or the `WorkerError` of the first failure (root cause first)."""
        if not self.failures:
            return self.result
        raise WorkerError(protocol.root_cause_first(
            self.failures, self.early_exits, timeout_s=self.opts.timeout.total_seconds(), returned=self.returned,
            failed=[f.rank for f in self.failures]))


def _first_lines(exc: BaseException, n: int = 3) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return "\n".join(lines[:n]) or type(exc).__name__


def launch(fn: Callable[..., Any], cfg: Any, opts: Options) -> Any:
    """Run ``fn(cfg, ctx)`` as Ray actors on the Ray cluster and return rank 0's value (or raise `WorkerError`).

    One Ctrl-C kills the actors and raises ``KeyboardInterrupt`` within about `POLL_S` (`RayJob.on_sigint`); any
    other way out of the driver's call kills them too: the actors and the placement group never outlive it.
    """
    ray = import_ray()
    _connect(ray)
    gpus_in_cluster = float(ray.cluster_resources().get("GPU", 0))
    nprocs = ray_nprocs(opts, os.environ, gpus_in_cluster)
    job = RayJob(ray, nprocs, 1 if gpus_in_cluster >= 1 else 0, opts)
    with _interruptible(job):
        try:
            job.place()
            refs = job.start(fn, cfg)
            job.wait(refs)
        except KeyboardInterrupt:
            logger.warning("interrupted: killing the {} Ray actor(s) of the job", nprocs)
            raise
        finally:
            job.teardown()
    return job.outcome()


@contextlib.contextmanager
def _interruptible(job: RayJob) -> Iterator[None]:
    """`RayJob.on_sigint` as the SIGINT handler for the block, where Python's own is in place (in the main
    thread; a handler of the user's is left alone), so that one Ctrl-C always ends the job (`RayJob.on_sigint`)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = preemption.set_handlers({signal.SIGINT: job.on_sigint})
    try:
        yield
    finally:
        preemption.restore_handlers(previous)

