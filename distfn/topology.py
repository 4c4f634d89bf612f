"""Which external launcher started this process, and where it sits in the job.

Everything here is *pure detection*: `detect` takes a mapping of environment variables (and the
process's argv) and returns a frozen `Topology`, or ``None`` when no external launcher is present and
distfn should start ("self-spawn") its own workers. Detectors never read ``os.environ`` themselves and never
mutate anything, so the tests can feed recorded environments of real launchers without monkeypatching.

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

Why one module of ~930 lines: the three detectors share the parsing helpers (every error names the variable and
its value) and the nesting rules above are decided between them; reading one launcher's rules means reading the
others' claims. The Slurm formats (hostlists, task counts) are the only self-contained part.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import re
import socket
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn, Protocol

import attrs
from loguru import logger

from .errors import LauncherError
from .options import LAUNCHERS

__all__ = [
    "DETECTORS",
    "LAUNCHERS",
    "MPI_FALLBACK_PORT",
    "Topology",
    "derive_port",
    "describe",
    "detect",
    "expand_hostlist",
    "expand_tasks_per_node",
    "mpi4py_available",
    "split_local_rank",
]

#: Ports derived from a job id fall in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``: unprivileged, and below
#: Linux's default ephemeral range (32768-60999), so no outgoing connection of the node can already hold it.
PORT_BASE: Final = 20000
PORT_SPAN: Final = 12000

#: Port used by single-node MPI runs when neither ``MASTER_PORT`` nor a job id variable is available.
#: Two such runs on one machine at the same time would collide; set ``MASTER_PORT`` to run several.
MPI_FALLBACK_PORT: Final = 29500

#: Loopback rendezvous address for runs that stay on one machine.
LOOPBACK: Final = "127.0.0.1"

# Slurm's special step ids (slurm.h): the batch script, the extern step, the interactive step of salloc,
# pending steps. Their processes are not tasks of a user step, like the batch step without SLURM_STEP_ID.
_SLURM_SPECIAL_STEP_MIN: Final = 0xFFFFFFF0
_SLURM_SPECIAL_STEP_NAMES: Final = frozenset({"batch", "extern", "interactive", "pending"})

HostResolver = Callable[[str], None]
"""Raises ``OSError`` when a host name cannot be resolved; returns nothing otherwise."""


def _valid_port(_: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise LauncherError(f"{attribute.name}={value} is not a TCP port (1-65535)")


@attrs.frozen
class Topology:
    """Where this process sits in a job started by an external launcher.

    Attributes:
        launcher: ``"torchrun"``, ``"mpi"`` or ``"slurm"`` from `detect` (self-spawn is ``detect()``
            returning ``None``; distfn's own workers carry ``"spawn"``, a single in-place process ``"local"``).
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

    launcher: str
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
                   reason=f"self-spawned {world_size} workers")


# ---------------------------------------------------------------------------------------------------------
# Small parsing helpers (every error names the variable and its value)
# ---------------------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
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


