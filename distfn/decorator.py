"""``@distributed``: validate the arguments at decoration time, then at each call plan it and execute the plan.

    train(cfg) -> plan_call(...)  (distfn.plan: pure, the one answer to "how will this call run?")
                ├─ nested      → NestedLaunchError
                └─ any other   → distfn.execute.run_call (ray, pernode, in-place, one-process, spawn)

Decoration imports only what decorating needs (the options, the plan, the nested-launch guard in
`distfn.process`, the fork server): ``from distfn import distributed`` after ``import torch`` costs a few tens of
milliseconds (bench/bench_import.py). The launch machinery (`distfn.execute`: the launchers, the rank bootstrap,
the process-group code, ~60 ms more) is imported at the first call, the checkpoint code at the first save.

Decoration judges no environment variable and resolves no host: whatever is wrong with the environment is an
error of the call. The one thing decoration may start is the fork server, where the plan says the call will
launch workers here and the start method may be forkserver (`distfn.launch.forkserver`); that never fails the
decoration. The arguments themselves
(their validation, the process-count rule) are `distfn.options`; the checks before a launch are
`distfn.preflight`; every rank runs `distfn.worker.run`.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, TypeVar, overload

from . import devices, logs, process
from .errors import ConfigError, DistfnError, NestedLaunchError
from .launch import forkserver
from .options import DEFAULT_TIMEOUT, MODES, LauncherName, Mode, Options, StartMethod, closest, make_options
from .plan import CallPlan, plan_call

__all__ = ["DEFAULT_TIMEOUT", "MODES", "Options", "distributed"]

R = TypeVar("R")


def _check_signature(fn: Callable[..., Any]) -> None:
    if isinstance(fn, str):
        # `@distributed("ddp")`: options are keyword-only, so the string arrives where the function goes.
        mode = closest(fn, MODES)
        fix = f"write @distributed(mode={mode!r})" if mode is not None else \
            f"options are keywords, e.g. @distributed(mode='ddp'); valid modes are: {', '.join(map(repr, MODES))}"
        raise ConfigError(f"@distributed decorates a function, got the string {fn!r}: {fix}")
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


def _plan(opts: Options) -> CallPlan:
    """The plan of a call made here and now."""
    return plan_call(opts, os.environ, sys.argv, devices.visible_gpus, nested=process.in_worker())


def _call(fn: Callable[..., R], sendable: Callable[..., R], opts: Options, cfg: Any) -> R:
    """Run one job: ``fn`` is the user's function, ``sendable`` what spawn may pickle to reach it."""
    plan = _plan(opts)
    if plan.kind == "nested":
        raise NestedLaunchError(
            f"{getattr(fn, '__qualname__', 'the function')}() was called from inside a running distfn worker. A "
            "decorated function starts a whole job; call the undecorated function instead (available as "
            "`decorated.__wrapped__`). If this comes from a script being re-imported by a worker, put the call "
            "under `if __name__ == \"__main__\":`."
        )
    from . import execute  # deferred: the launch machinery, ~60 ms after torch (python -X importtime), loads at
    # the first call, not at decoration (issue 32 item 1)

    return execute.run_call(fn, sendable, cfg, plan)


def _forkserver_expected(start_method: StartMethod) -> bool:
    """Whether a launch may use the fork server: asked for by name, or ``"auto"``. With ``"auto"`` a script that
    is safe to fork now may not be by the call (a torch op between decoration and call starts OpenMP threads;
    a notebook runs cells in between), and then only a copy of this process made now, while forking is safe,
    starts workers at fork speed: a fresh server at the call costs about 1.5x the launch (bench/bench_launch.py,
    "after a torch op"). The copy costs one fork here and is used or stopped with the process; where it cannot
    be made (a TMPDIR too long for a socket) the call falls back, never the import."""
    return start_method in ("auto", "forkserver")


