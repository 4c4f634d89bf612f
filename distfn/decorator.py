"""``@distributed``: validate everything at decoration time, then at call time choose how to run.

    train(cfg) ─┬─ inside a running worker?        → NestedLaunchError
                ├─ one task per node, more wanted? → spawn them on every node, global ranks (distfn.pernode)
                ├─ an external launcher detected?  → run in place, one rank per process (torchrun/srun/mpirun)
                ├─ one process (mode single/dp, or nprocs == 1) → run in place
                └─ otherwise                       → spawn nprocs workers, return rank 0's value

The arguments themselves (their validation, the process-count rule) are `distfn.options`; the checks before
a launch are `distfn.preflight`; the launch is `distfn.spawn`; every rank runs `distfn.worker.run`.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import torch
from loguru import logger

from . import devices, logs, pernode, preflight, ray_launcher, rendezvous, shipping, spawn, topology, worker
from .context import Context
from .errors import ConfigError, NestedLaunchError
from .options import (
    DEFAULT_TIMEOUT,
    MODES,
    LauncherName,
    Mode,
    Options,
    StartMethod,
    default_nprocs,
    make_options,
    requested_nprocs,
    with_env,
)

__all__ = ["DEFAULT_TIMEOUT", "MODES", "Options", "distributed"]

R = TypeVar("R")


def _check_signature(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise ConfigError(f"@distributed decorates a function, got {fn!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables: nothing to check
    try:
        sig.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"{getattr(fn, '__qualname__', fn)}{sig} cannot be called as fn(cfg, ctx); distfn calls the decorated "
            "function with two positional arguments: your cfg and the Context. Define it as `def fn(cfg, ctx):`."
        ) from None


def _check_backend_fits(opts: Options) -> None:
    if opts.backend is not None and "nccl" in opts.backend.lower() and devices.visible_gpus() == 0:
        raise ConfigError(f"backend={opts.backend!r} needs CUDA GPUs, but torch sees none "
                          f"(torch {torch.__version__}); use backend='gloo' or leave it unset")


def _log_ignored(opts: Options, topo: topology.Topology | None) -> None:
    """Say which options cannot apply when the function runs in place (under ``topo``'s launcher, or as the
    only process when ``topo`` is ``None``)."""
    if topo is not None:
        requested = requested_nprocs(opts, os.environ)
        if requested is not None and requested != topo.world_size and topo.rank == 0:
            logger.info("nprocs={} is ignored: {} started {} processes", requested, topo.launcher, topo.world_size)
    if opts.max_restarts and (topo is None or topo.rank == 0):
        why = (f"{topo.launcher} started the processes; use its own restarts (torchrun --max-restarts)" if topo
               else "one process runs in place; restarts need workers that distfn starts (nprocs >= 2)")
        logger.warning("max_restarts={} has no effect here: {}", opts.max_restarts, why)


def _call(fn: Callable[..., R], sendable: Callable[..., R], opts: Options, cfg: Any) -> R:
    """Run one job: ``fn`` is the user's function, ``sendable`` what spawn may pickle to reach it."""
    name = getattr(fn, "__qualname__", "the function")
    opts = with_env(opts, os.environ)  # DISTFN_PRECISION & co., read at each call
    if worker.in_worker():
        raise NestedLaunchError(
            f"{name}() was called from inside a running distfn worker. A decorated function starts a whole job; "
            "call the undecorated function instead (available as `decorated.__wrapped__`). If this comes from a "
            "script being re-imported by a worker, put the call under `if __name__ == \"__main__\":`."
        )
    if opts.launcher == "ray":  # the ranks are Ray actors on the cluster's nodes, not processes of this machine
        return ray_launcher.launch(fn, cfg, opts)
    devices.apply_visible_devices(opts.devices)
    _check_backend_fits(opts)
    topo = topology.detect(os.environ, sys.argv, opts.launcher)
    if topo is not None:
        topo = rendezvous.resolve_rendezvous(topo)  # only multi-node MPI without MASTER_ADDR needs it
        if opts.one_process and topo.world_size > 1:
            raise ConfigError(f"mode={opts.mode!r} runs one process, but {topo.launcher} started "
                              f"{topo.world_size}; use mode='ddp' or launch one process")
        layout = pernode.plan(topo, opts, os.environ, devices.visible_gpus)
        if layout is not None:  # one task per node: start the node's ranks here (distfn.pernode)
            preflight.check_main_guard(name)
            return spawn.launch(sendable, cfg, pernode.prepare(layout, opts), layout.local_world_size, layout)
        _log_ignored(opts, topo)
        return worker.run(fn, cfg, opts, topo)
    nprocs = default_nprocs(opts, os.environ, devices.visible_gpus)
    if nprocs == 1:
        _log_ignored(opts, None)
        return worker.run(fn, cfg, opts, topology.Topology.local())
    preflight.check_main_guard(name)
    return spawn.launch(sendable, cfg, opts, nprocs)


