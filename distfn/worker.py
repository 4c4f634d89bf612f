"""What every rank does around the user's function, whoever started the process.

Every path ends here: a worker of a distfn launcher (`distfn.launch.local`, `distfn.launch.ray`) and a
process started by torchrun / srun / mpirun (run
in place by ``decorator.py``). In order: set up logging and the stop signals, open the call's `distfn.run.Run`
(`Run.open`), pick and pin the device, size the CPU thread pool, seed, start the process group and connect the
run's services to it (`Run.connect`: check-in, fingerprint, hang responder), make the `Context` holding the run,
call the function, and always close the run (`Run.fail` first after a failure, then the report) and leave the
process group. Which services a run has, and their order, is the run's business, not this module's.

The nested-launch guard (`in_worker`, `mark_active`, `WORKER_NAME`) and the legacy ``--local-rank`` rule
(`adopt_legacy_local_rank`) live in `distfn.process`, which decoration imports without this module's machinery;
they are re-exported here, where the bootstrap sets the guard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger

from . import devices, failures, hangs, logs, mesh, preemption, rendezvous
from .context import Context
from .options import restart_attempt
from .process import WORKER_NAME as WORKER_NAME
from .process import adopt_legacy_local_rank as adopt_legacy_local_rank
from .process import in_worker as in_worker
from .process import mark_active as mark_active
from .rng import seed_all
from .run import Run

if TYPE_CHECKING:
    from .options import Options
    from .topology import Topology


def seed_everything(seed: int) -> None:
    """Seed ``random``, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    seed_all(seed)