def _script_main() -> bool:
    """Whether ``__main__`` is a script file (``python script.py``), not an interactive session, a notebook or
    ``python -c``, where cells or lines run between definition and call."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def copy_at_import(caller: FrameType | None) -> None:
    """At ``from distfn import distributed`` (``caller``: the frame that asked for the name): where a script's own
    top level asks, and a self-spawned launch could start here, make the fork server's copy now, idle.

    Why now and not at decoration: a script in the notebook order (imports, a torch op, then the decorated
    function and its call) has no safe moment to copy itself after its first torch op (an OpenMP pool is alive);
    its fork server was a fresh interpreter importing torch on the call's critical path (1.92x the raw-fork launch,
    issue 46 item 3). Made here, before the script's first line of its own, the copy serves the call at fork speed.
    It costs what the copy at decoration cost before, moved here: two forks (the pool probe's, whose answer is read
    only before the copy is relied on, `distfn.preflight.start_pool_probe`, and the copy's; ~25 ms together on
    this 2-core VM, so a script's ``from distfn import distributed`` takes that much longer and its decoration that
    much less). The copy stays idle until a call cannot fork (`distfn.launch.forkserver._await_first_use`), and
    decorating finds it running.
    Only in a script (`_script_main`): a notebook has a pause between cells for a fresh server (and its kernel the
    threads of its own), and a module that a script or a test imports is left alone. Never raises.
    """
    main = sys.modules.get("__main__")
    if (sys.platform != "linux" or caller is None or caller.f_code.co_name != "<module>"
            or caller.f_globals is not getattr(main, "__dict__", None) or not _script_main()):
        return
    try:
        plan = _plan(make_options({"nprocs": 2}))  # could a self-spawned launch start here (not in place, not Ray)?
    except DistfnError:
        return
    if plan.launches and plan.layout is None and _forkserver_expected(plan.opts.start_method):
        forkserver.start_early(idle=True, at="at `from distfn import distributed`", copy_only=True)


def _start_early(opts: Options) -> None:
    """At decoration: a fork server now, where calling the function here will launch workers with it. Never
    raises: whatever is wrong with the environment is the call's error. The start method is asked once, of the
    plan's options (``DISTFN_START_METHOD`` applied: it may name forkserver where the decorator does not)."""
    if sys.platform != "linux":
        return
    try:
        plan = _plan(opts)
    except DistfnError:
        return  # the call explains what is wrong
    if plan.launches and _forkserver_expected(plan.opts.start_method):
        # idle in a plain script: the call follows at once (nothing to prepare in the background for), and with
        # "auto" it usually still forks, the copy a spare (`forkserver._await_first_use`); the call wakes it where
        # it will be used. Ready at once (at the lowest priority) in a notebook, whose cells leave idle time.
        forkserver.start_early(idle=_script_main())


