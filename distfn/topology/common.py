"""The `Topology` value, and the small parsing helpers through which every detector reads a variable (each error
names the variable and its value)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, Protocol

import attrs

from ..errors import LauncherError

__all__ = [
    "LOOPBACK",
    "MPI_FALLBACK_PORT",
    "PORT_BASE",
    "PORT_SPAN",
    "Claim",
    "Detector",
    "HostResolver",
    "LauncherKind",
    "Topology",
    "derive_port",
    "env_int",
    "env_port",
    "first_set",
    "fmt_values",
    "require",
]

#: What started the processes of a job (`Topology.launcher`, ``ctx.launcher``): an external launcher
#: (``"torchrun"``; ``"kubernetes"`` / ``"env"`` for a plain env:// set; ``"mpi"``; ``"slurm"``), distfn's own
#: workers (``"spawn"``), Ray actors (``"ray"``), or one process run in place (``"local"``).
LauncherKind = Literal["torchrun", "kubernetes", "env", "mpi", "slurm", "spawn", "ray", "local"]

#: Ports derived from a job id fall in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``: unprivileged, and below
#: Linux's default ephemeral range (32768-60999), so no outgoing connection of the node can already hold it.
PORT_BASE: Final = 20000
PORT_SPAN: Final = 12000

#: Port used by single-node MPI runs when neither ``MASTER_PORT`` nor a job id variable is available.
#: Two such runs on one machine at the same time would collide; set ``MASTER_PORT`` to run several.
MPI_FALLBACK_PORT: Final = 29500

#: Loopback rendezvous address for runs that stay on one machine.
LOOPBACK: Final = "127.0.0.1"

HostResolver = Callable[[str], None]
"""Raises ``OSError`` when a host name cannot be resolved; returns nothing otherwise."""


def _valid_port(_: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise LauncherError(f"{attribute.name}={value} is not a TCP port (1-65535)")


@attrs.frozen
class Topology:
    """Where this process sits in a job started by an external launcher.

    Attributes:
        launcher: a `LauncherKind`: ``"torchrun"``, ``"kubernetes"``, ``"env"``, ``"mpi"`` or ``"slurm"`` from
            `detect` (self-spawn is ``detect()`` returning ``None``); distfn's own workers carry ``"spawn"``, Ray
            actors ``"ray"``, a single in-place process ``"local"``.
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank among the processes of this node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, ``0 <= node_rank < num_nodes``.
        num_nodes: number of nodes of the job (step).
        master_addr: host of rank 0's rendezvous; ``None`` only where the rendezvous is decided elsewhere
            (a multi-node MPI run without ``MASTER_ADDR``: see `distfn.rendezvous.resolve_rendezvous`).
        master_port: TCP port of the rendezvous, the same on every process; ``None`` together with
            ``master_addr``.
        reason: a human sentence saying why this launcher was detected.
    """

    launcher: LauncherKind
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None = attrs.field(validator=_valid_port)
    reason: str

    def __attrs_post_init__(self) -> None:
        # A safety net behind the detectors' own checks (which name the variables): a Topology that would
        # make init_process_group wait for peers that never come cannot exist.
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} < 1")
        if not 0 <= self.rank < self.world_size:
            problems.append(f"rank={self.rank} not in [0, world_size={self.world_size})")
        if not 1 <= self.local_world_size <= self.world_size:
            problems.append(f"local_world_size={self.local_world_size} not in [1, world_size={self.world_size}]")
        if not 0 <= self.local_rank < self.local_world_size:
            problems.append(f"local_rank={self.local_rank} not in [0, local_world_size={self.local_world_size})")
        if not 1 <= self.num_nodes <= self.world_size:
            problems.append(f"num_nodes={self.num_nodes} not in [1, world_size={self.world_size}]")
        if not 0 <= self.node_rank < self.num_nodes:
            problems.append(f"node_rank={self.node_rank} not in [0, num_nodes={self.num_nodes})")
        if problems:
            raise LauncherError(f"inconsistent {self.launcher} topology: {'; '.join(problems)} ({self.reason})")

    @classmethod
    def local(cls) -> Topology:
        """One process run in place (``mode="single"``/``"dp"``, or ``nprocs == 1``): rank 0 of 1, no rendezvous."""
        return cls(launcher="local", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                   num_nodes=1, master_addr=None, master_port=None, reason="one process, run in place")

    @classmethod
    def self_spawned(cls, rank: int, world_size: int, port: int) -> Topology:
        """Worker ``rank`` of ``world_size`` that distfn started on this machine, meeting on loopback ``port``."""
        return cls(launcher="spawn", rank=rank, local_rank=rank, world_size=world_size,
                   local_world_size=world_size, node_rank=0, num_nodes=1, master_addr=LOOPBACK, master_port=port,
                   reason=f"{world_size} workers started by the calling process")


# ---------------------------------------------------------------------------------------------------------
# Small parsing helpers (every error names the variable and its value)
# ---------------------------------------------------------------------------------------------------------


def env_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    """``env[name]`` as an int >= minimum, or a LauncherError naming the variable and its value."""
    raw = env[name]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer; the launcher set it wrongly or it was "
                            f"overwritten: unset or fix {name}") from None
    if value < minimum:
        raise LauncherError(f"{name}={raw!r} must be >= {minimum}")
    return value


def first_set(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set to a non-empty value, or None."""
    for name in names:
        if env.get(name, "").strip():
            return name
    return None


def require(env: Mapping[str, str], launcher: str, names: Sequence[str], hint: str) -> None:
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        present = {n: env[n] for n in names if env.get(n, "").strip()}
        raise LauncherError(
            f"launcher {launcher!r}: missing environment variable(s) {', '.join(missing)}"
            + (f" (set: {fmt_values(present)})" if present else "")
            + f". {hint}"
        )


def fmt_values(values: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def env_port(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise LauncherError(f"{name}={raw!r} is not a TCP port (an integer in 1-65535); "
                            f"set {name} to a free port such as 29500, or unset it")
    return value


def derive_port(job_id: str) -> int:
    """A rendezvous port derived from a launcher's job id: the same on every process of the job.

    Numeric ids map to ``PORT_BASE + id % PORT_SPAN``; other strings through CRC-32 (stable across
    processes, unlike ``hash()``). Two jobs collide only when their ids are ``PORT_SPAN`` apart.
    """
    text = str(job_id).strip()
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return PORT_BASE + number % PORT_SPAN


# ---------------------------------------------------------------------------------------------------------
# Detectors: one per launcher. ``claim`` says whether the launcher is present (and why), ``topology``
# reads it; both are pure functions of (env, argv).
# ---------------------------------------------------------------------------------------------------------


@attrs.frozen
class Claim:
    """A detector's finding that its launcher started this process: why, and which flavour (``"env"``: torch's
    variable names, but a plain env:// launcher)."""

    reason: str
    flavor: str = ""


class Detector(Protocol):
    """One launcher's detection: ``claim`` says whether it started this process (and why), ``topology`` reads
    where the process sits; both are pure functions of (env, argv)."""

    @property
    def name(self) -> str: ...

    @property
    def variables(self) -> tuple[str, ...]: ...

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> Claim | None: ...

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: Claim | None) -> Topology: ...
