"""What every rank does around the user's function, whoever started the process.

Both paths end here: a self-spawned worker (``spawn.py``) and a process started by torchrun / srun / mpirun (run
in place by ``decorator.py``). In order: pick and pin the device, size the CPU thread pool, seed, set up logging,
start the process group, build the ``Context``, call the function, and always destroy the process group.
"""

from __future__ import annotations

import datetime
import os
import random
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from loguru import logger

from . import logs, preemption
from .context import Context
from .errors import ConfigError

if TYPE_CHECKING:
    from .decorator import Options
    from .topology import Topology

# True while a distfn-decorated function runs in this process: calling another decorated function then would
# start a second job from inside a rank (a fork bomb under self-spawn), so the decorator refuses it.
_ACTIVE = False


def in_worker() -> bool:
    """True inside a running distfn function (or a distfn worker that is starting up)."""
    return _ACTIVE


def mark_active(value: bool) -> None:
    """Set the nested-launch guard (used by the spawn entry point before the user's module is imported)."""
    global _ACTIVE
    _ACTIVE = value


def visible_gpus() -> int:
    """How many CUDA devices this process may use, asked without initialising CUDA.

    ``torch.cuda.device_count()`` asks NVML first, which leaves the process safe to fork; the plain
    ``torch.cuda.is_available()`` runs ``cuInit``, after which forked workers could not use CUDA. The launching
    process must only ever ask this way.
    """
    return torch.cuda.device_count()


def apply_visible_devices(devices: tuple[int, ...] | None) -> None:
    """Restrict CUDA to ``devices`` through ``CUDA_VISIBLE_DEVICES`` (before CUDA is initialised).

    The mapping is CUDA's own: with ``devices=(0, 5)`` the program sees ``cuda:0`` = physical GPU 0 and
    ``cuda:1`` = physical GPU 5. Raises ``ConfigError`` when CUDA is missing, already initialised with
    another mapping, or fewer GPUs are visible than requested.
    """
    if devices is None:
        return
    wanted = ",".join(str(d) for d in devices)
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized() and current != wanted:
        raise ConfigError(
            f"devices={wanted!r} was given but CUDA is already initialised in this process "
            f"(CUDA_VISIBLE_DEVICES={current!r}); the mapping can only change before the first CUDA call. "
            "Call the decorated function before touching CUDA, or set CUDA_VISIBLE_DEVICES in the shell."
        )
    if current is not None and current != wanted:
        logger.warning("devices={} replaces CUDA_VISIBLE_DEVICES={}", wanted, current)
    os.environ["CUDA_VISIBLE_DEVICES"] = wanted
    visible = visible_gpus()
    if visible == 0:
        raise ConfigError(
            f"devices={wanted!r} asks for GPUs but torch sees no CUDA device (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}); drop devices= to run on the CPU"
        )
    if visible < len(devices):
        raise ConfigError(
            f"devices={wanted!r} asks for {len(devices)} GPUs but only {visible} of them exist on this machine; "
            "check the ids with nvidia-smi"
        )


def select_device(mode: str, topology: Topology, backend: str | None) -> torch.device:
    """The device for this rank: ``cuda:(local_rank % device_count)`` when CUDA is there, else the CPU.

    With NCCL (the default on GPUs) two ranks cannot share a GPU, so more ranks on a node than visible GPUs is
    an error naming the fix, unless the launcher binds one GPU per task (``srun --gpus-per-task=1``).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if mode == "dp":
        return torch.device("cuda", 0)  # DataParallel scatters from device 0 over all visible GPUs
    if backend is None or "nccl" in backend.lower():
        from .topology import check_devices

        check_devices(topology, count, env=os.environ)
    return torch.device("cuda", topology.local_rank % count)


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def seed_everything(seed: int) -> None:
    """Seed ``random``, NumPy (when installed) and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily


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


