"""Which external launcher started this process, and where it sits in the job.

Everything here is *pure detection*: `detect` takes a mapping of environment variables (and the process's argv)
and returns a frozen `Topology`, or ``None`` when no external launcher is present and distfn should start
("self-spawn") its own workers; it looks up no host name. Detectors never read ``os.environ`` themselves and
never mutate anything, so the tests can feed recorded environments of real launchers without monkeypatching.

Launchers nest, and the outer one's variables leak into the inner one (see the recorded environments in the
team's ``slurm-mpi.md`` notes), so the order of the checks matters:

1. **torchrun** (``TORCHELASTIC_RUN_ID``, or the legacy ``python -m torch.distributed.launch`` that passes
   ``--local-rank=N`` in argv, see `split_local_rank`), and **plain env:// launchers** (a full
   ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set without torchrun's variables: a Kubernetes PyTorchJob, or a set
   made by hand; launcher ``"kubernetes"`` or ``"env"``). ``torchrun`` inside ``srun`` still sees the SLURM
   variables of the *agent*, which describe one task per node, not the workers.
2. **MPI**: Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``), MVAPICH
   (``MV2_COMM_WORLD_*``). ``mpirun`` inside an ``sbatch`` job sees the job's SLURM variables, and on more
   than one node even a SLURM step (Open MPI starts its daemons through ``srun``), with wrong ranks.
3. **SLURM job step** (``SLURM_STEP_ID`` and ``SLURM_PROCID``): one process per task started by ``srun``.
4. Nothing: self-spawn.

The ``sbatch`` script body and an ``salloc`` shell are *not* ranks although they carry ``SLURM_PROCID=0`` and
``SLURM_NTASKS=N``: they are one process on the first node, with no job step. Treating them as "rank 0 of N"
would wait forever for N-1 peers that nobody starts, so they self-spawn like a plain ``python script.py``.

Errors are `distfn.errors.LauncherError`, raised before any process group starts, naming the
variables, their values, and how to fix them. What needs I/O (an mpi4py broadcast of the rendezvous, a free
port) lives in `distfn.rendezvous`; GPU counting and choice in `distfn.devices`.

The package: `distfn.topology.common` (the `Topology` value and the parsing helpers through which every
detector's errors name the variable and its value), one module per launcher family (`.torchrun`, `.mpi`,
`.slurm`), and here the order between them (`DETECTORS`, `detect`), the master host's check (`check_master`, the
one name lookup, made by the call) and the report of ``distfn env`` (`describe`). Adding a launcher is adding a
module with a `Detector` and placing it in `DETECTORS`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
from loguru import logger

from ..errors import LauncherError
from ..options import LAUNCHERS, LauncherName
from .common import (
    LOOPBACK,
    MPI_FALLBACK_PORT,
    PORT_BASE,
    PORT_SPAN,
    Claim,
    Detector,
    HostResolver,
    LauncherKind,
    Topology,
    derive_port,
    first_set,
)
from .mpi import MPI, mpi4py_available
from .slurm import SLURM, SlurmDetector, expand_hostlist, expand_tasks_per_node
from .torchrun import TORCHRUN, split_local_rank

__all__ = [
    "DETECTORS",
    "LAUNCHERS",
    "LOOPBACK",
    "MPI_FALLBACK_PORT",
    "PORT_BASE",
    "PORT_SPAN",
    "LauncherKind",
    "Topology",
    "check_master",
    "check_resolvable",
    "derive_port",
    "describe",
    "detect",
    "expand_hostlist",
    "expand_tasks_per_node",
    "mpi4py_available",
    "spawn_reason",
    "split_local_rank",
]

DETECTORS: Final[tuple[Detector, ...]] = (TORCHRUN, MPI, SLURM)
"""The detectors, in the order ``auto`` tries them (innermost launcher first)."""


# ---------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------


def check_resolvable(host: str) -> None:
    """Raise OSError when ``host`` does not resolve (IP literals are accepted without a lookup)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    socket.getaddrinfo(host, None)


def _detect_unchecked(env: Mapping[str, str], argv: Sequence[str], launcher: str) -> Topology | None:
    if launcher in ("spawn", "ray"):  # ray: distfn.launch.ray makes each actor's Topology
        return None
    if launcher == "auto":
        for det in DETECTORS:
            claim = det.claim(env, argv)
            if claim is None:
                continue
            if det is SLURM:
                world_var = first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
                if world_var and env[world_var].strip() == "1":
                    # `srun python script.py` / `srun --pty` with one task is how people get onto a compute
                    # node; one task is no distributed job, so distfn spawns its workers there as usual.
                    return None
            return det.topology(env, argv, claim)
        return None
    forced: dict[str, Detector] = {"torchrun": TORCHRUN, "mpi": MPI, "slurm": SLURM}
    det = forced[launcher]
    claim = det.claim(env, argv) if det is not TORCHRUN else _claim_torchrun_forced(env, argv)
    return det.topology(env, argv, claim)


def _claim_torchrun_forced(env: Mapping[str, str], argv: Sequence[str]) -> Claim | None:
    # Forced torchrun reports missing variables itself rather than the "partial set" message, and reads a plain
    # env:// set as torchrun's own (LOCAL_RANK required).
    try:
        claim = TORCHRUN.claim(env, argv)
    except LauncherError:
        return None
    return None if claim is not None and claim.flavor == "env" else claim


