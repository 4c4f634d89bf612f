"""The rules of ``launcher="ray"`` that need no Ray and no cluster: which options make sense, how many ranks, which
actor gets which rank, each rank's `Topology`, and where a rank's relative paths go.

`distfn.plan` asks `check_options` when it plans a call (at decoration too), so this module imports only the
options and the topology (`distfn.launch.ray`, the driver and the actors, loads the rank protocol and with it the
rank bootstrap, ~60 ms after torch, measured with ``python -X importtime``). Tested without Ray
(tests/test_ray.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from ..errors import ConfigError
from ..options import NPROCS_ENV, Options, fixed_nprocs
from ..topology import Topology

__all__ = ["CPUS_PER_RANK", "ActorPlace", "Assignment", "WorkingDir", "assign_ranks", "check_options",
           "choose_working_dir", "ray_nprocs", "topology_for"]

#: CPUs that each rank's actor reserves on its node (as Ray Train's workers do by default).
CPUS_PER_RANK: Final = 1


def check_options(opts: Options) -> None:
    """Refuse the options that cannot mean anything on a Ray cluster (`ConfigError`, at the call)."""
    if opts.mode == "dp":
        raise ConfigError("mode='dp' runs one process over the GPUs of one machine; with launcher='ray' use "
                          "mode='ddp' (one actor per GPU) or mode='single'")
    if opts.devices is not None:
        raise ConfigError(f"devices={opts.devices} picks GPUs of this machine; with launcher='ray' Ray gives each "
                          "rank's actor its GPU: drop devices= (limit the GPUs with nprocs= instead)")


def ray_nprocs(opts: Options, env: Mapping[str, str], cluster_gpus: float) -> int:
    """How many ranks (actors) a Ray job starts: the rule of a local job (`distfn.options.fixed_nprocs`:
    ``DISTFN_NPROCS`` / ``nprocs=``, else 1 in ``mode="single"``), else one per GPU of the cluster; on a cluster
    without GPUs the count must be given (`ConfigError`)."""
    check_options(opts)
    fixed = fixed_nprocs(opts, env)
    if fixed is not None:
        return fixed
    gpus = int(cluster_gpus)
    if gpus < 1:
        raise ConfigError(
            f"launcher='ray': the Ray cluster has no GPUs, so distfn cannot tell how many ranks to start; give the "
            f"count with nprocs= (or {NPROCS_ENV}=N): N actors with {CPUS_PER_RANK} CPU each, joined over gloo")
    return gpus


@attrs.frozen
class ActorPlace:
    """Where one rank's actor runs, as the actor itself reports it (`RankActor.where`)."""

    bundle: int  # its bundle in the placement group
    node_id: str  # Ray's node id (two raylets on one machine are two nodes)
    node_ip: str
    host: str
    pid: int
    gpu_ids: tuple[str, ...] = ()  # the GPUs Ray assigned to it


@attrs.frozen
class Assignment:
    """What `assign_ranks` decides for one actor."""

    place: ActorPlace
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    #: ``CUDA_VISIBLE_DEVICES`` for the actor: every GPU of the node's ranks, ordered by local rank (so local rank
    #: i uses ``cuda:i`` and NCCL sees its peers' GPUs, as under torchrun); ``None`` without GPUs.
    visible_devices: str | None


def _gpu_key(place: ActorPlace) -> tuple[Any, ...]:
    ids = [int(g) if str(g).isdigit() else -1 for g in place.gpu_ids]
    return (min(ids) if ids else -1, place.bundle)


def assign_ranks(places: Sequence[ActorPlace]) -> list[Assignment]:
    """Ranks for the actors, node by node: the node holding bundle 0 is node 0 (rank 0's node); nodes follow in
    the order of their first bundle, and on each node the actors are ordered by GPU (then bundle). Returned in
    rank order."""
    nodes: dict[str, list[ActorPlace]] = {}
    for place in sorted(places, key=lambda p: p.bundle):
        nodes.setdefault(place.node_id, []).append(place)
    out: list[Assignment] = []
    for node_rank, members in enumerate(nodes.values()):
        members = sorted(members, key=_gpu_key)
        gpus = [g for m in members for g in m.gpu_ids]
        visible = ",".join(dict.fromkeys(gpus)) if gpus else None
        for local_rank, place in enumerate(members):
            out.append(Assignment(place, len(out), local_rank, len(members), node_rank, len(nodes), visible))
    return out


def topology_for(assignment: Assignment, world_size: int, master_addr: str, master_port: int) -> Topology:
    """The `Topology` of one actor's rank (launcher ``"ray"``)."""
    a = assignment
    return Topology(launcher="ray", rank=a.rank, local_rank=a.local_rank, world_size=world_size,
                    local_world_size=a.local_world_size, node_rank=a.node_rank, num_nodes=a.num_nodes,
                    master_addr=master_addr, master_port=master_port,
                    reason=f"Ray actor {a.rank} of {world_size} on node {a.place.node_ip} "
                           f"({a.place.node_id[:8]}), {a.num_nodes} node(s)")


@attrs.frozen
class WorkingDir:
    """Where one rank runs the function (`choose_working_dir`)."""

    #: the directory to change to for the call (the driver's), or ``None``: stay where the actor is
    change_to: str | None
    #: what the rank logs once, as a warning, when relative paths cannot mean what they meant at the driver
    warning: str | None = None


def choose_working_dir(driver_cwd: str, actor_cwd: str, node: str, is_dir: Callable[[str], bool]) -> WorkingDir:
    """Where a rank on ``node`` (the actor's working directory: ``actor_cwd``, its raylet's) runs the function so
    that relative paths (``ctx.save(model, "out/m.safetensors")``, ``open("data.csv")``) resolve where they would
    at the driver (``driver_cwd``): in the driver's directory when that exists on the node (a local cluster, a
    shared file system), as Ray's ``runtime_env={"working_dir": ...}`` does without the upload; else where the
    actor is, with a warning naming both directories. ``is_dir`` asks the node's file system."""
    if driver_cwd == actor_cwd:
        return WorkingDir(None)
    if is_dir(driver_cwd):
        return WorkingDir(driver_cwd)
    return WorkingDir(None, f"the driver's working directory {driver_cwd} does not exist on node {node}, so relative "
                            f"paths in the function resolve in this Ray actor's working directory there: {actor_cwd}; "
                            "use absolute paths on a file system every node shares (or start the driver from a "
                            "directory that exists on every node)")