def _first(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set to a non-empty value, or None."""
    for name in names:
        if env.get(name, "").strip():
            return name
    return None


def _require(env: Mapping[str, str], launcher: str, names: Sequence[str], hint: str) -> None:
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        present = {n: env[n] for n in names if env.get(n, "").strip()}
        raise LauncherError(
            f"launcher {launcher!r}: missing environment variable(s) {', '.join(missing)}"
            + (f" (set: {_fmt(present)})" if present else "")
            + f". {hint}"
        )


def _fmt(values: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _port(env: Mapping[str, str], name: str) -> int:
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


_LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(?:=(.*))?$")


def _find_local_rank(argv: Sequence[str]) -> tuple[int, int, str, int] | None:
    """The legacy flag in argv: (index, number of items it takes, the text found, the local rank)."""
    args = list(argv)
    for i, arg in enumerate(args):
        m = _LOCAL_RANK_ARG.match(arg)
        if not m:
            continue
        value, text, width = m.group(1), arg, 1
        if value is None:
            if i + 1 >= len(args):
                raise LauncherError(f"{arg!r} in argv has no value; torch.distributed.launch passes "
                                    f"'--local-rank=N'")
            value, text, width = args[i + 1], f"{arg} {args[i + 1]}", 2
        try:
            return i, width, text, int(value)
        except ValueError:
            raise LauncherError(f"{text!r} in argv: the local rank {value!r} is not an integer") from None
    return None


def _argv_local_rank(argv: Sequence[str]) -> tuple[str, int] | None:
    """``--local-rank=N`` / ``--local_rank=N`` / ``--local-rank N`` / ``--local_rank N`` from argv: (text, N)."""
    found = _find_local_rank(argv)
    return None if found is None else (found[2], found[3])


def split_local_rank(argv: Sequence[str]) -> tuple[list[str], int] | None:
    """``argv`` without the local-rank flag of ``python -m torch.distributed.launch``, and the rank it carried.

    The legacy launcher appends ``--local-rank=N`` to the script's arguments (``--local_rank=N`` before torch
    2.0; ``--local-rank N`` and ``--local_rank N`` are read too). ``None`` when argv has no such flag.

    Raises:
        LauncherError: the flag has no value, or a value that is not an integer.
    """
    found = _find_local_rank(argv)
    if found is None:
        return None
    i, width, _, local_rank = found
    args = list(argv)
    return args[:i] + args[i + width:], local_rank


# ---------------------------------------------------------------------------------------------------------
# Hostlists and compressed task counts (Slurm's formats)
# ---------------------------------------------------------------------------------------------------------


def _split_top_level(s: str, what: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LauncherError(f"{what} {s!r}: nested '[' is not valid")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LauncherError(f"{what} {s!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LauncherError(f"{what} {s!r}: '[' without ']'")
    parts.append("".join(cur))
    return parts


def _expand_range_group(body: str, whole: str) -> list[str]:
    """``01-04,07`` -> ['01', '02', '03', '04', '07'] (width kept from the start of each range)."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise LauncherError(f"hostlist {whole!r}: {item!r} in '[{body}]' is not a number or a range a-b")
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LauncherError(f"hostlist {whole!r}: range {item!r} runs backwards")
        # Slurm pads every number of a range to the width of its first bound: [08-10] -> 08 09 10
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(s: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    ``node[01-04,07]`` -> node01..node04, node07; ``a[1-2]-ib,b3`` -> a1-ib, a2-ib, b3; several bracket
    groups make a product with the last group varying fastest (``r[1-2]n[01-02]`` -> r1n01, r1n02, r2n01,
    r2n02), which is what ``scontrol show hostnames`` prints. Zero padding is kept from each range's start.

    Raises:
        LauncherError: unbalanced or nested brackets, a bracket item that is not a number or range, a
            backwards range, or an empty list.
    """
    text = (s or "").strip()
    if not text:
        raise LauncherError("hostlist is empty: the launcher did not say which nodes the job has")
    hosts: list[str] = []
    for part in _split_top_level(text, "hostlist"):
        part = part.strip()
        if not part:
            raise LauncherError(f"hostlist {s!r} has an empty entry")
        # A host pattern alternates literal text and bracket groups; each group multiplies the names.
        expansions = [""]
        for literal, group in re.findall(r"([^\[\]]*)(\[[^\]]*\])?", part):
            choices = [literal]
            if group:
                if group == "[]":
                    raise LauncherError(f"hostlist {s!r}: empty brackets in {part!r}")
                choices = [literal + item for item in _expand_range_group(group[1:-1], s)]
            expansions = [prefix + c for prefix in expansions for c in choices]
        hosts.extend(expansions)
    return hosts


def expand_tasks_per_node(s: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node form: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        LauncherError: an entry that is not ``N`` or ``N(xM)`` with positive integers.
    """
    text = (s or "").strip()
    if not text:
        raise LauncherError("tasks-per-node list is empty")
    out: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise LauncherError(f"tasks-per-node {s!r}: {item!r} is not 'N' or 'N(xM)' with N, M >= 1")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


# ---------------------------------------------------------------------------------------------------------
# Detectors: one per launcher. ``claim`` says whether the launcher is present (and why), ``topology``
# reads it; both are pure functions of (env, argv).
# ---------------------------------------------------------------------------------------------------------


@attrs.frozen
class _Claim:
    reason: str
    flavor: str = ""


class Detector(Protocol):
    """One launcher's detection: ``claim`` says whether it started this process (and why), ``topology`` reads
    where the process sits; both are pure functions of (env, argv)."""

    @property
    def name(self) -> str: ...

    @property
    def variables(self) -> tuple[str, ...]: ...

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None: ...

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: _Claim | None) -> Topology: ...


