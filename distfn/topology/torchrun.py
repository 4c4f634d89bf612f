"""torchrun (torch elastic), ``python -m torch.distributed.launch`` (``--local-rank=N`` in argv) and plain env://
launchers (a Kubernetes PyTorchJob, a set made by hand), which share torch's variable names."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from ..errors import LauncherError
from .common import Claim, LauncherKind, Topology, env_int, env_port, fmt_values, require

__all__ = ["TORCHRUN", "TorchrunDetector", "argv_local_rank", "split_local_rank"]


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


def argv_local_rank(argv: Sequence[str]) -> tuple[str, int] | None:
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


class TorchrunDetector:
    """``torchrun`` (torch elastic), ``python -m torch.distributed.launch`` and plain ``env://`` launchers
    (Kubernetes PyTorchJob, hand-made sets), which share torch's variable names."""

    name: Final = "torchrun"
    variables: Final = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "KUBERNETES_SERVICE_HOST")

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> Claim | None:
        """Why this process looks started by torchrun, or None; a partial ``RANK`` set is an error."""
        run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
        if run_id:
            return Claim(self._agent_reason(env, run_id))
        legacy = argv_local_rank(argv)
        if legacy is not None:
            return Claim(f"{legacy[0]!r} is in argv (python -m torch.distributed.launch)", "launch")
        core = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
        present = [n for n in core if env.get(n, "").strip()]
        if len(present) == len(core):
            where = ("; KUBERNETES_SERVICE_HOST is set: a Kubernetes pod, e.g. a Kubeflow PyTorchJob"
                     if env.get("KUBERNETES_SERVICE_HOST", "").strip() else "")
            return Claim(f"RANK, WORLD_SIZE and MASTER_ADDR are set without TORCHELASTIC_RUN_ID (a plain env:// "
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
            f"partial env:// environment: {fmt_values(present)} set but {', '.join(missing)} missing. Either launch "
            "with torchrun (which sets them all), set all of RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT, or unset the stray ones to let distfn detect another launcher or self-spawn"
        )

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: Claim | None) -> Topology:
        """The torchrun topology; raises when the variables torchrun always sets are missing.

        A plain ``env://`` launcher (claim flavour ``"env"``: a Kubernetes PyTorchJob, a hand-made set) gives each
        process ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` only: without ``LOCAL_RANK`` the process
        is alone on its node (one per pod), local rank 0 of ``LOCAL_WORLD_SIZE`` (default 1). Its launcher is
        ``"kubernetes"`` where ``KUBERNETES_SERVICE_HOST`` is set, else ``"env"``.
        """
        reason = claim.reason if claim else "launcher='torchrun' was forced"
        plain = claim is not None and claim.flavor == "env"
        legacy = argv_local_rank(argv)
        required = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        if legacy is None and not plain:
            required.insert(2, "LOCAL_RANK")
        hint = ("A plain env:// launcher (a Kubernetes PyTorchJob, or variables set by hand) must set all four; "
                "torchrun sets them itself." if plain else
                "Run the script with `torchrun --nproc_per_node=N script.py`, or use launcher='auto'.")
        require(env, "env://" if plain else "torchrun", required, hint)
        rank = env_int(env, "RANK")
        world = env_int(env, "WORLD_SIZE", minimum=1)
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
        launcher: LauncherKind = "torchrun"
        if plain:
            launcher = "kubernetes" if env.get("KUBERNETES_SERVICE_HOST", "").strip() else "env"
        return Topology(
            launcher=launcher, rank=rank, local_rank=local_rank, world_size=world,
            local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
            master_addr=env["MASTER_ADDR"].strip(), master_port=env_port(env, "MASTER_PORT"), reason=reason,
        )

    @staticmethod
    def _local_rank(env: Mapping[str, str], legacy: tuple[str, int] | None) -> int | None:
        """``LOCAL_RANK`` (or the legacy argv flag, which must agree with it), ``None`` when neither is set."""
        if legacy is not None:
            if env.get("LOCAL_RANK", "").strip() and env_int(env, "LOCAL_RANK") != legacy[1]:
                raise LauncherError(f"LOCAL_RANK={env['LOCAL_RANK']!r} disagrees with {legacy[0]!r} in argv")
            return legacy[1]
        return env_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK", "").strip() else None

    @staticmethod
    def _local_world(env: Mapping[str, str], world: int, alone: bool) -> int:
        if env.get("LOCAL_WORLD_SIZE", "").strip():
            return env_int(env, "LOCAL_WORLD_SIZE", minimum=1)
        if env.get("GROUP_WORLD_SIZE", "").strip() and world % env_int(env, "GROUP_WORLD_SIZE", minimum=1) == 0:
            return world // env_int(env, "GROUP_WORLD_SIZE", minimum=1)
        # A process without LOCAL_RANK is alone on its node; old launchers and hand-made sets with LOCAL_RANK do
        # not say how many share the node, and one node holding every rank is the only safe guess.
        return 1 if alone else world

    @staticmethod
    def _nodes(env: Mapping[str, str], rank: int, world: int, local_world: int) -> tuple[int, int]:
        """(number of nodes, node index) from GROUP_WORLD_SIZE / GROUP_RANK / NODE_RANK, else the layout."""
        if env.get("GROUP_WORLD_SIZE", "").strip():
            num_nodes = env_int(env, "GROUP_WORLD_SIZE", minimum=1)
        else:
            num_nodes = max(1, world // local_world)
        if env.get("GROUP_RANK", "").strip():
            node_rank = env_int(env, "GROUP_RANK")
        elif env.get("NODE_RANK", "").strip():
            node_rank = env_int(env, "NODE_RANK")
        else:
            node_rank = rank // local_world
        if not 0 <= node_rank < num_nodes:
            raise LauncherError(f"node rank {node_rank} (GROUP_RANK / NODE_RANK) is not in [0, GROUP_WORLD_SIZE="
                                f"{num_nodes})")
        return num_nodes, node_rank


TORCHRUN: Final = TorchrunDetector()
