"""How a call of a decorated function will run: decided once, by one pure function, for everyone who asks.

    plan_call(opts, env, argv, gpus, nested) -> CallPlan
      ├─ nested      inside a running distfn function or worker: the decorator refuses (NestedLaunchError)
      ├─ ray         launcher="ray": the ranks are Ray actors on the cluster (distfn.launch.ray; its rules, which
      │              planning asks, are distfn.launch.ray_rules)
      ├─ pernode     one task per node, more processes wanted: this node's workers get global ranks
      │              (distfn.launch.pernode's rule, distfn.launch.local starts them)
      ├─ in-place    an external launcher (torchrun / srun / mpirun / env://) started this rank: run it here
      ├─ one-process mode single/dp, or a count of 1: run here as the only rank
      └─ spawn       otherwise: start nprocs local workers (distfn.launch.local), return rank 0's value

Three callers ask the same question and get the same object: the decorator executes the plan at each call, the
fork server is started at decoration only where the plan says a launch will happen (`CallPlan.launches`), and
``distfn env`` prints it. `plan_call` reads only its arguments: no ``os.environ``, no name lookup, no process,
no log line (`distfn.topology.detect` is called without host resolution; the executor resolves the master host
and agrees on an MPI rendezvous afterwards, `CallPlan.at`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Literal

import attrs

from . import topology
from .errors import ConfigError
from .launch import pernode
from .options import NPROCS_ENV, Options, default_nprocs, fixed_nprocs, requested_nprocs, with_env
from .topology import Topology

__all__ = ["KINDS", "CallPlan", "CountSource", "Kind", "Note", "plan_call"]

Kind = Literal["nested", "ray", "pernode", "in-place", "one-process", "spawn"]
#: Every way a call can run (`CallPlan.kind`).
KINDS: Final[tuple[Kind, ...]] = ("nested", "ray", "pernode", "in-place", "one-process", "spawn")

#: What decided a plan's ``nprocs`` (`CallPlan.counted_by`), beside its wording (`CallPlan.source`): the
#: ``DISTFN_NPROCS`` variable, the decorator's ``nprocs=``, a one-process mode, ``devices=``, the visible GPUs,
#: no CUDA (one process), the external launcher, the Ray cluster, or nothing (a nested call).
CountSource = Literal["DISTFN_NPROCS", "nprocs=", "mode", "devices", "gpus", "no-cuda", "launcher", "ray-cluster",
                      "nested"]


@attrs.frozen
class Note:
    """Something the call's leading process logs: an option that has no effect the way this call runs."""

    level: Literal["INFO", "WARNING"]
    text: str


@attrs.frozen
class CallPlan:
    """How one call runs (`plan_call`).

    Attributes:
        kind: one of `KINDS`.
        opts: the options the call runs with: the environment's overrides applied (`distfn.options.with_env`),
            and ``max_restarts`` dropped where it has no effect (a per-node launch).
        nprocs: processes this machine runs for the call: the workers started here (spawn, pernode), 1 (in-place,
            one-process), the actors when the count is given (ray; ``None``: one per GPU of the cluster) or 0
            (nested).
        source: where ``nprocs`` comes from, in words (``DISTFN_NPROCS``, ``visible CUDA devices``, ...).
        counted_by: the same as a value to test (`CountSource`); ``source`` is only for people to read.
        topology: this process's place under an external launcher (in-place, pernode: the launching task's),
            `Topology.local` for one-process, else ``None``.
        layout: this node's part of a per-node launch, else ``None``.
        reason: why the call runs this way, one sentence.
        notes: what the leading process logs at the call (options without effect here).
    """

    kind: Kind
    opts: Options
    nprocs: int | None
    source: str
    reason: str
    counted_by: CountSource
    topology: Topology | None = None
    layout: pernode.NodeLayout | None = None
    notes: tuple[Note, ...] = ()

    @property
    def launches(self) -> bool:
        """Whether the call starts worker processes on this machine (spawn, pernode): what the fork server needs."""
        return self.kind in ("spawn", "pernode")

    @property
    def world_size(self) -> int | None:
        """Ranks of the whole job (``None`` where the Ray cluster decides)."""
        if self.layout is not None:
            return self.layout.world_size
        if self.topology is not None:
            return self.topology.world_size
        return self.nprocs if self.kind == "spawn" else None

    def local_ranks(self) -> list[tuple[int, int]]:
        """``(global rank, local rank)`` of every rank this machine runs for the call (none for ray and nested)."""
        if self.layout is not None:
            return [(self.layout.node_rank * self.layout.local_world_size + i, i)
                    for i in range(self.layout.local_world_size)]
        if self.topology is not None:
            return [(self.topology.rank, self.topology.local_rank)]
        if self.kind == "spawn" and self.nprocs is not None:
            return [(r, r) for r in range(self.nprocs)]
        return []

    def at(self, resolved: Topology) -> CallPlan:
        """This plan with the launcher's topology replaced by ``resolved`` (its rendezvous agreed, its host
        checked), the per-node layout meeting there too."""
        layout = None if self.layout is None else self.layout.at(resolved.master_addr, resolved.master_port)
        return attrs.evolve(self, topology=resolved, layout=layout)


def _restart_note(opts: Options, why: str) -> tuple[Note, ...]:
    """The one wording of "max_restarts does nothing here", for every path where it does nothing."""
    if not opts.max_restarts:
        return ()
    return (Note("WARNING", f"max_restarts={opts.max_restarts} has no effect here: {why}"),)