class TorchrunDetector:
    """``torchrun`` (torch elastic), ``python -m torch.distributed.launch`` and plain ``env://`` launchers
    (Kubernetes PyTorchJob, hand-made sets), which share torch's variable names."""

    name: Final = "torchrun"
    variables: Final = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "KUBERNETES_SERVICE_HOST")

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None:
        """Why this process looks started by torchrun, or None; a partial ``RANK`` set is an error."""
        run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
        if run_id:
            return _Claim(self._agent_reason(env, run_id))
        legacy = _argv_local_rank(argv)
        if legacy is not None:
            return _Claim(f"{legacy[0]!r} is in argv (python -m torch.distributed.launch)", "launch")
        core = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
        present = [n for n in core if env.get(n, "").strip()]
        if len(present) == len(core):
            where = ("; KUBERNETES_SERVICE_HOST is set: a Kubernetes pod, e.g. a Kubeflow PyTorchJob"
                     if env.get("KUBERNETES_SERVICE_HOST", "").strip() else "")
            return _Claim(f"RANK, WORLD_SIZE and MASTER_ADDR are set without TORCHELASTIC_RUN_ID (a plain env:// "
                          f"launcher{where})", "env")
        # MASTER_ADDR alone is a legitimate hint for MPI or SLURM runs; RANK or WORLD_SIZE alone is not.
        if "RANK" in present or "WORLD_SIZE" in present:
            self._raise_partial(env)
        return None

    @staticmethod
    def _agent_reason(env: Mapping[str, str], run_id: str) -> str:
        # torchrun's --rdzv-id defaults to the string "none" (the agents of a multi-node job without --rdzv-id)
        if run_id == "none":
            reason = "TORCHELASTIC_RUN_ID is set, to torchrun's default 'none' (no --rdzv-id given)"
        else:
            reason = f"TORCHELASTIC_RUN_ID={run_id} is set"
        agents = env.get("GROUP_WORLD_SIZE", "").strip()
        if agents.isdigit() and int(agents) > 1:
            reason += f"; torchrun agent {env.get('GROUP_RANK', '?').strip()} of {agents}"
        return reason

    @staticmethod
    def _raise_partial(env: Mapping[str, str]) -> None:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        present = {n: env[n] for n in names if env.get(n, "").strip()}
        missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n not in present]
        raise LauncherError(
            f"partial env:// environment: {_fmt(present)} set but {', '.join(missing)} missing. Either launch "
            "with torchrun (which sets them all), set all of RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT, or unset the stray ones to let distfn detect another launcher or self-spawn"
        )

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: _Claim | None) -> Topology:
        """The torchrun topology; raises when the variables torchrun always sets are missing.

        A plain ``env://`` launcher (claim flavour ``"env"``: a Kubernetes PyTorchJob, a hand-made set) gives each
        process ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` only: without ``LOCAL_RANK`` the process
        is alone on its node (one per pod), local rank 0 of ``LOCAL_WORLD_SIZE`` (default 1). Its launcher is
        ``"kubernetes"`` where ``KUBERNETES_SERVICE_HOST`` is set, else ``"env"``.
        """
        reason = claim.reason if claim else "launcher='torchrun' was forced"
        plain = claim is not None and claim.flavor == "env"
        legacy = _argv_local_rank(argv)
        required = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        if legacy is None and not plain:
            required.insert(2, "LOCAL_RANK")
        hint = ("A plain env:// launcher (a Kubernetes PyTorchJob, or variables set by hand) must set all four; "
                "torchrun sets them itself." if plain else
                "Run the script with `torchrun --nproc_per_node=N script.py`, or use launcher='auto'.")
        _require(env, "env://" if plain else "torchrun", required, hint)
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE", minimum=1)
        if not 0 <= rank < world:
            raise LauncherError(f"RANK={env['RANK']!r} is not in [0, WORLD_SIZE={env['WORLD_SIZE']!r})")
        local_rank = self._local_rank(env, legacy)
        alone = plain and local_rank is None  # one process per pod / node
        local_world = self._local_world(env, world, alone)
        local_rank = local_rank or 0
        if not 0 <= local_rank < local_world <= world:
            raise LauncherError(
                f"local rank {local_rank} (LOCAL_RANK / --local-rank) is not in [0, LOCAL_WORLD_SIZE="
                f"{local_world}) or LOCAL_WORLD_SIZE exceeds WORLD_SIZE={world}")
        num_nodes, node_rank = self._nodes(env, rank, world, local_world)
        launcher = "torchrun"
        if plain:
            launcher = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST", "").strip() else "env"
        return Topology(
            launcher=launcher, rank=rank, local_rank=local_rank, world_size=world,
            local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
            master_addr=env["MASTER_ADDR"].strip(), master_port=_port(env, "MASTER_PORT"), reason=reason,
        )

    @staticmethod
    def _local_rank(env: Mapping[str, str], legacy: tuple[str, int] | None) -> int | None:
        """``LOCAL_RANK`` (or the legacy argv flag, which must agree with it), ``None`` when neither is set."""
        if legacy is not None:
            if env.get("LOCAL_RANK", "").strip() and _int(env, "LOCAL_RANK") != legacy[1]:
                raise LauncherError(f"LOCAL_RANK={env['LOCAL_RANK']!r} disagrees with {legacy[0]!r} in argv")
            return legacy[1]
        return _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK", "").strip() else None

    @staticmethod
    def _local_world(env: Mapping[str, str], world: int, alone: bool) -> int:
        if env.get("LOCAL_WORLD_SIZE", "").strip():
            return _int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if env.get("GROUP_WORLD_SIZE", "").strip() and world % _int(env, "GROUP_WORLD_SIZE", minimum=1) == 0:
            return world // _int(env, "GROUP_WORLD_SIZE", minimum=1)
        # A process without LOCAL_RANK is alone on its node; old launchers and hand-made sets with LOCAL_RANK do
        # not say how many share the node, and one node holding every rank is the only safe guess.
        return 1 if alone else world

    @staticmethod
    def _nodes(env: Mapping[str, str], rank: int, world: int, local_world: int) -> tuple[int, int]:
        """(number of nodes, node index) from GROUP_WORLD_SIZE / GROUP_RANK / NODE_RANK, else the layout."""
        if env.get("GROUP_WORLD_SIZE", "").strip():
            num_nodes = _int(env, "GROUP_WORLD_SIZE", minimum=1)
        else:
            num_nodes = max(1, world // local_world)
        if env.get("GROUP_RANK", "").strip():
            node_rank = _int(env, "GROUP_RANK")
        elif env.get("NODE_RANK", "").strip():
            node_rank = _int(env, "NODE_RANK")
        else:
            node_rank = rank // local_world
        if not 0 <= node_rank < num_nodes:
            raise LauncherError(f"node rank {node_rank} (GROUP_RANK / NODE_RANK) is not in [0, GROUP_WORLD_SIZE="
                                f"{num_nodes})")
        return num_nodes, node_rank


# (flavor, rank, size, local rank candidates, local size candidates, job id candidates)
_MPI_FLAVORS: Final = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",), ("OMPI_MCA_ess_base_jobid",)),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
     ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"), ("PMI_JOBID", "I_MPI_JOB_ID")),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",),
     ("MV2_COMM_WORLD_LOCAL_SIZE",), ("MPIRUN_ID",)),
)


