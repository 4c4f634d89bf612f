"""One task per node: an external launcher started one process on each node, distfn starts the ranks there.

``srun -N2 --ntasks-per-node=1 python train.py``, ``mpirun -npernode 1`` or one pod per node (``env://``) start
one *launching process* per node, the way torchrun's agent or ``accelerate launch`` run. When more than one
process per node is wanted, each launching process starts ``L`` local workers (`distfn.launch.local`, which the
decorator runs with `NodeLayout.topology` as the workers' places), and the
ranks meet on the launcher's master (Slurm: the first host of the step's nodelist; MPI: ``MASTER_ADDR`` or the
mpi4py broadcast; ``env://``: ``MASTER_ADDR``) with

    global rank = node_rank * L + local_rank,   world size = nodes * L.

When is a per-node launch wanted (`plan`, which `distfn.plan.plan_call` asks)? Only in the multi-rank modes
(ddp/fsdp), only under Slurm, MPI or a plain ``env://`` launcher (torchrun starts its own local workers), and
only when a count above 1 is asked for:

* ``DISTFN_NPROCS=L`` in the environment: the processes per node, set at launch time next to ``srun``;
* else, when the decorator's ``nprocs=`` is not given: ``len(devices)`` or the visible GPUs, as for a plain
  ``python train.py``.

The decorator's own ``nprocs=`` keeps its documented meaning under an external launcher (ignored with a log
line): a script written for ``python train.py`` with ``nprocs=2`` and run as ``srun -N2 -n2`` is still the two
ranks it always was. Several tasks on a node keep the old rule too (one rank per task), unless
``DISTFN_NPROCS`` asks for another count per node: that, and tasks spread unevenly over the nodes, are a
`distfn.errors.LauncherError` raised on every task before anything starts (so no node waits for the others).

What the launching processes return: node 0's returns rank 0's value, like a self-spawned job; the launching
processes of the other nodes return ``None`` (their ranks' values are not sent back).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import attrs
from loguru import logger

from ..errors import LauncherError
from ..options import NPROCS_ENV, Options, default_nprocs, requested_nprocs
from ..topology import LauncherKind, Topology

__all__ = ["PER_NODE_LAUNCHERS", "NodeLayout", "announce", "describe", "plan", "prepare"]

#: Launchers whose one-task-per-node jobs distfn completes with local workers (torchrun starts its own).
PER_NODE_LAUNCHERS = ("slurm", "mpi", "env", "kubernetes")


@attrs.frozen
class NodeLayout:
    """This node's part of a per-node launch: ``local_world_size`` workers on each of ``num_nodes`` nodes.

    Attributes:
        launcher: the external launcher (``"slurm"``, ``"mpi"``, ``"env"``, ``"kubernetes"``); ``ctx.launcher``.
        node_rank: this node's index (the launching task's rank: with one task per node it numbers the nodes).
        num_nodes: nodes of the job, one launching task each.
        local_world_size: workers distfn starts on every node.
        master_addr: host of the rendezvous (the launcher's master, where global rank 0 runs); ``None`` until
            `distfn.rendezvous.resolve_rendezvous` agreed on one (multi-node MPI without ``MASTER_ADDR``).
        master_port: TCP port of the rendezvous; global rank 0 hosts the store there (``None`` with the address).
        reason: the launcher's reason, for the start-up log and ``distfn env``.
        source: where ``local_world_size`` comes from (``DISTFN_NPROCS=4``, ``2 visible GPUs``, ...).
    """

    launcher: LauncherKind
    node_rank: int
    num_nodes: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    reason: str
    source: str = ""

    def at(self, master_addr: str | None, master_port: int | None) -> NodeLayout:
        """This layout meeting at ``master_addr:master_port`` (the rendezvous agreed after planning)."""
        return attrs.evolve(self, master_addr=master_addr, master_port=master_port)

    @property
    def world_size(self) -> int:
        """Ranks of the whole job: ``num_nodes * local_world_size``."""
        return self.num_nodes * self.local_world_size

    def topology(self, local_rank: int) -> Topology:
        """The `Topology` of this node's worker ``local_rank``: global rank ``node_rank * L + local_rank``."""
        return Topology(
            launcher=self.launcher, rank=self.node_rank * self.local_world_size + local_rank, local_rank=local_rank,
            world_size=self.world_size, local_world_size=self.local_world_size, node_rank=self.node_rank,
            num_nodes=self.num_nodes, master_addr=self.master_addr, master_port=self.master_port,
            reason=f"{self.reason}; one task per node, {self.local_world_size} workers started on each",
        )


def _wanted(opts: Options, env: Mapping[str, str], visible_gpus: Callable[[], int]) -> tuple[int | None, str]:
    """(processes per node asked for, where that number comes from); ``None`` when nothing asks."""
    from_env = requested_nprocs(attrs.evolve(opts, nprocs=None), env)
    if from_env is not None:
        return from_env, f"{NPROCS_ENV}={from_env}"
    if opts.nprocs is not None:
        return None, ""  # the decorator's nprocs= is for self-spawned runs: ignored under a launcher, as ever
    count = default_nprocs(opts, env, visible_gpus)
    return count, (f"devices={list(opts.devices)}" if opts.devices is not None else f"{count} visible GPUs")


def plan(topo: Topology, opts: Options, env: Mapping[str, str],
         visible_gpus: Callable[[], int]) -> NodeLayout | None:
    """The per-node launch to make under ``topo``, or ``None`` to run in place as one rank per task.

    Pure apart from ``visible_gpus``, which is asked only when no count was requested. The rendezvous address may
    still be open (``topo.master_addr`` ``None``); the caller fills it in once agreed (`NodeLayout.at`).

    Raises:
        LauncherError: a per-node launch is asked for (``DISTFN_NPROCS``) but the launcher started a second
            task on a node, or the tasks are spread unevenly over the nodes.
    """
    if not opts.multi_rank or topo.launcher not in PER_NODE_LAUNCHERS:
        return None
    per_node, source = _wanted(opts, env, visible_gpus)
    if per_node is None or per_node <= 1:
        return None
    explicit = source.startswith(NPROCS_ENV)
    even = topo.world_size == topo.num_nodes * topo.local_world_size
    if topo.local_world_size == 1 and even:
        return NodeLayout(launcher=topo.launcher, node_rank=topo.rank, num_nodes=topo.num_nodes,
                          local_world_size=per_node, master_addr=topo.master_addr, master_port=topo.master_port,
                          reason=f"{topo.reason}; {source}", source=source)
    if not explicit or per_node == topo.world_size or (per_node == topo.local_world_size and even):
        return None  # the launcher already started the processes: one rank per task, as before
    fix = ("launch one task per node (`srun --ntasks-per-node=1`, `mpirun -npernode 1`, one pod per node) to let "
           f"distfn start {per_node} per node, or unset {NPROCS_ENV} to run one rank per task")
    if not even:
        raise LauncherError(
            f"{source} asks for {per_node} processes per node, but {topo.launcher} spread {topo.world_size} tasks "
            f"unevenly over {topo.num_nodes} nodes ({topo.local_world_size} on this node); {fix}")
    raise LauncherError(
        f"{source} asks distfn to start {per_node} processes per node, but {topo.launcher} started "
        f"{topo.local_world_size} tasks on this node (a second task on a node; {topo.reason}); {fix}")


def describe(layout: NodeLayout) -> str:
    """One line for the log: nodes, workers per node, the rank rule and the rendezvous."""
    return (f"one task per node ({layout.launcher}): {layout.local_world_size} workers on each of "
            f"{layout.num_nodes} nodes, world size {layout.world_size} (global rank = node_rank * "
            f"{layout.local_world_size} + local_rank), rendezvous {layout.master_addr}:{layout.master_port}")


def prepare(layout: NodeLayout, opts: Options) -> Options:
    """The options the node's workers run with: ``max_restarts`` is dropped, since one node restarting alone
    cannot rejoin the others (use the launcher's own requeue / restart, or ``requeue=True`` under Slurm; the call
    logs that it has no effect, `distfn.plan`)."""
    return attrs.evolve(opts, max_restarts=0) if opts.max_restarts else opts


def announce(layout: NodeLayout) -> None:
    """Log the layout once for the job (node 0's launching process only)."""
    if layout.node_rank == 0:
        logger.info("{} (pid {})", describe(layout), os.getpid())
