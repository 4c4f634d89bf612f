"""GPUs: how many this process may use, which one each rank takes, and which backend follows from it.

The launching process only ever counts GPUs through `visible_gpus` (NVML, no CUDA initialisation), so it stays
safe to fork; `select_device` runs in each rank. `check_devices` is the one GPU-sharing rule, and
`collective_device` the one answer to "where must a Python number travel for a collective".
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
from loguru import logger

from .errors import ConfigError, DistfnError, LauncherError
from .options import Mode
from .topology import Topology

__all__ = [
    "apply_visible_devices",
    "check_devices",
    "collective_device",
    "counts_without_driver",
    "default_backend",
    "device_for",
    "select_device",
    "visible_gpus",
]


def visible_gpus() -> int:
    """How many CUDA devices this process may use, asked without initialising CUDA.

    ``torch.cuda.device_count()`` asks NVML first, which leaves the process safe to fork; the plain
    ``torch.cuda.is_available()`` runs ``cuInit``, after which forked workers could not use CUDA. The launching
    process must only ever ask this way.
    """
    return torch.cuda.device_count()


def counts_without_driver() -> bool:
    """Whether `visible_gpus` can count through NVML here, leaving the process safe to fork.

    When NVML cannot count (no ``libnvidia-ml``, or MIG UUIDs in ``CUDA_VISIBLE_DEVICES``, which torch does not
    map through NVML), ``torch.cuda.device_count()`` falls back to the CUDA runtime, which calls into the driver:
    then distfn's own count is what makes fork unsafe, not the user's code.
    """
    if torch.version.cuda is None:
        return True  # CPU and ROCm builds: nothing here calls the CUDA driver
    count_nvml = getattr(torch.cuda, "_device_count_nvml", None)  # private; torch 2.13: -1 when NVML fails
    return count_nvml is None or count_nvml() >= 0


def apply_visible_devices(devices: tuple[int, ...] | None) -> None:
    """Restrict CUDA to ``devices`` through ``CUDA_VISIBLE_DEVICES`` (before CUDA is initialised).

    The ids are those ``nvidia-smi`` shows: distfn sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` when it is unset (CUDA's
    own default order, fastest first, can differ on machines with mixed GPUs). With ``devices=(0, 5)`` the
    program sees ``cuda:0`` = GPU 0 and ``cuda:1`` = GPU 5.

    Raises:
        ConfigError: CUDA is missing, already initialised with another mapping, or fewer GPUs are visible than
            requested.
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
    # CUDA numbers GPUs fastest first unless told otherwise; devices= means the ids nvidia-smi shows (PCI order)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
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


def select_device(mode: Mode, topology: Topology, backend: str | None) -> torch.device:
    """The device for this rank: ``cuda:(local_rank % device_count)`` when CUDA is there, else the CPU.

    With NCCL (the default on GPUs) two ranks cannot share a GPU, so more ranks on a node than visible GPUs is
    an error naming the fix, unless the launcher binds one GPU per task (``srun --gpus-per-task=1``).
    """
    if not _cuda_usable():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if mode == "dp":
        return torch.device("cuda", 0)  # DataParallel scatters from device 0 over all visible GPUs
    if backend is None or "nccl" in backend.lower():
        check_devices(topology, count, env=os.environ)
    return device_for(topology.local_rank, count)


def device_for(local_rank: int, count: int) -> torch.device:
    """The device of local rank ``local_rank`` on a node with ``count`` usable GPUs: ``cuda:(local_rank % count)``,
    or the CPU without GPUs (the one rule, for the ranks and for ``distfn env``)."""
    return torch.device("cuda", local_rank % count) if count > 0 else torch.device("cpu")


def _cuda_usable() -> bool:
    """Whether this process can use CUDA; an error when NVML counts GPUs that CUDA cannot start.

    Falling back to the CPU there would train on the CPU with gloo without a word, although the machine has GPUs
    (seen after a fork once CuPy, JAX or Numba had started the driver, which distfn's fork probe cannot see).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return True
    counted = torch.cuda.device_count()  # NVML's count (what the launching process used to size the job)
    if counted <= 0:
        return False
    why = "; ".join(str(w.message).strip() for w in caught) or "torch.cuda.is_available() is False"
    raise DistfnError(
        f"NVML sees {counted} GPU(s) but this process cannot start CUDA ({why}), and training on the CPU instead "
        "would be a silent surprise. Common causes: the workers were forked after a library (CuPy, JAX, Numba, "
        "...) called into the CUDA driver in the launching process (use start_method='spawn', or import it "
        f"inside the function), or an NVIDIA driver too old for torch's CUDA {torch.version.cuda}. To run on the "
        "CPU on purpose, set CUDA_VISIBLE_DEVICES=''."
    )


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_devices(topology: Topology, device_count: int, *, env: Mapping[str, str] | None = None) -> None:
    """Refuse to put more NCCL ranks on a node than it has visible GPUs.

    Rank ``r`` uses device ``local_rank % device_count``, and NCCL cannot run two ranks on one GPU. The one
    exception is a launcher that binds GPUs per task: under ``srun --gpus-per-task=1`` every task sees exactly
    its own GPU (``SLURM_STEP_GPUS`` set, one visible device), so ``device_count < local_world_size`` is
    expected there and device 0 is right for each task. Slurm sets ``SLURM_STEP_GPUS`` for every GPU step,
    though (``--ntasks-per-node=8 --gpus-per-node=4`` too, where each task sees all 4), so it exempts a task
    only when that task sees exactly one GPU.

    Args:
        topology: this process's topology.
        device_count: visible CUDA devices in this process (0: CPU run, nothing to check).
        env: the environment, to recognise per-task GPU binding by SLURM.

    Raises:
        LauncherError: more ranks on this node than visible GPUs, naming both and how to fix it.
    """
    if device_count <= 0 or topology.local_world_size <= device_count:
        return
    slurm_binds = env is not None and topology.launcher == "slurm" and bool(env.get("SLURM_STEP_GPUS", "").strip())
    if slurm_binds and device_count == 1:
        return  # srun --gpus-per-task=1: Slurm set CUDA_VISIBLE_DEVICES of each task to its own GPU
    visible = ""
    if env is not None and "CUDA_VISIBLE_DEVICES" in env:
        visible = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r})"
    raise LauncherError(
        f"{topology.local_world_size} ranks on node {topology.node_rank} ({topology.reason}) but only "
        f"{device_count} visible GPU(s){visible}, and NCCL needs a GPU of its own for each rank. Start at most "
        f"{device_count} task(s) per node (e.g. `srun --ntasks-per-node={device_count}`, "
        f"`torchrun --nproc_per_node={device_count}`), or give each task its own GPU (`srun --gpus-per-task=1`)"
    )


def _cpu_capable(backend: str) -> bool:
    """Whether a process group with ``backend`` can run collectives on CPU tensors."""
    for part in backend.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if device == "cpu":
            return True
        if not device and "cpu" in dist.Backend.backend_capability.get(name, ["cpu"]):
            return True
    return False


def collective_device(backend: str | None, device: torch.device) -> torch.device | None:
    """The device that collectives of Python numbers (flags, metrics) must use in a group with ``backend``.

    ``device`` when the group cannot take CPU tensors (NCCL alone, in any spelling: ``"nccl"``, ``"NCCL"``,
    ``"cuda:nccl"``), else ``None`` (the CPU, which gloo and per-device forms such as ``"cuda:nccl,cpu:gloo"``
    serve without a copy to the GPU). ``None`` as well without a process group (``backend=None``).
    """
    if backend is None or _cpu_capable(backend):
        return None
    return device