class MpiDetector:
    """``mpirun``/``mpiexec`` of Open MPI, MPICH, Intel MPI and MVAPICH."""

    name: Final = "mpi"
    variables: Final = (
        *dict.fromkeys(v for f in _MPI_FLAVORS for v in (f[1], f[2], *f[3], *f[4], *f[5])),
        "OMPI_MCA_orte_num_nodes", "MASTER_ADDR", "MASTER_PORT",
    )

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None:
        """Why this process looks started by an MPI launcher, or None."""
        for flavor, rank, size, *_ in _MPI_FLAVORS:
            if env.get(rank, "").strip() and env.get(size, "").strip():
                if rank == "PMI_RANK" and _srun_pmi(env):
                    # `srun --mpi=pmi2` exports PMI_RANK/PMI_SIZE as its wire-up interface: srun is the
                    # launcher, and its SLURM step variables say more (local rank, nodes).
                    return None
                return _Claim(f"{rank}={env[rank]} and {size}={env[size]} are set ({flavor})", flavor)
        return None

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: _Claim | None) -> Topology:
        """The MPI topology; the rendezvous is loopback on one node, else MASTER_ADDR or mpi4py."""
        if claim is None and env.get("PMI_RANK", "").strip() and _srun_pmi(env):
            raise LauncherError(
                f"launcher 'mpi' was forced but PMI_RANK={env['PMI_RANK']!r}/PMI_SIZE={env.get('PMI_SIZE')!r} come "
                "from `srun --mpi=pmi2`: srun is the launcher here; use launcher='slurm' or 'auto'")
        if claim is None:
            families = "; ".join(f"{f[0]}: {f[1]}, {f[2]}" for f in _MPI_FLAVORS)
            raise LauncherError(
                f"launcher 'mpi' was forced but no MPI rank variables are set ({families}). Start the script "
                "with `mpirun -np N python script.py` (or mpiexec/srun --mpi=...), or use launcher='auto'.")
        flavor = next(f for f in _MPI_FLAVORS if f[0] == claim.flavor)
        _, rank_var, size_var, local_rank_vars, local_size_vars, job_vars = flavor
        rank = _int(env, rank_var)
        world = _int(env, size_var, minimum=1)
        if rank >= world:
            raise LauncherError(f"{rank_var}={env[rank_var]!r} is not below {size_var}={env[size_var]!r}")
        lr_var, ls_var = _first(env, *local_rank_vars), _first(env, *local_size_vars)
        if lr_var is None or ls_var is None:
            if world == 1:
                local_rank, local_world = 0, 1
            else:
                raise LauncherError(
                    f"{claim.reason}, but the local rank is unknown: none of "
                    f"{', '.join(local_rank_vars + local_size_vars)} is set. distfn needs the rank within the "
                    "node to pick a device; use an MPI launcher that exports them (mpiexec.hydra, Intel "
                    "mpirun) or start the job with torchrun/srun")
        else:
            local_rank, local_world = _int(env, lr_var), _int(env, ls_var, minimum=1)
            if not 0 <= local_rank < local_world <= world:
                raise LauncherError(f"{lr_var}={env[lr_var]!r}, {ls_var}={env[ls_var]!r} and "
                                    f"{size_var}={env[size_var]!r} are inconsistent")
        num_nodes, node_rank = self._nodes(env, rank, world, local_rank, local_world)
        spread = claim.reason
        if num_nodes > 1 and ls_var is not None:
            spread += f" on {num_nodes} nodes ({ls_var}={env[ls_var]!r} < {size_var}={env[size_var]!r})"
        addr, port, how = self._rendezvous(env, _first(env, *job_vars), num_nodes, spread)
        return Topology(
            launcher="mpi", rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port, reason=claim.reason + how,
        )

    @staticmethod
    def _rendezvous(env: Mapping[str, str], job_var: str | None, num_nodes: int,
                    spread: str) -> tuple[str | None, int | None, str]:
        """(address, port, the reason's tail): loopback on one node, else MASTER_ADDR, else deferred to mpi4py."""
        if env.get("MASTER_PORT", "").strip():
            port, port_how = _port(env, "MASTER_PORT"), ""
        elif job_var:
            port, port_how = derive_port(env[job_var]), f"; single node, port derived from {job_var}"
        else:
            port = MPI_FALLBACK_PORT
            port_how = f"; single node, fixed port {MPI_FALLBACK_PORT} (set MASTER_PORT to run several jobs)"
        if env.get("MASTER_ADDR", "").strip():
            addr = env["MASTER_ADDR"].strip()
            return addr, port, f"; rendezvous at MASTER_ADDR={addr}:{port}"
        if num_nodes == 1:
            # Every rank is on this machine: loopback needs no agreement between ranks.
            return LOOPBACK, port, port_how
        if not mpi4py_available():
            raise LauncherError(
                f"{spread}, but MASTER_ADDR is not set and mpi4py is not installed, so the "
                "ranks cannot agree on a rendezvous address. Either export it to every rank, e.g. "
                "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`, or install mpi4py "
                "(`pip install 'distfn[mpi]'`) so rank 0 broadcasts its address")
        return None, None, "; rendezvous to be broadcast by mpi4py"

    @staticmethod
    def _nodes(env: Mapping[str, str], rank: int, world: int, local_rank: int, local_world: int) -> tuple[int, int]:
        """(number of nodes, node index). MPI says neither directly; both follow from the rank mapping."""
        if local_world == world:
            return 1, 0
        if env.get("OMPI_MCA_orte_num_nodes", "").strip():
            num_nodes = _int(env, "OMPI_MCA_orte_num_nodes", minimum=1)
        else:
            num_nodes = -(-world // local_world)
        # Block mapping (mpirun's default: fill a node, then the next) puts rank r on node r // local_world;
        # round-robin (--map-by node) puts it on r % num_nodes. Tell them apart by the local rank.
        if rank % local_world == local_rank:
            node_rank = rank // local_world
        elif rank // num_nodes == local_rank:
            node_rank = rank % num_nodes
        else:
            logger.warning("MPI rank {} / local rank {}: unknown rank mapping, node rank guessed as {}",
                           rank, local_rank, rank // local_world)
            node_rank = rank // local_world
        return num_nodes, min(node_rank, num_nodes - 1)


def _srun_pmi(env: Mapping[str, str]) -> bool:
    """PMI_RANK/PMI_SIZE are srun's own (``srun --mpi=pmi2``): they equal the step's task rank and count."""
    if SLURM.claim(env, ()) is None:
        return False
    ntasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "")).strip()
    return env["PMI_RANK"].strip() == env["SLURM_PROCID"].strip() and env["PMI_SIZE"].strip() == ntasks