def _decorate(func: Callable[..., R], opts: Options, origin: Callable[..., R] | None = None) -> Callable[..., R]:
    """The decorated ``func``. ``origin``: the wrapper that ``fn.options(...)`` derived this one from; it stays
    what spawn pickles (by name, it is the one a worker finds in the user's module; the options travel apart)."""
    if origin is None:
        _check_signature(func)
    worker.adopt_legacy_local_rank()  # torch.distributed.launch's --local-rank=N, before the user's argparse

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        if kwargs or len(args) > 1 or any(isinstance(a, Context) for a in args):
            given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
            raise ConfigError(
                f"{func.__qualname__}() takes one argument, cfg (got {', '.join(given)}); "
                "distfn creates and passes ctx itself. Call it as "
                f"{func.__qualname__}(cfg) or {func.__qualname__}()."
            )
        with logs.launcher():  # one log format from here on ("launcher", then "rank r/n" in the ranks)
            return _call(func, origin or wrapper, opts, args[0] if args else None)

    def options(**changes: Any) -> Callable[..., R]:
        """The same function with some arguments of ``@distributed`` changed for the calls made through it,
        checked like the decorator's own: ``train.options(precision="16" if cfg.amp else "32")(cfg)``."""
        return _decorate(func, make_options(changes, opts), origin or wrapper)

    wrapper.distfn_options = opts  # type: ignore[attr-defined]
    wrapper.options = options  # type: ignore[attr-defined]
    shipping.start_early(opts)  # a fork server while forking is still safe, if calling it will start workers
    return wrapper


@overload
def distributed(fn: Callable[[Any, Any], R], /) -> Callable[..., R]: ...
@overload
def distributed(
    fn: None = None,
    /,
    *,
    mode: Mode = "ddp",
    nprocs: int | None = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    devices: str | Sequence[int] | None = None,
    start_method: StartMethod = "auto",
    launcher: LauncherName = "auto",
    init_method: str | None = None,
    precision: str | int = "32",
    fsdp: Mapping[str, Any] | None = None,
    max_restarts: int = 0,
    requeue: bool = False,
) -> Callable[[Callable[[Any, Any], R]], Callable[..., R]]: ...