def size_thread_pool(local_world_size: int) -> str:
    """Give each of the node's processes ``cpus // local_world_size`` threads unless OMP_NUM_THREADS is set,
    so N processes on one machine do not oversubscribe its cores. Returns a phrase for the start-up log."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"{torch.get_num_threads()} CPU threads per process (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    if local_world_size <= 1:
        return f"{torch.get_num_threads()} CPU threads"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // local_world_size)
    torch.set_num_threads(threads)
    return f"{threads} CPU thread(s) per process ({cpus} CPUs / {local_world_size} processes on this node)"


def _prepare(opts: Options, topology: Topology) -> tuple[torch.device, str]:
    """Pick and pin the device, size the thread pool and seed; returns the device and the threads' phrase."""
    device = devices.select_device(opts.mode, topology, opts.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
    threads = size_thread_pool(topology.local_world_size)
    if opts.seed is not None:
        seed_everything(opts.seed + topology.rank if opts.rank_seeds else opts.seed)
    return device, threads


def _join_group(opts: Options, topology: Topology, device: torch.device, store: Any,
                reuse: bool = False) -> tuple[str, bool]:
    """Start this rank's process group (``reuse``: keep the one an earlier call of a kept-alive job left up, whose
    options were the same: `distfn.launch.pool`); returns its backend and whether it was kept."""
    # fsdp={"cpu_offload": True} on GPUs needs gloo beside NCCL; without fsdp options (every other mode) it is kept.
    # `distfn.fsdp` only where there are fsdp options: its import (the sharded state dict's checkpoint code with it,
    # ~10 ms of CPU after torch) is no DDP job's, in the launching process or in any rank.
    backend = opts.backend or devices.default_backend(device)
    if opts.fsdp is not None:
        from . import fsdp

        backend = fsdp.required_backend(opts.fsdp, backend)
    if reuse and dist.is_initialized():
        return backend, True
    if store is None and topology.launcher == "local" and opts.init_method is None:
        store = dist.HashStore()  # a world of one needs no network at all
    # under NCCL a little longer than distfn's timeout, so the hang report is collected before the watchdog aborts
    rendezvous.init_process_group(topology, backend, hangs.group_timeout(opts.timeout, backend), store=store,
                                  init_method=opts.init_method, device=device)
    return backend, False


#: The mesh built on this process's process group, by its layout: a later call on kept-alive ranks (the group
#: kept, `distfn.launch.pool`) with the same layout reuses it instead of making the mesh's groups again.
_built_meshes: dict[Any, mesh.Mesh] = {}


def leave_group(*, failed: bool) -> None:
    """Leave the process group (`distfn.rendezvous.leave_process_group`) and drop the meshes built on it.

    The cached meshes hold the group: kept, they kept its C++ object and its threads (gloo's work loops, NCCL's
    communicators) alive after ``destroy_process_group`` until the interpreter's own end, where a gloo thread
    releasing a finished collective's tensor took the GIL during finalisation and aborted the process
    ("terminate called without an active exception", SIGABRT after the function had returned; 1 run in 10 of a
    torchrun job under load).
    """
    _built_meshes.clear()
    rendezvous.leave_process_group(failed=failed)


def _mesh(opts: Options, topology: Topology, device: torch.device, backend: str, life: Run, kept: bool) -> None:
    """The run's named mesh (``mesh=``, else one ``dp_shard`` dimension over every rank) as ``life.mesh``, built
    by every rank at the same point of start-up: a multi-dimensional mesh makes process groups. Sizes that do not
    fit the world are the same `ConfigError` on every rank, before any group is made (the plan checked them
    already where it knew the world size). ``kept``: the process group is an earlier call's, whose mesh of the same
    layout is reused.

    The default mesh of a run that does not shard (DDP, no ``mesh=``) is made at its first use instead
    (`distfn.run.Run.defer_mesh`: ~5 ms of CPU per rank saved on every launch, issue 46 item 2): torch builds it on
    the default group, no collective, so one rank may ask for ``ctx.mesh`` alone. Not with a gloo group where CUDA
    is available: torch then makes a new group for it ("mesh_default"), which every rank must join together."""
    spec = opts.mesh if opts.mesh is not None else mesh.MeshSpec(sizes=(("dp_shard", -1),))
    layout = spec.resolve(topology.world_size, num_nodes=topology.num_nodes,
                          local_world_size=topology.local_world_size)
    if not kept:
        _built_meshes.clear()  # a new process group: the meshes of the old one are gone with it

    def built() -> mesh.Mesh:
        made = _built_meshes.get((layout, device.type))
        if made is None:
            made = _built_meshes[(layout, device.type)] = mesh.build(layout, device.type)
        return made

    if (opts.mesh is None and not opts.shards_state and layout.names == ("dp_shard",)
            and not ("gloo" in backend and torch.cuda.is_available())):
        life.defer_mesh(built)
    else:
        life.mesh = built()
    if layout.tp_size > 1:  # a tp group waits for its slowest member inside forward: not a straggler of itself
        life.timings.groups = tuple(tuple(g) for g in layout.groups(("tp",)))
    if opts.mesh is not None and topology.rank == 0:
        logger.info("mesh: {} ({} data-parallel rank(s), tensor parallel {})", layout.describe(), layout.dp_size,
                    layout.tp_size)


def _requeue_if_stopped(opts: Options, topology: Topology, ctx: Context) -> None:
    """``requeue=True``: the function returned after a stop signal, so rank 0 requeues the Slurm job."""
    if not (opts.requeue and ctx.run.stop.stopped):
        return
    ctx.barrier()  # every rank is done (its checkpoint written) before Slurm ends this run for the requeue
    if topology.rank == 0:
        preemption.requeue(os.environ, signal_name=ctx.run.stop.signal)


def _report(exc: BaseException, topology: Topology, report: Callable[[BaseException], None] | None) -> None:
    """Deliver this rank's failure: to the launching process (``report``), else, under torchrun / srun / mpirun,
    where no distfn parent collects it, in place (`distfn.failures.report_in_place`)."""
    if report is not None:
        report(exc)
    elif topology.launcher not in ("spawn", "local"):
        failures.report_in_place(topology.rank, exc)


def _context(topology: Topology, *, device: torch.device, backend: str | None, opts: Options, log: Any,
             run: Run) -> Context:
    """The `Context` of this rank: its place in ``topology``, its device and backend, the call's options (a
    function here, not a `Context` constructor: the API page shows `Context` as the user meets it)."""
    return Context(rank=topology.rank, local_rank=topology.local_rank, world_size=topology.world_size,
                   local_world_size=topology.local_world_size, node_rank=topology.node_rank,
                   num_nodes=topology.num_nodes, device=device, backend=backend, mode=opts.mode,
                   launcher=topology.launcher, seed=opts.seed, log=log, precision=opts.precision,
                   restart=restart_attempt(os.environ), run=run)


def _log_start(log: Any, topology: Topology, device: Any, backend: str | None, threads: str, kept: bool) -> None:
    """Rank 0's one start-up line: who launched the job and why, the world, the device, the backend (``kept``: a
    later call on kept-alive ranks, which said it at their first call: a debug line, not the same line again)."""
    if topology.rank == 0:
        # "self-spawned", not the launcher's name "spawn", which would read as the start method (issue 44)
        (log.debug if kept else log.info)("launcher: {} ({}); world size {}, device {}, backend {}, {}",
                 "self-spawned" if topology.launcher == "spawn" else topology.launcher,
                 topology.reason, topology.world_size, device, backend, threads)


def run(fn: Callable[[Any, Context], Any], cfg: Any, opts: Options, topology: Topology, *, store: Any = None,
        report: Callable[[BaseException], None] | None = None, keep_group: bool = False) -> Any:
    """Bootstrap this rank, call ``fn(cfg, ctx)`` and return its value; the process group is left (``keep_group``:
    kept up after a success, for the next call of a kept-alive job, and reused if one is up).

    A failure is reported before the process group is torn down (aborted, not destroyed: NCCL's destroy waits
    for pending work, see `distfn.rendezvous.leave_process_group`): through ``report`` when given (the spawn
    entry passes its pipe to the launching process), else, under torchrun / srun / mpirun, by
    `distfn.failures.report_in_place`. The run's services start and end in `distfn.run.Run`'s lifecycle.
    """
    mark_active(True)
    log = logs.setup(topology.rank, topology.world_size)
    # SIGTERM/SIGUSR2 -> ctx.should_stop (main thread only); a function that polls it is not interrupted
    stop, stop_handlers = preemption.install(opt_in=preemption.polls(fn))
    life, backend, error, kept = Run.open(opts, cfg, topology, stop=stop), None, None, False
    try:
        device, threads = _prepare(opts, topology)
        if opts.multi_rank:
            backend, kept = _join_group(opts, topology, device, store, reuse=keep_group)
            life.connect(cfg, backend=backend, report=report, bootstrap=(run,))
            _mesh(opts, topology, device, backend, life, kept)
        _log_start(log, topology, device, backend, threads, kept)
        ctx = _context(topology, device=device, backend=backend, opts=opts, log=log, run=life)
        result = fn(cfg, ctx)
        life.saves.wait()  # an asynchronous ctx.save completes (or fails this rank) before the group goes
        _requeue_if_stopped(opts, topology, ctx)
        return result
    except BaseException as exc:
        error = exc
        life.fail(exc)  # the services' failure steps (the hang report, the last save, tracking's FAILED) ...
        _report(exc, topology, report)  # ... before this: once the launcher knows, it stops this process
        raise
    finally:
        life.close(error)  # peers waiting in a check-in learn that this rank will never join it
        if backend is not None and (error is not None or not keep_group):
            life.mesh = None  # the mesh holds the group (see leave_group)
            leave_group(failed=error is not None)
        logs.teardown()
        preemption.restore_handlers(stop_handlers)
        mark_active(False)