def _init_method(topology: Topology, init_method: str | None) -> str:
    if init_method is not None:
        return init_method
    if topology.launcher == "torchrun" or topology.master_addr is None:
        # torchrun's agent already holds a store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): only env://
        # knows to join it as a client; tcp:// would try to listen on the same port.
        return "env://"
    host = topology.master_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"tcp://{host}:{topology.master_port}"


def _torchrun_store(timeout: datetime.timedelta) -> Any:
    """torchrun's agent store with a key space of its own for each restart attempt, or ``None``.

    torchrun keeps one store across ``--max-restarts`` attempts and never clears it, so the ranks of a
    restarted attempt can read the previous attempt's addresses and fail with gloo's "Connection refused"
    (reproduced with torch 2.13). Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` separates attempts.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout)
    return dist.PrefixStore(f"distfn/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def init_process_group(
    topology: Topology,
    backend: str,
    timeout: datetime.timedelta,
    *,
    store: Any = None,
    init_method: str | None = None,
) -> None:
    """Join the job's default process group (rendezvous through ``store`` when the launcher made one)."""
    kwargs: dict[str, Any] = dict(
        backend=backend, rank=topology.rank, world_size=topology.world_size, timeout=timeout
    )
    if store is None and init_method is None and topology.launcher == "torchrun":
        store = _torchrun_store(timeout)
    if store is not None and init_method is None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = _init_method(topology, init_method)
    dist.init_process_group(**kwargs)


def run(fn: Callable[[Any, Context], Any], cfg: Any, opts: Options, topology: Topology, *, store: Any = None) -> Any:
    """Bootstrap this rank, call ``fn(cfg, ctx)`` and return its value; the process group is always destroyed."""
    mark_active(True)
    log = logs.setup(topology.rank, topology.world_size)
    started_group = False
    # SIGTERM/SIGUSR2 -> ctx.should_stop (main thread only); a function that polls it is not interrupted
    stop_handlers = preemption.install(opt_in=preemption.polls(fn))
    try:
        device = select_device(opts.mode, topology, opts.backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
        threads = size_thread_pool(topology.local_world_size)
        if opts.seed is not None:
            seed_everything(opts.seed)
        backend: str | None = None
        if opts.mode != "single" and opts.mode != "dp":
            backend = opts.backend or default_backend(device)
            if store is None and topology.launcher == "local" and opts.init_method is None:
                store = dist.HashStore()  # a world of one needs no network at all
            init_process_group(topology, backend, opts.timeout, store=store, init_method=opts.init_method)
            started_group = True
            if opts.mode == "fsdp":  # sharded like ddp needs the group; plus the ctx.save check-in bookkeeping
                from . import fsdp

                fsdp.begin(topology.rank, topology.world_size, opts.fsdp)
        if topology.rank == 0:
            log.info("launcher: {} ({}); world size {}, device {}, backend {}, {}", topology.launcher,
                     topology.reason, topology.world_size, device, backend, threads)
        ctx = Context(
            rank=topology.rank,
            local_rank=topology.local_rank,
            world_size=topology.world_size,
            local_world_size=topology.local_world_size,
            node_rank=topology.node_rank,
            num_nodes=topology.num_nodes,
            device=device,
            backend=backend,
            mode=opts.mode,
            launcher=topology.launcher,
            seed=opts.seed,
            log=log,
            precision=opts.precision,
        )
        return fn(cfg, ctx)
    except BaseException as exc:
        if topology.launcher not in ("spawn", "local"):
            # torchrun / srun / mpirun: no distfn parent collects the failure, so this rank reports it itself
            from .spawn import report_in_place

            report_in_place(topology.rank, exc)
        raise
    finally:
        if opts.mode == "fsdp":
            from . import fsdp

            fsdp.finish()  # ranks waiting in an fsdp ctx.save learn that this one will never join it
        if started_group and dist.is_initialized():
            dist.destroy_process_group()
        logs.teardown()
        preemption.restore(stop_handlers)
        mark_active(False)