def mpi4py_available() -> bool:
    """Whether mpi4py can be imported (asked without importing it: importing it initialises MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


class SlurmDetector:
    """A task of a SLURM job step (``srun``); the batch script and an ``salloc`` shell are not one."""

    name: Final = "slurm"
    variables: Final = (
        "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
        "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES",
        "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURMD_NODENAME", "MASTER_ADDR", "MASTER_PORT",
    )

    @staticmethod
    def _step(env: Mapping[str, str]) -> tuple[str, str] | None:
        name = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
        return (name, env[name].strip()) if name else None

    @staticmethod
    def _is_task_step(step_id: str) -> bool:
        if step_id.lower() in _SLURM_SPECIAL_STEP_NAMES:
            return False
        return not (step_id.isdigit() and int(step_id) >= _SLURM_SPECIAL_STEP_MIN)

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None:
        """Why this process looks like a task of an ``srun`` step, or None (batch step, salloc, no SLURM)."""
        step = self._step(env)
        if step is None or not env.get("SLURM_PROCID", "").strip() or not self._is_task_step(step[1]):
            return None
        return _Claim(f"{step[0]}={step[1]} and SLURM_PROCID={env['SLURM_PROCID']} are set (a task of srun "
                      f"step {env.get('SLURM_JOB_ID', '?')}.{step[1]})")

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: _Claim | None) -> Topology:
        """The step's topology, validated: tasks per node x nodes must equal the number of tasks."""
        if claim is None:
            self._raise_not_a_step(env)
        ntasks_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        # Step values first: a step may use a subset of the job's nodes (`srun -N1 -w node2` inside an
        # `sbatch -N2` job gives SLURM_JOB_NUM_NODES=2 but SLURM_NNODES=1 and a step-relative SLURM_NODEID=0).
        nodes_var = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        tpn_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        missing = [label for label, var in (("SLURM_LOCALID", _first(env, "SLURM_LOCALID")),
                                            ("SLURM_NODEID", _first(env, "SLURM_NODEID")),
                                            ("SLURM_STEP_NUM_TASKS or SLURM_NTASKS", ntasks_var),
                                            ("SLURM_STEP_NUM_NODES or SLURM_NNODES", nodes_var),
                                            ("SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE", tpn_var))
                   if var is None]
        if missing:
            raise LauncherError(f"{claim.reason}, but {', '.join(missing)} missing: this does not look like "
                                "a complete srun task environment. Start the script with `srun python script.py`")
        assert ntasks_var and nodes_var and tpn_var  # for type checkers: checked just above
        rank = _int(env, "SLURM_PROCID")
        local_rank = _int(env, "SLURM_LOCALID")
        node_rank = _int(env, "SLURM_NODEID")
        world = _int(env, ntasks_var, minimum=1)
        num_nodes = _int(env, nodes_var, minimum=1)
        per_node = expand_tasks_per_node(env[tpn_var])
        if len(per_node) != num_nodes or sum(per_node) != world:
            raise LauncherError(
                f"inconsistent SLURM step: {tpn_var}={env[tpn_var]!r} expands to {per_node} "
                f"({len(per_node)} node(s), {sum(per_node)} task(s)) but {nodes_var}={env[nodes_var]!r} and "
                f"{ntasks_var}={env[ntasks_var]!r}. Ask srun for a consistent layout, e.g. "
                "`srun -N<nodes> --ntasks-per-node=<tasks>` with ntasks = nodes x tasks-per-node")
        if not 0 <= rank < world:
            raise LauncherError(f"SLURM_PROCID={env['SLURM_PROCID']!r} is not below {ntasks_var}={env[ntasks_var]!r}")
        if not 0 <= node_rank < num_nodes:
            raise LauncherError(f"SLURM_NODEID={env['SLURM_NODEID']!r} is not below {nodes_var}={env[nodes_var]!r}")
        local_world = per_node[node_rank]
        if not 0 <= local_rank < local_world:
            raise LauncherError(f"SLURM_LOCALID={env['SLURM_LOCALID']!r} is not below the {local_world} task(s) "
                                f"of node {node_rank} ({tpn_var}={env[tpn_var]!r})")
        addr, addr_how = self._master_addr(env)
        port, port_how = self._master_port(env)
        return Topology(
            launcher="slurm", rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port,
            reason=f"{claim.reason}; master {addr_how}, port {port_how}",
        )

    @staticmethod
    def _raise_not_a_step(env: Mapping[str, str]) -> NoReturn:
        if env.get("SLURM_JOB_ID", "").strip():
            step = SlurmDetector._step(env)
            where = (f"in the special step {step[0]}={step[1]!r}" if step else
                     "in the batch script or an salloc shell (SLURM_JOB_ID is set, SLURM_STEP_ID is not)")
            raise LauncherError(
                f"launcher 'slurm' was forced but this process runs {where}, which is one process, not a task "
                "of a job step. Start the script with `srun python script.py` inside the job (or use "
                "launcher='auto' to self-spawn on this node)")
        raise LauncherError(
            "launcher 'slurm' was forced but SLURM_JOB_ID, SLURM_STEP_ID and SLURM_PROCID are not set: this "
            "process was not started by srun. Run `srun -N<nodes> --ntasks-per-node=<n> python script.py` "
            "or use launcher='auto'")

    @staticmethod
    def _master_addr(env: Mapping[str, str]) -> tuple[str, str]:
        if env.get("MASTER_ADDR", "").strip():
            return env["MASTER_ADDR"].strip(), "from MASTER_ADDR"
        var = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if var is None:
            raise LauncherError("a SLURM step without SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST: "
                                "cannot tell the master node; set MASTER_ADDR to the first node's host name")
        try:
            first = expand_hostlist(env[var])[0]
        except LauncherError as exc:
            raise LauncherError(f"{var}={env[var]!r}: {exc}; set MASTER_ADDR to the first node's host name") from None
        return first, f"= first host of {var}={env[var]}"

    @staticmethod
    def _master_port(env: Mapping[str, str]) -> tuple[int, str]:
        if env.get("MASTER_PORT", "").strip():
            return _port(env, "MASTER_PORT"), "from MASTER_PORT"
        if not env.get("SLURM_JOB_ID", "").strip():
            raise LauncherError("a SLURM step without SLURM_JOB_ID: cannot derive a rendezvous port; set MASTER_PORT")
        step = SlurmDetector._step(env)
        step_id = int(step[1]) if step and step[1].isdigit() else 0
        job = env["SLURM_JOB_ID"].strip()
        # Mix the step in so that two steps of one job running side by side (`srun ... &` twice) do not meet
        # on the same port; every task of one step computes the same value.
        key = str(int(job) * 31 + step_id) if job.isdigit() else f"{job}.{step_id}"
        return derive_port(key), f"{derive_port(key)} derived from SLURM_JOB_ID={job}, step {step_id}"