def distributed(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Make ``fn(cfg, ctx)`` a distributed job: ``fn(cfg)`` then runs it on every rank and returns a value.

    Keyword Args:
        mode: ``"ddp"`` (one process per device, DistributedDataParallel), ``"fsdp"`` (one process per device,
            parameters, gradients and optimizer state sharded with FSDP2 ``fully_shard``; see docs/modes.md),
            ``"dp"`` (one process, ``nn.DataParallel`` over the visible GPUs) or ``"single"`` (one process, one
            device).
        nprocs: processes to self-spawn under ``python script.py``. Default: the number of visible GPUs
            (``len(devices)`` when given), or 1 without CUDA. ``DISTFN_NPROCS`` in the environment overrides it.
            Ignored (with a log line) under torchrun / srun / mpirun, whose world size wins. Where such a launcher
            started one task per node, ``DISTFN_NPROCS`` (or, without ``nprocs``, the visible GPUs) is the number
            of workers distfn starts on every node (see docs/launching.md, "One task per node").
        backend: process-group backend; default ``"nccl"`` on CUDA devices, else ``"gloo"``.
        seed: when given, every rank seeds ``random``, NumPy, torch and CUDA with it before ``fn`` runs, so
            models initialise identically on all ranks.
        timeout: seconds (or a ``timedelta``) for collectives and rendezvous; default 30 minutes.
        devices: GPUs to use, e.g. ``"0,5"`` or ``[0, 5]``, applied through ``CUDA_VISIBLE_DEVICES`` (program
            index 1 is then physical GPU 5). Rank r uses ``cuda:(local_rank % device_count)``.
        start_method: ``"auto"`` (fork when this process has no CUDA context and no extra threads, else
            forkserver: distfn's fork server, a copy of this process made at decoration, see docs/notebooks.md),
            ``"fork"``, ``"forkserver"`` or ``"spawn"``.
        launcher: ``"auto"`` detects torchrun / MPI / SLURM; ``"spawn"``, ``"torchrun"``, ``"slurm"``,
            ``"mpi"`` force one (a forced launcher whose variables are missing is an error naming them);
            ``"ray"`` runs each rank as a Ray actor on the Ray cluster (``RAY_ADDRESS``), see docs/launching.md.
        init_method: ``None`` (distfn's own rendezvous), ``"env://"``, ``"tcp://host:port"`` or
            ``"file:///shared/path"``.
        precision: ``"32"`` (float32, the default), ``"bf16"`` (bfloat16 autocast; works on CPUs too) or
            ``"16"`` (float16 autocast with a GradScaler). It applies where the code uses ``with ctx.autocast():``,
            ``ctx.backward(loss)`` and ``ctx.step(optimizer)``; the model's weights stay float32.
        fsdp: options of ``mode="fsdp"``: ``min_params``, ``module_classes``, ``mixed_precision``,
            ``cpu_offload``, ``reshard_after_forward``, ``save_timeout`` (see ``distfn.fsdp.FsdpOptions``).
        max_restarts: how many times a self-spawned job that failed (an exception, a killed worker, a collective
            timeout) is started again on fresh workers and a fresh rendezvous, after a back-off of 1, 2, 4 ...
            (at most 30) seconds; default 0. ``ctx.restart`` says which attempt runs. A `ConfigError` or a stop
            from outside (Ctrl-C, SIGTERM) is never retried; the final `WorkerError` lists every attempt's root
            cause. Under torchrun use ``--max-restarts`` (``ctx.restart`` follows it).
        requeue: under Slurm, when the job stopped because of a stop signal (``ctx.should_stop`` became true:
            ``#SBATCH --signal=USR2@T``, SIGTERM at a time limit or preemption) and the function then returned,
            rank 0 puts the job back in the queue once (``scontrol requeue``); the requeued job resumes from its
            newest checkpoint. Never after a normal end or a failure. Default False.

    Raises:
        ConfigError: at decoration time, for any invalid argument or a function that cannot take
            ``(cfg, ctx)``.

    The caller gets rank 0's return value (tensors moved to the CPU) when distfn spawned the workers; under an
    external launcher every process gets its own. A failing worker raises ``distfn.WorkerError``.

    Options at run time: ``fn.options(**changes)`` returns the function with some of these arguments changed
    (checked the same way), e.g. ``train.options(precision="16" if cfg.use_amp else "32")(cfg)``; and the
    environment overrides them at each call: ``DISTFN_NPROCS``, ``DISTFN_PRECISION``, ``DISTFN_BACKEND``,
    ``DISTFN_START_METHOD``, ``DISTFN_TIMEOUT`` (seconds), ``DISTFN_MAX_RESTARTS``, ``DISTFN_REQUEUE`` (1/0),
    ``DISTFN_LAUNCHER``, over
    both the decorator and ``fn.options``.
    """
    opts = make_options(options)
    if fn is not None:
        return _decorate(fn, opts)
    return functools.partial(_decorate, opts=opts)