def _source(opts: Options, env: Mapping[str, str], gpus: int | None) -> tuple[CountSource, str]:
    """What decides the count, as a value and in words."""
    if requested_nprocs(opts, env) is not None:
        return ("DISTFN_NPROCS", NPROCS_ENV) if env.get(NPROCS_ENV, "").strip() else ("nprocs=", "nprocs=")
    if opts.one_process:
        return "mode", f"mode={opts.mode!r}"
    if opts.devices is not None:
        return "devices", f"devices={list(opts.devices)}"
    return ("gpus", "visible CUDA devices") if gpus else ("no-cuda", "no CUDA: one process")


def _ray(opts: Options, env: Mapping[str, str]) -> CallPlan:
    # deferred: only for launcher="ray"; its three attrs classes cost ~2 ms at import (python -X importtime),
    # paid by every decorating script otherwise
    from .launch import ray_rules

    ray_rules.check_options(opts)
    nprocs = fixed_nprocs(opts, env)
    where = env.get("RAY_ADDRESS") or "the one started on this machine (RAY_ADDRESS unset), else a new one"
    by, source = _source(opts, env, None) if nprocs is not None else ("ray-cluster", "one per GPU of the Ray cluster")
    return CallPlan(kind="ray", opts=opts, nprocs=nprocs, source=source, counted_by=by,
                    reason=f"launcher='ray': the ranks run as Ray actors on the Ray cluster at {where}",
                    notes=_restart_note(opts, "Ray starts the ranks as actors; restart the job from the driver"))


def _per_node_count(opts: Options, env: Mapping[str, str]) -> CountSource:
    """What decides a per-node launch's workers per node (as `distfn.launch.pernode` reads it)."""
    if requested_nprocs(attrs.evolve(opts, nprocs=None), env) is not None:
        return "DISTFN_NPROCS"
    return "devices" if opts.devices is not None else "gpus"


def _under_launcher(opts: Options, env: Mapping[str, str], topo: Topology, gpus: Callable[[], int]) -> CallPlan:
    if opts.one_process and topo.world_size > 1:
        raise ConfigError(f"mode={opts.mode!r} runs one process, but {topo.launcher} started "
                          f"{topo.world_size}; use mode='ddp' or launch one process")
    layout = pernode.plan(topo, opts, env, gpus)
    if layout is not None:
        return CallPlan(kind="pernode", opts=pernode.prepare(layout, opts), nprocs=layout.local_world_size,
                        source=layout.source, counted_by=_per_node_count(opts, env), topology=topo, layout=layout,
                        reason=pernode.describe(layout),
                        notes=_restart_note(opts, "a node cannot restart its workers alone in a per-node launch; "
                                                  "use the launcher's restarts") if layout.node_rank == 0 else ())
    notes: tuple[Note, ...] = ()
    if topo.rank == 0:
        requested = requested_nprocs(opts, env)
        if requested is not None and requested != topo.world_size:
            notes += (Note("INFO", f"nprocs={requested} is ignored: {topo.launcher} started {topo.world_size} "
                                   "processes"),)
        notes += _restart_note(opts, f"{topo.launcher} started the processes; use its own restarts "
                                     "(torchrun --max-restarts)")
    return CallPlan(kind="in-place", opts=opts, nprocs=1, source=f"{topo.launcher} started this process",
                    counted_by="launcher",
                    topology=topo, reason=topo.reason, notes=notes)


def plan_call(opts: Options, env: Mapping[str, str], argv: Sequence[str], gpus: Callable[[], int],
              nested: bool) -> CallPlan:
    """How a call of a function decorated with ``opts`` runs in a process with environment ``env`` and arguments
    ``argv``; ``gpus`` counts the visible GPUs (asked only when the count depends on them); ``nested``: a distfn
    function is running in this process already (`distfn.process.in_worker`).

    Pure: reads nothing but its arguments, resolves no host, starts nothing, logs nothing.

    Raises:
        ConfigError: an environment override that is not valid, or options that cannot run this way.
        LauncherError: launcher variables that are missing or contradict each other (named, with the fix).
    """
    plan = _plan_call(opts, env, argv, gpus, nested)
    mesh, world = plan.opts.mesh, plan.world_size
    if mesh is not None and world is not None and plan.kind != "nested":
        # the mesh's sizes against the job's ranks, before any process starts (the ranks check again, all alike)
        where = plan.layout if plan.layout is not None else plan.topology
        mesh.resolve(world, num_nodes=where.num_nodes if where is not None else 1,
                     local_world_size=where.local_world_size if where is not None else None)
    return plan


def _plan_call(opts: Options, env: Mapping[str, str], argv: Sequence[str], gpus: Callable[[], int],
               nested: bool) -> CallPlan:
    opts = with_env(opts, env)  # DISTFN_PRECISION, DISTFN_LAUNCHER & co., as the call sees them
    if nested:
        return CallPlan(kind="nested", opts=opts, nprocs=0, source="", counted_by="nested",
                        reason="inside a running distfn function")
    if opts.launcher == "ray":
        return _ray(opts, env)
    topo = topology.detect(env, argv, opts.launcher)  # no host resolution: the executor checks the master host
    if topo is not None:
        return _under_launcher(opts, env, topo, gpus)
    counted: list[int] = []

    def count() -> int:
        counted.append(gpus())
        return counted[-1]

    nprocs = default_nprocs(opts, env, count)
    by, source = _source(opts, env, counted[-1] if counted else None)
    if nprocs == 1:
        return CallPlan(kind="one-process", opts=opts, nprocs=1, source=source, counted_by=by,
                        topology=Topology.local(),
                        reason=f"one process, run in place ({source})",
                        notes=_restart_note(opts, "one process runs in place; restarts need workers that distfn "
                                                  "starts (nprocs >= 2)"))
    return CallPlan(kind="spawn", opts=opts, nprocs=nprocs, source=source, counted_by=by,
                    reason=f"{topology.spawn_reason(env, opts.launcher)}: {nprocs} workers ({source})")