TORCHRUN: Final = TorchrunDetector()
MPI: Final = MpiDetector()
SLURM: Final = SlurmDetector()
DETECTORS: Final[tuple[Detector, ...]] = (TORCHRUN, MPI, SLURM)
"""The detectors, in the order ``auto`` tries them (innermost launcher first)."""


# ---------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------


def _check_resolvable(host: str) -> None:
    """Raise OSError when ``host`` does not resolve (IP literals are accepted without a lookup)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    socket.getaddrinfo(host, None)


def _detect_unchecked(env: Mapping[str, str], argv: Sequence[str], launcher: str) -> Topology | None:
    if launcher in ("spawn", "ray"):  # ray: distfn.ray_launcher makes each actor's Topology
        return None
    if launcher == "auto":
        for det in DETECTORS:
            claim = det.claim(env, argv)
            if claim is None:
                continue
            if det is SLURM:
                world_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
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


def _claim_torchrun_forced(env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None:
    # Forced torchrun reports missing variables itself rather than the "partial set" message, and reads a plain
    # env:// set as torchrun's own (LOCAL_RANK required).
    try:
        claim = TORCHRUN.claim(env, argv)
    except LauncherError:
        return None
    return None if claim is not None and claim.flavor == "env" else claim


def _validate_launcher(launcher: str) -> None:
    if launcher not in LAUNCHERS:
        raise LauncherError(f"launcher={launcher!r} is not one of {', '.join(map(repr, LAUNCHERS))}")


def detect(
    env: Mapping[str, str],
    argv: Sequence[str] = (),
    launcher: str = "auto",
    *,
    resolve_host: HostResolver | None = _check_resolvable,
) -> Topology | None:
    """Detect the external launcher of this process from its environment and argv.

    Args:
        env: the environment variables (``os.environ`` in production, a recorded dict in tests).
        argv: the process's arguments (``sys.argv``), for the legacy ``--local_rank=N``.
        launcher: ``"auto"`` tries torchrun, MPI, then a SLURM step; ``"spawn"`` always returns None; the
            others force that launcher and fail when its variables are missing.
        resolve_host: checks that the master host resolves (raises ``OSError`` if not); ``None`` skips
            the check. The default does a name lookup, the only I/O here.

    Returns:
        The topology, or ``None`` when no external launcher runs this process (distfn self-spawns).

    Raises:
        LauncherError: an unknown ``launcher``, a forced launcher whose variables are missing, or launcher
            variables that contradict each other (named, with their values, and how to fix them).
    """
    _validate_launcher(launcher)
    topo = _detect_unchecked(env, argv, launcher)
    if topo is None:
        if launcher == "spawn":
            others = [d.name for d in DETECTORS if _safe_claim(d, env, argv)]
            if others:
                logger.warning("launcher='spawn' forced although {} variables are set; self-spawning anyway",
                               " and ".join(others))
        return None
    if resolve_host is not None and topo.master_addr is not None:
        try:
            resolve_host(topo.master_addr)
        except OSError as exc:
            raise LauncherError(
                f"the master host {topo.master_addr!r} ({topo.reason}) does not resolve: {exc}. Make the name "
                "resolvable on every node (DNS or /etc/hosts) or set MASTER_ADDR to rank 0's IP address"
            ) from None
    return topo


def _safe_claim(det: Detector, env: Mapping[str, str], argv: Sequence[str]) -> _Claim | None:
    try:
        return det.claim(env, argv)
    except LauncherError as exc:
        return _Claim(f"inconsistent: {exc}")


def describe(env: Mapping[str, str], argv: Sequence[str] = (), launcher: str = "auto") -> dict[str, Any]:
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
        result["reason"] = _spawn_reason(env, launcher)
    else:
        result["launcher"] = topo.launcher
        result["reason"] = topo.reason
        result["topology"] = attrs.asdict(topo)
    return result


def _spawn_reason(env: Mapping[str, str], launcher: str) -> str:
    if launcher == "spawn":
        return "launcher='spawn' was forced"
    if launcher == "ray":
        where = env.get("RAY_ADDRESS") or "the one started on this machine (RAY_ADDRESS unset), else a new one"
        return f"launcher='ray': the ranks run as Ray actors on the Ray cluster at {where}"
    if env.get("SLURM_JOB_ID", "").strip():
        step = SlurmDetector._step(env)
        if step is None:
            return ("inside SLURM job {} but not in a job step (batch script or salloc shell): distfn spawns its "
                    "workers on this node; use `srun python script.py` for one rank per task").format(
                        env["SLURM_JOB_ID"])
        if not SlurmDetector._is_task_step(step[1]):
            return f"inside the special SLURM step {step[1]}: distfn spawns its workers on this node"
        return "a SLURM step with a single task: distfn spawns its workers on this node"
    return "no torchrun, MPI or SLURM step variables: distfn spawns its workers"