def detect(
    env: Mapping[str, str],
    argv: Sequence[str] = (),
    launcher: LauncherName = "auto",
    *,
    resolve_host: HostResolver | None = None,
) -> Topology | None:
    """Detect the external launcher of this process from its environment and argv.

    Args:
        env: the environment variables (``os.environ`` in production, a recorded dict in tests).
        argv: the process's arguments (``sys.argv``), for the legacy ``--local_rank=N``.
        launcher: ``"auto"`` tries torchrun, MPI, then a SLURM step; ``"spawn"`` always returns None; the
            others force that launcher and fail when its variables are missing.
        resolve_host: checks that the master host resolves (raises ``OSError`` if not); ``None`` (the default)
            skips the check, so that detection stays pure: the call checks the host with `check_master`.

    Returns:
        The topology, or ``None`` when no external launcher runs this process (distfn self-spawns).

    Raises:
        LauncherError: a forced launcher whose variables are missing, or launcher variables that contradict
            each other (named, with their values, and how to fix them).
    """
    topo = _detect_unchecked(env, argv, launcher)
    if topo is None:
        if launcher == "spawn":
            others = [d.name for d in DETECTORS if _safe_claim(d, env, argv)]
            if others:
                logger.warning("launcher='spawn' forced although {} variables are set; self-spawning anyway",
                               " and ".join(others))
        return None
    if resolve_host is not None:
        check_master(topo, resolve_host)
    return topo


def check_master(topo: Topology, resolve_host: HostResolver = check_resolvable) -> Topology:
    """``topo``, once its master host resolves (the name lookup of a call, never of detection).

    Raises:
        LauncherError: the master host does not resolve, with how to fix it.
    """
    if topo.master_addr is None:
        return topo
    try:
        resolve_host(topo.master_addr)
    except OSError as exc:
        raise LauncherError(
            f"the master host {topo.master_addr!r} ({topo.reason}) does not resolve: {exc}. Make the name "
            "resolvable on every node (DNS or /etc/hosts) or set MASTER_ADDR to rank 0's IP address"
        ) from None
    return topo


def _safe_claim(det: Detector, env: Mapping[str, str], argv: Sequence[str]) -> Claim | None:
    try:
        return det.claim(env, argv)
    except LauncherError as exc:
        return Claim(f"inconsistent: {exc}")


def describe(env: Mapping[str, str], argv: Sequence[str] = (), launcher: LauncherName = "auto") -> dict[str, Any]:
    """What `detect` would decide here, and why, for ``python -m distfn env``.

    Never raises for launcher problems: an error is reported in the result instead. Does no name lookup.

    Returns:
        A JSON-ready dict: ``launcher`` (the detected one, ``"spawn"`` for self-spawn, ``None`` on error),
        ``reason``, ``topology`` (the fields, or ``None``), ``error`` (message or ``None``), ``candidates``
        (every launcher whose variables are present, with why) and ``variables`` (the launcher variables that
        are set, with their values).
    """
    result: dict[str, Any] = {"requested": launcher, "launcher": None, "reason": "", "topology": None,
                              "error": None, "candidates": {}, "variables": {}}
    names = dict.fromkeys(v for d in DETECTORS for v in d.variables)
    result["variables"] = {n: env[n] for n in names if n in env}
    for det in DETECTORS:
        claim = _safe_claim(det, env, argv)
        if claim is not None:
            name = det.name
            if claim.flavor == "env":  # torch's variable names, but a plain env:// launcher
                name = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST", "").strip() else "env"
            result["candidates"][name] = claim.reason
    try:
        topo = detect(env, argv, launcher, resolve_host=None)
    except LauncherError as exc:
        result["error"] = str(exc)
        result["reason"] = "launcher variables are missing or inconsistent"
        return result
    if topo is None:
        result["launcher"] = "ray" if launcher == "ray" else "spawn"
        result["reason"] = spawn_reason(env, launcher)
    else:
        result["launcher"] = topo.launcher
        result["reason"] = topo.reason
        result["topology"] = attrs.asdict(topo)
    return result


def spawn_reason(env: Mapping[str, str], launcher: str = "auto") -> str:
    """Why no external launcher runs this process (distfn starts its own workers), in words."""
    if launcher == "spawn":
        return "launcher='spawn' was forced"
    if launcher == "ray":
        where = env.get("RAY_ADDRESS") or "the one started on this machine (RAY_ADDRESS unset), else a new one"
        return f"launcher='ray': the ranks run as Ray actors on the Ray cluster at {where}"
    if env.get("SLURM_JOB_ID", "").strip():
        step = SlurmDetector.step(env)
        if step is None:
            return ("inside SLURM job {} but not in a job step (batch script or salloc shell): distfn starts "
                    "its own workers on this node; use `srun python script.py` for one rank per task").format(
                        env["SLURM_JOB_ID"])
        if not SlurmDetector.is_task_step(step[1]):
            return f"inside the special SLURM step {step[1]}: distfn starts its own workers on this node"
        return "a SLURM step with a single task: distfn starts its own workers on this node"
    return "no torchrun, MPI or SLURM step variables: distfn starts its own workers"
