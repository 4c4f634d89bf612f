"""A call of a decorated function, executed: its plan (`distfn.plan.CallPlan`, made by `distfn.decorator`) run.

    run_call(fn, sendable, cfg, plan)
      ├─ ray         → the ranks as Ray actors (distfn.launch.ray)
      ├─ pernode     → this node's workers with global ranks (distfn.launch.pernode + launch.local)
      ├─ in-place    → run here, one rank per process (torchrun/srun/mpirun/env://)
      ├─ one-process → run here as the only rank
      └─ spawn       → start nprocs local workers, return rank 0's value (distfn.launch.local)

Its own module, apart from the decorator, because everything a launch needs loads here: the launchers, the rank
bootstrap (`distfn.worker`), the process-group machinery, ~60 ms after torch (``python -X importtime``, with the
caller's objects frozen as a call has them: `distfn.process.frozen_heap`). A script that only decorates does not
pay for it; `distfn.decorator` imports this module at the first call, and the fork server imports it before it
forks a worker (`distfn.launch.forkserver`). The checkpoint writer and reader load at the first save or load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from loguru import logger

from . import devices, failures, preflight, rendezvous, topology, worker
from .context import Context
from .errors import ConfigError
from .launch import forkserver, local, pernode
from .options import Options
from .plan import CallPlan

__all__ = ["check_arguments", "run_call"]

R = TypeVar("R")


def check_arguments(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A decorated function takes one argument, ``cfg``: anything else (``ctx`` among them) is a `ConfigError`."""
    if kwargs or len(args) > 1 or any(isinstance(a, Context) for a in args):
        given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
        raise ConfigError(
            f"{func.__qualname__}() takes one argument, cfg (got {', '.join(given)}); "
            "distfn creates and passes ctx itself. Call it as "
            f"{func.__qualname__}(cfg) or {func.__qualname__}()."
        )


def _check_backend_fits(opts: Options) -> None:
    if opts.backend is not None and "nccl" in opts.backend.lower() and devices.visible_gpus() == 0:
        raise ConfigError(f"backend={opts.backend!r} needs CUDA GPUs, but torch sees none "
                          f"(torch {torch.__version__}); use backend='gloo' or leave it unset")


def _start_method(opts: Options) -> tuple[str, str, str | None]:
    """(start method, why, which fork server forks the workers) for a launch now; under forkserver the server
    runs when this returns. A server that cannot start is a `ConfigError` where forkserver was asked for by name,
    else the launch falls back to spawn."""
    method, reason = preflight.choose_start_method(opts.start_method)
    if method != "forkserver":
        return method, reason, None
    try:
        return method, reason, forkserver.ensure_server()
    except ConfigError as exc:
        if opts.start_method == "forkserver":
            raise
        logger.warning("{}; starting the workers with start method spawn instead", exc)
        return "spawn", f"{reason}; the fork server cannot start here", None


def _launch(sendable: Callable[..., R], cfg: Any, plan: CallPlan) -> R:
    """Start the plan's local workers (a self-spawned job, or this node's part of a per-node launch); with
    ``keep_alive`` a self-spawned job runs on the ranks an earlier call kept (`distfn.launch.pool`)."""
    preflight.check_main_guard(getattr(sendable, "__qualname__", "the function"))
    assert plan.nprocs is not None
    if plan.opts.keep_alive and plan.layout is None:
        from .launch import pool  # deferred: the kept-alive ranks' launcher side, for keep_alive calls only

        return pool.run(sendable, cfg, plan.opts, plan.nprocs, start=lambda: _start_method(plan.opts))
    method, reason, server = _start_method(plan.opts)
    if plan.layout is not None:
        pernode.announce(plan.layout)
        return local.launch(sendable, cfg, plan.opts, plan.nprocs, method=method, reason=reason, server=server,
                            topology=plan.layout.topology)
    return local.launch(sendable, cfg, plan.opts, plan.nprocs, method=method, reason=reason, server=server)


def run_call(fn: Callable[..., R], sendable: Callable[..., R], cfg: Any, plan: CallPlan) -> R:
    """Run one job as ``plan`` says (any kind but ``"nested"``, which the decorator refuses): ``fn`` is the user's
    function, ``sendable`` what spawn may pickle to reach it."""
    failures.install_excepthook()  # an uncaught error of this job then leads with the user's frame, not distfn's
    for note in plan.notes:
        logger.log(note.level, note.text)
    if plan.kind == "ray":  # the ranks are Ray actors on the cluster's nodes, not processes of this machine
        from .launch import ray as ray_launch  # deferred: its driver and rules, ~4 ms after torch, for Ray only

        return ray_launch.launch(fn, cfg, plan.opts)
    devices.apply_visible_devices(plan.opts.devices)
    _check_backend_fits(plan.opts)
    if plan.kind in ("in-place", "pernode"):
        assert plan.topology is not None
        # the I/O that planning leaves out: the master's name lookup, and an MPI rendezvous over mpi4py
        plan = plan.at(rendezvous.resolve_rendezvous(topology.check_master(plan.topology)))
    if plan.launches:
        return _launch(sendable, cfg, plan)
    assert plan.topology is not None
    return worker.run(fn, cfg, plan.opts, plan.topology)
