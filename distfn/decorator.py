"""``@distributed``: validate everything at decoration time, then at call time choose how to run.

    train(cfg) ─┬─ inside a running worker?        → NestedLaunchError
                ├─ an external launcher detected?  → run in place, one rank per process (torchrun/srun/mpirun)
                ├─ one process (mode single/dp, or nprocs == 1) → run in place
                └─ otherwise                       → spawn nprocs workers, return rank 0's value
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from typing import Any, Callable, Mapping, Sequence, TypeVar, overload

import attrs
import torch
import torch.distributed as dist
from loguru import logger

from . import spawn, worker
from .errors import ConfigError, NestedLaunchError
from .loop import check_precision

MODES = ("ddp", "fsdp", "dp", "single")
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
R = TypeVar("R")


# -- argument conversion (each raises ConfigError naming the argument and how to fix it) ------------------------
def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not a distfn mode; valid modes are: {', '.join(map(repr, MODES))}")
    return mode


def _check_nprocs(nprocs: Any, source: str = "nprocs") -> int | None:
    if nprocs is None:
        return None
    if isinstance(nprocs, str) and source != "nprocs":
        try:
            nprocs = int(nprocs.strip())
        except ValueError:
            raise ConfigError(f"{source}={nprocs!r} is not an integer; set it to a process count such as 2") from None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise ConfigError(f"{source} must be a positive int, got {nprocs!r} ({type(nprocs).__name__})")
    if nprocs < 1:
        raise ConfigError(f"{source}={nprocs} must be at least 1")
    return nprocs


def _check_backend(backend: str | None) -> str | None:
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend:
        raise ConfigError(f"backend must be a string such as 'gloo' or 'nccl', got {backend!r}")
    known = [b.lower() for b in dist.Backend.backend_list]
    # torch also accepts per-device forms like "cpu:gloo,cuda:nccl"
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"backend={backend!r}: {unknown[0]!r} is not a torch.distributed backend here; "
                          f"available: {', '.join(known)}")
    return backend


def _check_seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int or None, got {seed!r}")
    return seed


def _check_timeout(timeout: Any) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = datetime.timedelta(seconds=timeout)
    else:
        raise ConfigError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ConfigError(f"timeout must be positive, got {timeout!r}")
    return value


def _check_devices(devices: Any) -> tuple[int, ...] | None:
    if devices is None:
        return None
    items: Sequence[Any]
    if isinstance(devices, int) and not isinstance(devices, bool):
        items = [devices]
    elif isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, (list, tuple)):
        items = devices
    else:
        raise ConfigError(f"devices must be like '0,5' or [0, 5], got {devices!r}")
    out: list[int] = []
    for d in items:
        try:
            if isinstance(d, bool):
                raise ValueError
            value = int(d)
        except (TypeError, ValueError):
            raise ConfigError(f"devices={devices!r}: {d!r} is not a GPU index") from None
        if value < 0:
            raise ConfigError(f"devices={devices!r}: GPU indices are >= 0, got {value}")
        out.append(value)
    if not out:
        raise ConfigError(f"devices={devices!r} names no GPU; omit it to use all visible GPUs")
    if len(set(out)) != len(out):
        raise ConfigError(f"devices={devices!r} names a GPU twice")
    return tuple(out)


def _check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(map(repr, choices))}")
    return value


def _check_init_method(init_method: str | None) -> str | None:
    if init_method is None:
        return None
    if not isinstance(init_method, str) or not init_method.startswith(("env://", "tcp://", "file://")):
        raise ConfigError(f"init_method={init_method!r} must start with env://, tcp:// or file://")
    return init_method


def _check_fsdp(value: Any) -> Any:
    """``fsdp={...}`` -> ``distfn.fsdp.FsdpOptions`` (unknown keys are an error naming the valid ones)."""
    if value is None:
        # distfn.fsdp imports torch._dynamo (1-2 s, measured by bench/bench_launch.py): only scripts that
        # use FSDP options may pay for it
        return None
    from .fsdp import parse_options

    return parse_options(value)


def _launchers() -> tuple[str, ...]:
    from .topology import LAUNCHERS

    return tuple(LAUNCHERS)


@attrs.frozen
class Options:
    """The validated arguments of ``@distributed`` (what every worker receives)."""

    mode: str = attrs.field(default="ddp", converter=_check_mode)
    nprocs: int | None = attrs.field(default=None, converter=_check_nprocs)
    backend: str | None = attrs.field(default=None, converter=_check_backend)
    seed: int | None = attrs.field(default=None, converter=_check_seed)
    timeout: datetime.timedelta = attrs.field(default=None, converter=_check_timeout)
    devices: tuple[int, ...] | None = attrs.field(default=None, converter=_check_devices)
    start_method: str = attrs.field(default="auto")
    launcher: str = attrs.field(default="auto")
    init_method: str | None = attrs.field(default=None, converter=_check_init_method)
    precision: str = attrs.field(default="32", converter=check_precision)
    fsdp: Any = attrs.field(default=None, converter=_check_fsdp)  # distfn.fsdp.FsdpOptions | None

    def __attrs_post_init__(self) -> None:
        _check_choice("start_method", self.start_method, spawn.START_METHODS)
        _check_choice("launcher", self.launcher, _launchers())
        if self.mode in ("single", "dp") and self.nprocs not in (None, 1):
            raise ConfigError(f"mode={self.mode!r} runs one process, but nprocs={self.nprocs}; "
                              "use mode='ddp' for several processes")
        if self.fsdp is not None and self.mode != "fsdp":
            raise ConfigError(f"fsdp= options were given but mode={self.mode!r}; use mode='fsdp' or drop fsdp=")
        if self.devices is not None and self.nprocs is not None and self.mode in ("ddp", "fsdp") \
                and self.nprocs > len(self.devices) and (self.backend or "nccl") == "nccl":
            raise ConfigError(f"nprocs={self.nprocs} is more than the {len(self.devices)} GPU(s) in "
                              f"devices={self.devices}; NCCL needs one GPU per process")


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


def _requested_nprocs(opts: Options) -> int | None:
    """The process count asked for: ``DISTFN_NPROCS`` (validated) over ``nprocs=``, or ``None``."""
    env = os.environ.get("DISTFN_NPROCS")
    if env is not None and env.strip():
        return _check_nprocs(env, "DISTFN_NPROCS")
    return opts.nprocs


def _nprocs_default(opts: Options) -> int:
    requested = _requested_nprocs(opts)
    if requested is not None:
        if opts.mode in ("single", "dp") and requested != 1:  # nprocs= itself was checked at decoration time
            raise ConfigError(f"DISTFN_NPROCS={requested} but mode={opts.mode!r} runs one process")
        return requested
    if opts.mode in ("single", "dp"):
        return 1
    if opts.devices is not None:
        return len(opts.devices)
    return max(1, worker.visible_gpus())


def _check_backend_fits(opts: Options) -> None:
    if opts.backend is not None and "nccl" in opts.backend.lower() and worker.visible_gpus() == 0:
        raise ConfigError(f"backend={opts.backend!r} needs CUDA GPUs, but torch sees none "
                          f"(torch {torch.__version__}); use backend='gloo' or leave it unset")


def _call(fn: Callable[..., R], wrapper: Callable[..., R], opts: Options, cfg: Any) -> R:
    from . import topology

    name = getattr(fn, "__qualname__", "the function")
    if worker.in_worker() or os.environ.get(spawn._CHILD_ENV):
        raise NestedLaunchError(
            f"{name}() was called from inside a running distfn worker. A decorated function starts a whole job; "
            "call the undecorated function instead (available as `decorated.__wrapped__`). If this comes from a "
            "script being re-imported by a worker, put the call under `if __name__ == \"__main__\":`."
        )
    worker.apply_visible_devices(opts.devices)
    _check_backend_fits(opts)
    topo = topology.detect(os.environ, sys.argv, opts.launcher)
    if topo is not None:
        topo = topology.resolve_rendezvous(topo)  # only multi-node MPI without MASTER_ADDR needs it
        if opts.mode in ("single", "dp") and topo.world_size > 1:
            raise ConfigError(f"mode={opts.mode!r} runs one process, but {topo.launcher} started "
                              f"{topo.world_size}; use mode='ddp' or launch one process")
        requested = _requested_nprocs(opts)
        if requested is not None and requested != topo.world_size and topo.rank == 0:
            logger.info("nprocs={} is ignored: {} started {} processes", requested, topo.launcher, topo.world_size)
        return worker.run(fn, cfg, opts, topo)
    nprocs = _nprocs_default(opts)
    if nprocs == 1:
        local = topology.Topology(
            launcher="local", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
            num_nodes=1, master_addr=None, master_port=None, reason="one process, run in place",
        )
        return worker.run(fn, cfg, opts, local)
    spawn.check_main_guard(name)
    return spawn.launch(wrapper, cfg, opts, nprocs)


@overload
def distributed(fn: Callable[[Any, Any], R], /) -> Callable[..., R]: ...
@overload
def distributed(
    fn: None = None,
    /,
    *,
    mode: str = "ddp",
    nprocs: int | None = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    devices: str | Sequence[int] | None = None,
    start_method: str = "auto",
    launcher: str = "auto",
    init_method: str | None = None,
    precision: str | int = "32",
    fsdp: Mapping[str, Any] | None = None,
) -> Callable[[Callable[[Any, Any], R]], Callable[..., R]]: ...


def distributed(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    mode: str = "ddp",
    nprocs: int | None = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    devices: str | Sequence[int] | None = None,
    start_method: str = "auto",
    launcher: str = "auto",
    init_method: str | None = None,
    precision: str | int = "32",
    fsdp: Mapping[str, Any] | None = None,
) -> Any:
    """Make ``fn(cfg, ctx)`` a distributed job: ``fn(cfg)`` then runs it on every rank and returns a value.

    Args:
        mode: ``"ddp"`` (one process per device, DistributedDataParallel), ``"fsdp"`` (one process per device,
            parameters, gradients and optimizer state sharded with FSDP2 ``fully_shard``; see docs/modes.md),
            ``"dp"`` (one process, ``nn.DataParallel`` over the visible GPUs) or ``"single"`` (one process, one
            device).
        nprocs: processes to self-spawn under ``python script.py``. Default: the number of visible GPUs
            (``len(devices)`` when given), or 1 without CUDA. ``DISTFN_NPROCS`` in the environment overrides it.
            Ignored (with a log line) under torchrun / srun / mpirun, whose world size wins.
        backend: process-group backend; default ``"nccl"`` on CUDA devices, else ``"gloo"``.
        seed: when given, every rank seeds ``random``, NumPy, torch and CUDA with it before ``fn`` runs, so
            models initialise identically on all ranks.
        timeout: seconds (or a ``timedelta``) for collectives and rendezvous; default 30 minutes.
        devices: GPUs to use, e.g. ``"0,5"`` or ``[0, 5]``, applied through ``CUDA_VISIBLE_DEVICES`` (program
            index 1 is then physical GPU 5). Rank r uses ``cuda:(local_rank % device_count)``.
        start_method: ``"auto"`` (fork when this process has no CUDA context and no extra threads, else spawn),
            ``"fork"``, ``"forkserver"`` or ``"spawn"``.
        launcher: ``"auto"`` detects torchrun / MPI / SLURM; ``"spawn"``, ``"torchrun"``, ``"slurm"``,
            ``"mpi"`` force one (a forced launcher whose variables are missing is an error naming them).
        init_method: ``None`` (distfn's own rendezvous), ``"env://"``, ``"tcp://host:port"`` or
            ``"file:///shared/path"``.
        precision: ``"32"`` (float32, the default), ``"bf16"`` (bfloat16 autocast; works on CPUs too) or
            ``"16"`` (float16 autocast with a GradScaler). It applies where the code uses ``with ctx.autocast():``,
            ``ctx.backward(loss)`` and ``ctx.step(optimizer)``; the model's weights stay float32.
        fsdp: options of ``mode="fsdp"``: ``min_params``, ``module_classes``, ``mixed_precision``,
            ``cpu_offload``, ``reshard_after_forward``, ``save_timeout`` (see ``distfn.fsdp.FsdpOptions``).

    Raises:
        ConfigError: at decoration time, for any invalid argument or a function that cannot take
            ``(cfg, ctx)``.

    The caller gets rank 0's return value (tensors moved to the CPU) when distfn spawned the workers; under an
    external launcher every process gets its own. A failing worker raises ``distfn.WorkerError``.
    """
    opts = Options(mode=mode, nprocs=nprocs, backend=backend, seed=seed, timeout=timeout, devices=devices,
                   start_method=start_method, launcher=launcher, init_method=init_method, precision=precision,
                   fsdp=fsdp)

    def decorate(func: Callable[..., R]) -> Callable[..., R]:
        _check_signature(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> R:
            from .context import Context

            if kwargs or len(args) > 1 or any(isinstance(a, Context) for a in args):
                given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
                raise ConfigError(
                    f"{func.__qualname__}() takes one argument, cfg (got {', '.join(given)}); "
                    "distfn creates and passes ctx itself. Call it as "
                    f"{func.__qualname__}(cfg) or {func.__qualname__}()."
                )
            return _call(func, wrapper, opts, args[0] if args else None)

        wrapper.distfn_options = opts  # type: ignore[attr-defined]
        return wrapper

    if fn is not None:
        return decorate(fn)
    return decorate
