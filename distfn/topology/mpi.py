"""MPI launchers: Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``), MVAPICH
(``MV2_COMM_WORLD_*``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Final

from loguru import logger

from ..errors import LauncherError
from .common import (
    LOOPBACK,
    MPI_FALLBACK_PORT,
    Claim,
    Topology,
    derive_port,
    env_int,
    env_port,
    first_set,
)
from .slurm import SLURM

__all__ = ["MPI", "MpiDetector", "mpi4py_available"]


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

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> Claim | None:
        """Why this process looks started by an MPI launcher, or None."""
        for flavor, rank, size, *_ in _MPI_FLAVORS:
            if env.get(rank, "").strip() and env.get(size, "").strip():
                if rank == "PMI_RANK" and _srun_pmi(env):
                    # `srun --mpi=pmi2` exports PMI_RANK/PMI_SIZE as its wire-up interface: srun is the
                    # launcher, and its SLURM step variables say more (local rank, nodes).
                    return None
                return Claim(f"{rank}={env[rank]} and {size}={env[size]} are set ({flavor})", flavor)
        return None

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: Claim | None) -> Topology:
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
        rank = env_int(env, rank_var)
        world = env_int(env, size_var, minimum=1)
        if rank >= world:
            raise LauncherError(f"{rank_var}={env[rank_var]!r} is not below {size_var}={env[size_var]!r}")
        lr_var, ls_var = first_set(env, *local_rank_vars), first_set(env, *local_size_vars)
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
            local_rank, local_world = env_int(env, lr_var), env_int(env, ls_var, minimum=1)
            if not 0 <= local_rank < local_world <= world:
                raise LauncherError(f"{lr_var}={env[lr_var]!r}, {ls_var}={env[ls_var]!r} and "
                                    f"{size_var}={env[size_var]!r} are inconsistent")
        num_nodes, node_rank = self._nodes(env, rank, world, local_rank, local_world)
        spread = claim.reason
        if num_nodes > 1 and ls_var is not None:
            spread += f" on {num_nodes} nodes ({ls_var}={env[ls_var]!r} < {size_var}={env[size_var]!r})"
        addr, port, how = self._rendezvous(env, first_set(env, *job_vars), num_nodes, spread)
        return Topology(
            launcher="mpi", rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port, reason=claim.reason + how,
        )

    @staticmethod
    def _rendezvous(env: Mapping[str, str], job_var: str | None, num_nodes: int,
                    spread: str) -> tuple[str | None, int | None, str]:
        """(address, port, the reason's tail): loopback on one node, else MASTER_ADDR, else deferred to mpi4py."""
        if env.get("MASTER_PORT", "").strip():
            port, port_how = env_port(env, "MASTER_PORT"), ""
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
            num_nodes = env_int(env, "OMPI_MCA_orte_num_nodes", minimum=1)
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


MPI: Final = MpiDetector()