def _decorate(func: Callable[..., R], opts: Options, origin: Callable[..., R] | None = None) -> Callable[..., R]:
    """The decorated ``func``. ``origin``: the wrapper that ``fn.options(...)`` derived this one from; it stays
    what spawn pickles (by name, it is the one a worker finds in the user's module; the options travel apart)."""
    if origin is None:
        _check_signature(func)
    process.adopt_legacy_local_rank()  # torch.distributed.launch's --local-rank=N, before the user's argparse

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        # frozen before the launch machinery's import: that import triggers a full collection (~100-300 ms)
        with process.frozen_heap():
            forkserver.wake_if_needed(opts.start_method)  # an idle copy prepares while this process imports
            from . import execute  # deferred: the launch machinery loads at the first call (see `_call`)

            execute.check_arguments(func, args, kwargs)
            with logs.launcher():  # one log format from here on ("launcher", then "rank r/n" in the ranks)
                try:
                    return _call(func, origin or wrapper, opts, args[0] if args else None)
                except DistfnError as exc:
                    if os.environ.get("DISTFN_DEBUG") == "1":
                        raise
                    # the cause leads: distfn's frames between the caller and the raise are dropped (issue 44)
                    raise exc.with_traceback(None)  # noqa: B904 - the same exception, not a new one

    def options(**changes: Any) -> Callable[..., R]:
        """The same function with some arguments of ``@distributed`` changed for the calls made through it,
        checked like the decorator's own: ``train.options(precision="16" if cfg.amp else "32")(cfg)``."""
        return _decorate(func, make_options(changes, opts), origin or wrapper)

    def shutdown() -> None:
        """End the ranks kept alive for this function (``keep_alive=True``) now, rather than at exit: e.g. to
        give their GPU memory back, or after editing a module they imported. A no-op where none are kept."""
        kept = sys.modules.get("distfn.launch.pool")  # loaded by the first kept-alive call, not at decoration
        if kept is not None:
            kept.shutdown(origin or wrapper)

    wrapper.distfn_options = opts  # type: ignore[attr-defined]
    wrapper.options = options  # type: ignore[attr-defined]
    wrapper.shutdown = shutdown  # type: ignore[attr-defined]
    _start_early(opts)  # a fork server now, where the call will launch workers with forkserver
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
    track: str | Any | Sequence[str | Any] | None = None,
    mesh: Mapping[str, int] | str | None = None,
    rank_seeds: bool = False,
    keep_alive: bool = False,
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
        rank_seeds: with ``seed``, rank r is seeded with ``seed + r`` instead (its own random stream, as
            nanoGPT's ``1337 + rank``; ``ctx.seed`` stays ``seed``, so samplers still shuffle alike). ``ctx.wrap``
            still starts every rank from rank 0's weights (DDP broadcasts them). Each rank's stream resumes
            exactly (docs/checkpoints.md, "Exact resume"); a rank that a resume on more ranks adds starts from
            ``seed + r``.
        timeout: seconds (or a ``timedelta``) for collectives and rendezvous; default 30 minutes.
        devices: GPUs to use, e.g. ``"0,5"`` or ``[0, 5]``, applied through ``CUDA_VISIBLE_DEVICES`` (program
            index 1 is then physical GPU 5). Rank r uses ``cuda:(local_rank % device_count)``.
        start_method: ``"auto"`` (fork when this process has no CUDA context and no extra threads, else
            forkserver: distfn's fork server, see docs/notebooks.md),
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
        track: experiment tracking from rank 0 for ``ctx.log_metrics`` / ``ctx.log_params``: ``"mlflow"``,
            ``"wandb"``, ``"tensorboard"``, ``"csv"``, a list of them, or backend objects
            (``distfn.tracking.MLflow(uri=..., experiment=...)``, ...). One run per job, continued across
            ``max_restarts``, ``requeue`` and a re-run that ``ctx.resume``-s; the cfg is logged as its parameters.
            A missing extra is a `ConfigError` naming it (``pip install 'distfn[mlflow]'``). See
            docs/tracking.md.
        mesh: ``mode="fsdp"`` only: the ranks as a named mesh for 2-D parallelism, a mapping of
            ``dp_replicate`` (whole replicas), ``dp_shard`` (FSDP's sharding) and ``tp`` (tensor parallel) to
            sizes, one of them ``-1`` for the ranks left over, e.g. ``{"dp_replicate": 2, "dp_shard": -1}``
            (HSDP) or ``{"dp_shard": -1, "tp": 2}`` (FSDP x TP); ``"auto"``: replicate across nodes, shard
            within one. ``ctx.mesh`` is the ``DeviceMesh``. See docs/mesh.md.
        keep_alive: keep a self-spawned job's ranks (processes, process group, CUDA contexts) alive after a call
            that succeeded, and run the next call of this function with the same options on them: only the
            function, ``cfg`` and the per-call options travel (for notebooks and interactive sessions that call
            the function again and again). A call that fails, hangs, is interrupted or changes ``nprocs``,
            ``mode``, ``devices``, ``backend``, ``timeout`` or the start method ends the ranks; the next call
            starts fresh ones. The ranks end with this process. What stays in them between calls (module globals,
            imports) is described in docs/notebooks.md; ``seed=`` reseeds every call. Default False (each call
            starts fresh processes); no effect under torchrun / srun / mpirun, Ray or one-process modes.

    Raises:
        ConfigError: at decoration time, for any invalid argument or a function that cannot take
            ``(cfg, ctx)``; nothing else, ever: decoration does not judge the environment (a stray ``RANK``, a
            ``MASTER_ADDR`` that does not resolve, a bad ``DISTFN_*`` value), the call does.

    The caller gets rank 0's return value (tensors moved to the CPU) when distfn spawned the workers; under an
    external launcher every process gets its own. A failing worker raises ``distfn.WorkerError``.

    Options at run time: ``fn.options(**changes)`` returns the function with some of these arguments changed
    (checked the same way), e.g. ``train.options(precision="16" if cfg.use_amp else "32")(cfg)``; and the
    environment overrides them at each call: ``DISTFN_NPROCS``, ``DISTFN_PRECISION``, ``DISTFN_BACKEND``,
    ``DISTFN_START_METHOD``, ``DISTFN_TIMEOUT`` (seconds), ``DISTFN_MAX_RESTARTS``, ``DISTFN_REQUEUE`` (1/0),
    ``DISTFN_LAUNCHER``, ``DISTFN_MESH`` (``dp_replicate=2,dp_shard=-1`` or ``auto``), ``DISTFN_KEEP_ALIVE`` (1/0), over
    both the decorator and ``fn.options``.
    """
    opts = make_options(options)
    if fn is not None:
        return _decorate(fn, opts)
    return functools.partial(_decorate, opts=opts)
