"""Pure unit tests of launcher detection (distfn.topology), from recorded launcher environments.

The ``*_RECORDED`` dicts below are real environments captured on the project's CI machine (Debian 12,
slurm-wlm 22.05 with two virtual nodes ``node1``/``node2`` from .ci/slurm-setup.sh, Open MPI 4.1.4,
torch 2.13), trimmed of variables no detector reads (socket paths, umask, ...). Every test here is a pure
function call: no process, no network (host resolution is injected), no os.environ.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Final

import attrs
import pytest

from distfn.errors import ConfigError, LauncherError
from distfn.options import Options
from distfn.topology import (
    LAUNCHERS,
    MPI_FALLBACK_PORT,
    PORT_BASE,
    PORT_SPAN,
    Topology,
    check_master,
    derive_port,
    describe,
    detect,
    expand_hostlist,
    expand_tasks_per_node,
    split_local_rank,
)
from distfn.topology import mpi as topo_mpi

# ---------------------------------------------------------------------------------------------------------
# Recorded environments
# ---------------------------------------------------------------------------------------------------------

# srun -N1 -n2, task 1
SRUN_N1_N2_TASK1_RECORDED: Final = {
    'SLURMD_NODENAME': 'node1', 'SLURM_CPUS_ON_NODE': '2', 'SLURM_GTIDS': '0,1', 'SLURM_JOBID': '2',
    'SLURM_JOB_CPUS_PER_NODE': '2', 'SLURM_JOB_ID': '2', 'SLURM_JOB_NAME': 'sh', 'SLURM_JOB_NODELIST': 'node1',
    'SLURM_JOB_NUM_NODES': '1', 'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1', 'SLURM_LOCALID': '1',
    'SLURM_NNODES': '1', 'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node1', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2',
    'SLURM_PROCID': '1', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0', 'SLURM_STEP_ID': '0',
    'SLURM_STEP_NODELIST': 'node1', 'SLURM_STEP_NUM_NODES': '1', 'SLURM_STEP_NUM_TASKS': '2',
    'SLURM_STEP_TASKS_PER_NODE': '2', 'SLURM_TASKS_PER_NODE': '2', 'SLURM_TOPOLOGY_ADDR': 'node1',
}

# srun -N2 --ntasks-per-node=2 (2 virtual nodes), task 3
SRUN_N2_X2_TASK3_RECORDED: Final = {
    'SLURMD_NODENAME': 'node2', 'SLURM_CPUS_ON_NODE': '1', 'SLURM_GTIDS': '2,3', 'SLURM_JOBID': '3',
    'SLURM_JOB_CPUS_PER_NODE': '1(x2)', 'SLURM_JOB_ID': '3', 'SLURM_JOB_NAME': 'sh',
    'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1',
    'SLURM_LOCALID': '1', 'SLURM_NNODES': '2', 'SLURM_NODEID': '1', 'SLURM_NODELIST': 'node[1-2]',
    'SLURM_NPROCS': '4', 'SLURM_NTASKS': '4', 'SLURM_NTASKS_PER_NODE': '2', 'SLURM_OVERCOMMIT': '1',
    'SLURM_PROCID': '3', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0', 'SLURM_STEP_ID': '0',
    'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_STEP_NUM_TASKS': '4',
    'SLURM_STEP_TASKS_PER_NODE': '2(x2)', 'SLURM_TASKS_PER_NODE': '2(x2)', 'SLURM_TOPOLOGY_ADDR': 'node2',
}

# srun -N2 --ntasks-per-node=2 (2 virtual nodes), task 0
SRUN_N2_X2_TASK0_RECORDED: Final = {
    'SLURMD_NODENAME': 'node1', 'SLURM_CPUS_ON_NODE': '1', 'SLURM_GTIDS': '0,1', 'SLURM_JOBID': '3',
    'SLURM_JOB_CPUS_PER_NODE': '1(x2)', 'SLURM_JOB_ID': '3', 'SLURM_JOB_NAME': 'sh',
    'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1',
    'SLURM_LOCALID': '0', 'SLURM_NNODES': '2', 'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node[1-2]',
    'SLURM_NPROCS': '4', 'SLURM_NTASKS': '4', 'SLURM_NTASKS_PER_NODE': '2', 'SLURM_OVERCOMMIT': '1',
    'SLURM_PROCID': '0', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0', 'SLURM_STEP_ID': '0',
    'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_STEP_NUM_TASKS': '4',
    'SLURM_STEP_TASKS_PER_NODE': '2(x2)', 'SLURM_TASKS_PER_NODE': '2(x2)', 'SLURM_TOPOLOGY_ADDR': 'node1',
}

# srun -n2 --mpi=pmi2, task 1
SRUN_PMI2_TASK1_RECORDED: Final = {
    'PMI_FD': '13', 'PMI_JOBID': '4.0', 'PMI_RANK': '1', 'PMI_SIZE': '2', 'SLURMD_NODENAME': 'node1',
    'SLURM_CPUS_ON_NODE': '2', 'SLURM_GTIDS': '0,1', 'SLURM_JOBID': '4', 'SLURM_JOB_CPUS_PER_NODE': '2',
    'SLURM_JOB_ID': '4', 'SLURM_JOB_NAME': 'sh', 'SLURM_JOB_NODELIST': 'node1', 'SLURM_JOB_NUM_NODES': '1',
    'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1', 'SLURM_LOCALID': '1', 'SLURM_MPI_TYPE': 'pmi2', 'SLURM_NNODES': '1',
    'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node1', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '1',
    'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0', 'SLURM_STEP_ID': '0',
    'SLURM_STEP_NODELIST': 'node1', 'SLURM_STEP_NUM_NODES': '1', 'SLURM_STEP_NUM_TASKS': '2',
    'SLURM_STEP_TASKS_PER_NODE': '2', 'SLURM_TASKS_PER_NODE': '2', 'SLURM_TOPOLOGY_ADDR': 'node1',
}

# the body of an sbatch -N1 --ntasks-per-node=2 script
SBATCH_BATCH_STEP_RECORDED: Final = {
    'SLURMD_NODENAME': 'node1', 'SLURM_CPUS_ON_NODE': '2', 'SLURM_GTIDS': '0', 'SLURM_JOBID': '5',
    'SLURM_JOB_CPUS_PER_NODE': '2', 'SLURM_JOB_ID': '5', 'SLURM_JOB_NAME': 'batch.sh',
    'SLURM_JOB_NODELIST': 'node1', 'SLURM_JOB_NUM_NODES': '1', 'SLURM_LOCALID': '0', 'SLURM_NNODES': '1',
    'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node1', 'SLURM_NODE_ALIASES': '(null)', 'SLURM_NPROCS': '2',
    'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '2', 'SLURM_PROCID': '0', 'SLURM_TASKS_PER_NODE': '2',
    'SLURM_TOPOLOGY_ADDR': 'node1',
}

# the shell of salloc -n2
SALLOC_SHELL_RECORDED: Final = {
    'SLURM_JOBID': '7', 'SLURM_JOB_CPUS_PER_NODE': '2', 'SLURM_JOB_ID': '7', 'SLURM_JOB_NAME': 'interactive',
    'SLURM_JOB_NODELIST': 'node1', 'SLURM_JOB_NUM_NODES': '1', 'SLURM_NNODES': '1', 'SLURM_NODELIST': 'node1',
    'SLURM_NODE_ALIASES': '(null)', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2', 'SLURM_TASKS_PER_NODE': '2',
}

# mpirun -np 3, rank 1
MPIRUN_NP3_RANK1_RECORDED: Final = {
    'OMPI_COMM_WORLD_LOCAL_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '3', 'OMPI_COMM_WORLD_NODE_RANK': '1',
    'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '3', 'OMPI_MCA_ess_base_jobid': '2135818241',
    'OMPI_MCA_orte_num_nodes': '1', 'PMIX_HOSTNAME': 'vm', 'PMIX_ID': '2135818241.1',
    'PMIX_NAMESPACE': '2135818241', 'PMIX_RANK': '1',
}

# mpirun -np 2 inside sbatch -N1 --ntasks-per-node=2, rank 1
MPIRUN_IN_SBATCH_1NODE_RANK1_RECORDED: Final = {
    'OMPI_COMM_WORLD_LOCAL_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '2', 'OMPI_COMM_WORLD_NODE_RANK': '1',
    'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_MCA_ess_base_jobid': '2145845249',
    'OMPI_MCA_orte_num_nodes': '1', 'PMIX_HOSTNAME': 'vm', 'PMIX_ID': '2145845249.1',
    'PMIX_NAMESPACE': '2145845249', 'PMIX_RANK': '1', 'SLURMD_NODENAME': 'node1', 'SLURM_CPUS_ON_NODE': '2',
    'SLURM_GTIDS': '0', 'SLURM_JOBID': '5', 'SLURM_JOB_CPUS_PER_NODE': '2', 'SLURM_JOB_ID': '5',
    'SLURM_JOB_NAME': 'batch.sh', 'SLURM_JOB_NODELIST': 'node1', 'SLURM_JOB_NUM_NODES': '1',
    'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1', 'SLURM_LOCALID': '0', 'SLURM_NNODES': '1', 'SLURM_NODEID': '0',
    'SLURM_NODELIST': 'node1', 'SLURM_NODE_ALIASES': '(null)', 'SLURM_NPROCS': '1', 'SLURM_NTASKS': '1',
    'SLURM_NTASKS_PER_NODE': '1', 'SLURM_PROCID': '0', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0',
    'SLURM_STEP_ID': '0', 'SLURM_STEP_NODELIST': 'node1', 'SLURM_STEP_NUM_NODES': '1',
    'SLURM_STEP_NUM_TASKS': '1', 'SLURM_STEP_TASKS_PER_NODE': '1', 'SLURM_TASKS_PER_NODE': '1',
    'SLURM_TOPOLOGY_ADDR': 'node1',
}

# mpirun -np 4 inside sbatch -N2 --ntasks-per-node=2, rank 3
MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED: Final = {
    'OMPI_COMM_WORLD_LOCAL_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '2', 'OMPI_COMM_WORLD_NODE_RANK': '1',
    'OMPI_COMM_WORLD_RANK': '3', 'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_MCA_ess_base_jobid': '2141585409',
    'OMPI_MCA_orte_num_nodes': '2', 'PMIX_HOSTNAME': 'vm', 'PMIX_ID': '2141585409.3',
    'PMIX_NAMESPACE': '2141585409', 'PMIX_RANK': '3', 'SLURMD_NODENAME': 'node2', 'SLURM_CPUS_ON_NODE': '2',
    'SLURM_GTIDS': '1', 'SLURM_JOBID': '6', 'SLURM_JOB_CPUS_PER_NODE': '2(x2)', 'SLURM_JOB_ID': '6',
    'SLURM_JOB_NAME': 'batch2.sh', 'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2',
    'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1', 'SLURM_LOCALID': '0', 'SLURM_NNODES': '2', 'SLURM_NODEID': '1',
    'SLURM_NODELIST': 'node[1-2]', 'SLURM_NODE_ALIASES': '(null)', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2',
    'SLURM_NTASKS_PER_NODE': '1', 'SLURM_PROCID': '1', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0',
    'SLURM_STEP_ID': '0', 'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_NODES': '2',
    'SLURM_STEP_NUM_TASKS': '2', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)', 'SLURM_TASKS_PER_NODE': '1(x2)',
    'SLURM_TOPOLOGY_ADDR': 'node2',
}

# srun -N2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=2, worker rank 3
TORCHRUN_IN_SRUN_RANK3_RECORDED: Final = {
    'GROUP_RANK': '1', 'GROUP_WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2',
    'MASTER_ADDR': 'node1', 'MASTER_PORT': '29555', 'RANK': '3', 'SLURMD_NODENAME': 'node2',
    'SLURM_CPUS_ON_NODE': '1', 'SLURM_GTIDS': '1', 'SLURM_JOBID': '8', 'SLURM_JOB_CPUS_PER_NODE': '1(x2)',
    'SLURM_JOB_ID': '8', 'SLURM_JOB_NAME': 'bash', 'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2',
    'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1', 'SLURM_LOCALID': '0', 'SLURM_NNODES': '2', 'SLURM_NODEID': '1',
    'SLURM_NODELIST': 'node[1-2]', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '1',
    'SLURM_OVERCOMMIT': '1', 'SLURM_PROCID': '1', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0',
    'SLURM_STEP_ID': '0', 'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_NODES': '2',
    'SLURM_STEP_NUM_TASKS': '2', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)', 'SLURM_TASKS_PER_NODE': '1(x2)',
    'SLURM_TOPOLOGY_ADDR': 'node2', 'TORCHELASTIC_RUN_ID': 'none', 'WORLD_SIZE': '4',
}

# python -m torch.distributed.launch --nproc_per_node=2 (torch 2.13), rank 1; argv ['dump2.py', '--local-rank=1']
LAUNCH_MODULE_RANK1_RECORDED: Final = {
    'GROUP_RANK': '0', 'GROUP_WORLD_SIZE': '1', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2',
    'MASTER_ADDR': 'localhost', 'MASTER_PORT': '35465', 'RANK': '1',
    'TORCHELASTIC_RUN_ID': 'e8f4b9ad-f4ae-4997-9898-9a513c2f2bd0', 'WORLD_SIZE': '2',
}

# srun -N1 -n2 -w node2 inside sbatch -N2 --ntasks-per-node=2, task 1: the step runs on the job's second node
# only; SLURM_NODELIST/SLURM_JOB_NODELIST are the job's, SLURM_STEP_NODELIST and SLURM_NNODES the step's.
SRUN_SUBSET_STEP_TASK1_RECORDED: Final = {
    'SLURMD_NODENAME': 'node2', 'SLURM_CPUS_ON_NODE': '1', 'SLURM_GTIDS': '0,1', 'SLURM_JOBID': '4',
    'SLURM_JOB_CPUS_PER_NODE': '1(x2)', 'SLURM_JOB_ID': '4', 'SLURM_JOB_NAME': 'wrap',
    'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1',
    'SLURM_LOCALID': '1', 'SLURM_NNODES': '1', 'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node[1-2]',
    'SLURM_NODE_ALIASES': '(null)', 'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '2',
    'SLURM_OVERCOMMIT': '1', 'SLURM_PROCID': '1', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0',
    'SLURM_STEP_ID': '0', 'SLURM_STEP_NODELIST': 'node2', 'SLURM_STEP_NUM_NODES': '1',
    'SLURM_STEP_NUM_TASKS': '2', 'SLURM_STEP_TASKS_PER_NODE': '2', 'SLURM_TASKS_PER_NODE': '2',
    'SLURM_TOPOLOGY_ADDR': 'node2',
}

LAUNCH_MODULE_ARGV: Final = ("train.py", "--local-rank=1")

# From the recipe notes (shared/recipes/slurm-mpi.md): when Open MPI does not start its daemons through srun,
# mpirun inside a 1-node sbatch job leaks the batch step's variables (no SLURM_STEP_ID) into every rank.
MPIRUN_IN_SBATCH_NO_STEP_RANK1: Final = {
    "SLURM_JOB_ID": "11", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_NODELIST": "vm",
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "2135818241", "OMPI_MCA_orte_num_nodes": "1",
}

# Old torch.distributed.launch (torch < 1.9): --local_rank in argv, RANK/WORLD_SIZE/MASTER_* in env, no
# LOCAL_RANK and no TORCHELASTIC_RUN_ID.
OLD_LAUNCH_RANK3: Final = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}

# Kubeflow Training Operator v1 PyTorchJob (1 Master + 1 Worker replica, port 23456), as its controller sets them
# (pkg/controller.v1/pytorch/envvar.go, master.go: MASTER_ADDR = <job>-master-0, RANK = index (+1 for workers),
# WORLD_SIZE = all replicas) plus what Kubernetes injects into every pod. No LOCAL_RANK, no TORCHELASTIC_RUN_ID.
PYTORCHJOB_MASTER_POD: Final = {
    "HOSTNAME": "mnist-master-0", "KUBERNETES_PORT": "tcp://10.96.0.1:443", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_SERVICE_PORT_HTTPS": "443", "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456", "PYTHONUNBUFFERED": "0", "RANK": "0", "WORLD_SIZE": "2",
}
PYTORCHJOB_WORKER_POD: Final = {**PYTORCHJOB_MASTER_POD, "HOSTNAME": "mnist-worker-0", "RANK": "1"}

RESOLVABLE: Final = {"node1", "node2", "vm", "localhost", "10.0.0.1", "127.0.0.1", "node01", "gpu-a01"}


def fake_resolver(host: str) -> None:
    """Resolves the hosts of the recorded cluster only (no network in unit tests)."""
    if host not in RESOLVABLE:
        raise OSError(f"[Errno -2] Name or service not known: {host!r}")


def env_of(base: Mapping[str, str], **changes: str | None) -> Mapping[str, str]:
    """A read-only copy of ``base`` with changes (None removes): detect() must never write to its input."""
    env = dict(base)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return types.MappingProxyType(env)


def run(env: Mapping[str, str], argv: tuple[str, ...] = (), launcher: str = "auto") -> Topology | None:
    return detect(types.MappingProxyType(dict(env)), argv, launcher, resolve_host=fake_resolver)


def fields(t: Topology | None) -> dict[str, Any]:
    assert t is not None
    d = attrs.asdict(t)
    d.pop("reason")
    return d


# ---------------------------------------------------------------------------------------------------------
# SLURM
# ---------------------------------------------------------------------------------------------------------


def test_srun_one_node_two_tasks() -> None:
    t = run(SRUN_N1_N2_TASK1_RECORDED)
    assert fields(t) | {"master_port": None} == dict(
        launcher="slurm", rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
        master_addr="node1", master_port=None)
    assert t is not None and PORT_BASE <= t.master_port < PORT_BASE + PORT_SPAN
    assert "SLURM_STEP_ID" in t.reason and "SLURM_PROCID" in t.reason


def test_srun_two_virtual_nodes_every_task_agrees_on_the_rendezvous() -> None:
    last = run(SRUN_N2_X2_TASK3_RECORDED)
    first = run(SRUN_N2_X2_TASK0_RECORDED)
    assert fields(last) == dict(
        launcher="slurm", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="node1", master_port=first.master_port if first else None)
    assert fields(first)["rank"] == 0 and fields(first)["node_rank"] == 0
    assert (first.master_addr, first.master_port) == (last.master_addr, last.master_port)  # type: ignore[union-attr]


def test_slurm_port_comes_from_master_port_when_set() -> None:
    t = run(env_of(SRUN_N1_N2_TASK1_RECORDED, MASTER_PORT="31337"))
    assert t is not None and t.master_port == 31337 and "MASTER_PORT" in t.reason


def test_slurm_master_addr_env_wins_over_the_nodelist() -> None:
    t = run(env_of(SRUN_N2_X2_TASK3_RECORDED, MASTER_ADDR="10.0.0.1"))
    assert t is not None and t.master_addr == "10.0.0.1"


def test_slurm_master_is_the_first_host_of_the_step_nodelist() -> None:
    # The step may run on fewer nodes than the job: the step's list wins over the job's.
    env = env_of(SRUN_N1_N2_TASK1_RECORDED, SLURM_STEP_NODELIST="node[02-03]", SLURM_JOB_NODELIST="node[01-04]")
    t = detect(env, resolve_host=None)
    assert t is not None and t.master_addr == "node02"
    # falls back to the job's list, then SLURM_NODELIST
    t = detect(env_of(env, SLURM_STEP_NODELIST=None), resolve_host=None)
    assert t is not None and t.master_addr == "node01"
    t = detect(env_of(env, SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NODELIST="gpu-a[01-02]"),
               resolve_host=None)
    assert t is not None and t.master_addr == "gpu-a01"


def test_step_on_a_subset_of_the_job_nodes_uses_the_step_values() -> None:
    # The job's nodelist starts with node1, where no task of this step runs: the master must be node2.
    t = run(SRUN_SUBSET_STEP_TASK1_RECORDED)
    assert fields(t) | {"master_port": 0} == dict(
        launcher="slurm", rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
        master_addr="node2", master_port=0)
    # without the STEP_ variables SLURM_NNODES (step-level inside srun) wins over SLURM_JOB_NUM_NODES
    t = run(env_of(SRUN_SUBSET_STEP_TASK1_RECORDED, SLURM_STEP_NUM_NODES=None))
    assert t is not None and t.num_nodes == 1


def test_slurm_derived_port_differs_between_jobs_and_steps() -> None:
    ports = {
        run(env_of(SRUN_N1_N2_TASK1_RECORDED, SLURM_JOB_ID=job, SLURM_STEP_ID=step)).master_port  # type: ignore[union-attr]
        for job in ("2", "3", "12345678") for step in ("0", "1")
    }
    assert len(ports) == 6
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_srun_with_heterogeneous_tasks_per_node() -> None:
    # srun -n7 over 4 nodes: 2,2,2,1 tasks; the last node's rank 6 is alone there.
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "3", "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NUM_NODES": "4",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NODELIST": "node[01-04]"}
    assert fields(run(env)) | {"master_port": 0} == dict(
        launcher="slurm", rank=6, local_rank=0, world_size=7, local_world_size=1, node_rank=3, num_nodes=4,
        master_addr="node01", master_port=0)


def test_srun_pmi2_is_slurm_not_mpi() -> None:
    # srun --mpi=pmi2 exports PMI_RANK/PMI_SIZE (MPICH's variables) but no local rank: srun is the launcher.
    t = run(SRUN_PMI2_TASK1_RECORDED)
    assert t is not None and (t.launcher, t.rank, t.local_rank, t.world_size) == ("slurm", 1, 1, 2)


def test_srun_mpi_pmix_is_slurm() -> None:
    # srun --mpi=pmix adds PMIX_RANK/PMIX_NAMESPACE only (no OMPI_*): still a plain SLURM step.
    t = run(env_of(SRUN_N1_N2_TASK1_RECORDED, PMIX_RANK="1", PMIX_NAMESPACE="slurm.pmix.2.0"))
    assert t is not None and (t.launcher, t.rank) == ("slurm", 1)


def test_sbatch_batch_step_self_spawns() -> None:
    # SLURM_PROCID=0 and SLURM_NTASKS=2, but it is one process: the batch script, no job step.
    assert run(SBATCH_BATCH_STEP_RECORDED) is None
    d = describe(SBATCH_BATCH_STEP_RECORDED)
    assert d["launcher"] == "spawn" and "batch script" in d["reason"] and d["error"] is None


def test_salloc_shell_self_spawns() -> None:
    assert run(SALLOC_SHELL_RECORDED) is None


@pytest.mark.parametrize("step", ["4294967291", "4294967292", "4294967290", "batch", "extern", "interactive"])
def test_special_slurm_steps_are_not_ranks(step: str) -> None:
    assert run(env_of(SRUN_N1_N2_TASK1_RECORDED, SLURM_STEP_ID=step, SLURM_STEPID=step)) is None


def test_single_task_step_self_spawns_unless_forced() -> None:
    env = env_of(SRUN_N1_N2_TASK1_RECORDED, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1",
                 SLURM_NPROCS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_TASKS_PER_NODE="1")
    assert run(env) is None
    assert "single task" in describe(env)["reason"]
    forced = run(env, launcher="slurm")
    assert forced is not None and (forced.rank, forced.world_size) == (0, 1)


def test_slurm_step_id_alias_stepid_is_enough() -> None:
    t = run(env_of(SRUN_N1_N2_TASK1_RECORDED, SLURM_STEP_ID=None))
    assert t is not None and t.launcher == "slurm"


# ---------------------------------------------------------------------------------------------------------
# MPI
# ---------------------------------------------------------------------------------------------------------


def test_mpirun_single_node_uses_loopback_and_a_port_from_the_job_id() -> None:
    t = run(MPIRUN_NP3_RANK1_RECORDED)
    assert fields(t) == dict(
        launcher="mpi", rank=1, local_rank=1, world_size=3, local_world_size=3, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=derive_port("2135818241"))
    assert "Open MPI" in t.reason  # type: ignore[union-attr]


def test_mpirun_ranks_of_one_job_share_the_port() -> None:
    ports = {run(env_of(MPIRUN_NP3_RANK1_RECORDED, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_LOCAL_RANK=str(r)))
             .master_port for r in range(3)}  # type: ignore[union-attr]
    assert len(ports) == 1


def test_mpirun_single_node_master_port_wins_and_fallback_port() -> None:
    t = run(env_of(MPIRUN_NP3_RANK1_RECORDED, MASTER_PORT="25000"))
    assert t is not None and t.master_port == 25000
    t = run(env_of(MPIRUN_NP3_RANK1_RECORDED, OMPI_MCA_ess_base_jobid=None))
    assert t is not None and t.master_port == MPI_FALLBACK_PORT and str(MPI_FALLBACK_PORT) in t.reason


@pytest.mark.parametrize("env", [MPIRUN_IN_SBATCH_1NODE_RANK1_RECORDED, MPIRUN_IN_SBATCH_NO_STEP_RANK1],
                         ids=["recorded-with-srun-step", "recipe-batch-step-leak"])
def test_mpirun_inside_one_node_sbatch_is_mpi(env: Mapping[str, str]) -> None:
    # The SLURM variables say "rank 0 of 1 (or 2)" on every rank; Open MPI's are the truth.
    t = run(env)
    assert t is not None and (t.launcher, t.rank, t.world_size, t.master_addr) == ("mpi", 1, 2, "127.0.0.1")


def test_mpirun_inside_two_node_sbatch_needs_a_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks see SLURM_STEP_ID=0 and SLURM_PROCID=<node index> of Open MPI's daemon step: MPI must win.
    monkeypatch.setattr(topo_mpi, "mpi4py_available", lambda: False)
    with pytest.raises(LauncherError) as err:
        run(MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED)
    msg = str(err.value)
    assert "MASTER_ADDR" in msg and "mpirun -x MASTER_ADDR" in msg and "mpi4py" in msg
    assert "OMPI_COMM_WORLD_LOCAL_SIZE='2'" in msg and "OMPI_COMM_WORLD_SIZE='4'" in msg


def test_mpirun_two_nodes_with_master_addr_exported() -> None:
    t = run(env_of(MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED, MASTER_ADDR="node1", MASTER_PORT="29400"))
    assert fields(t) == dict(
        launcher="mpi", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="node1", master_port=29400)
    # MASTER_ADDR without MASTER_PORT: the port comes from the job id, the same on all ranks
    t = run(env_of(MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED, MASTER_ADDR="node1"))
    assert t is not None and t.master_port == derive_port("2141585409")


def test_mpirun_two_nodes_with_mpi4py_defers_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topo_mpi, "mpi4py_available", lambda: True)
    t = run(MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED)
    assert t is not None and (t.master_addr, t.master_port) == (None, None) and "mpi4py" in t.reason


def test_mpi_round_robin_mapping_gives_the_right_node() -> None:
    # mpirun --map-by node -np 4 on 2 nodes: ranks 0,2 on node 0 and 1,3 on node 1.
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "2", "MASTER_ADDR": "node1"}
    t = run(env)
    assert t is not None and (t.node_rank, t.num_nodes, t.local_rank) == (1, 2, 0)


def test_mpich_hydra_and_intel_mpi() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "PMI_JOBID": "x7",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    assert fields(run(env)) == dict(
        launcher="mpi", rank=2, local_rank=0, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="node1", master_port=29500)
    single = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2", "PMI_JOBID": "x7"}
    t = run(single)
    assert t is not None and (t.master_addr, t.master_port, t.local_rank) == ("127.0.0.1", derive_port("x7"), 1)
    assert "MPICH" in t.reason


def test_mpich_without_local_rank_is_an_error() -> None:
    with pytest.raises(LauncherError, match="MPI_LOCALRANKID"):
        run({"PMI_RANK": "1", "PMI_SIZE": "2"})


def test_mvapich() -> None:
    env = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MPIRUN_ID": "4242"}
    t = run(env)
    assert t is not None and (t.launcher, t.rank, t.master_addr, t.master_port) == (
        "mpi", 1, "127.0.0.1", derive_port("4242"))
    assert "MVAPICH" in t.reason


# ---------------------------------------------------------------------------------------------------------
# torchrun and torch.distributed.launch
# ---------------------------------------------------------------------------------------------------------


def test_torchrun_inside_srun_is_torchrun() -> None:
    # SLURM_PROCID=1/SLURM_NTASKS=2 describe the agent of node 2; RANK=3/WORLD_SIZE=4 the worker.
    t = run(TORCHRUN_IN_SRUN_RANK3_RECORDED)
    assert fields(t) == dict(
        launcher="torchrun", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="node1", master_port=29555)
    # torchrun's default run id is the string "none": the reason must not read as if the variable were unset
    assert t.reason == ("TORCHELASTIC_RUN_ID is set, to torchrun's default 'none' (no --rdzv-id given); "  # type: ignore[union-attr]
                        "torchrun agent 1 of 2")
    standalone = run(LAUNCH_MODULE_RANK1_RECORDED)
    assert standalone is not None
    assert standalone.reason == "TORCHELASTIC_RUN_ID=e8f4b9ad-f4ae-4997-9898-9a513c2f2bd0 is set"


def test_torch_distributed_launch_module() -> None:
    t = run(LAUNCH_MODULE_RANK1_RECORDED, LAUNCH_MODULE_ARGV)
    assert fields(t) == dict(
        launcher="torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
        master_addr="localhost", master_port=35465)


@pytest.mark.parametrize("argv", [("t.py", "--local_rank=1"), ("t.py", "--local-rank=1"),
                                  ("t.py", "--local_rank", "1"), ("t.py", "--lr", "0.1", "--local-rank", "1")])
def test_legacy_launch_local_rank_from_argv(argv: tuple[str, ...]) -> None:
    t = run(OLD_LAUNCH_RANK3, argv)
    assert t is not None and t.launcher == "torchrun" and t.local_rank == 1 and t.rank == 3
    assert "argv" in t.reason and "torch.distributed.launch" in t.reason
    # no LOCAL_WORLD_SIZE / GROUP_WORLD_SIZE: one node holding every rank is the only safe reading
    assert (t.local_world_size, t.num_nodes, t.node_rank) == (4, 1, 0)


@pytest.mark.parametrize("argv", [
    ("t.py", "--lr", "0.1", "--local-rank=1"),  # torch >= 2.0
    ("t.py", "--local_rank=1", "--lr", "0.1"),  # older torch
    ("t.py", "--local-rank", "1", "--lr", "0.1"),
    ("t.py", "--lr", "0.1", "--local_rank", "1"),
])
def test_split_local_rank_takes_every_spelling_out_of_argv(argv: tuple[str, ...]) -> None:
    assert split_local_rank(argv) == (["t.py", "--lr", "0.1"], 1)


def test_split_local_rank_without_the_flag_and_malformed() -> None:
    assert split_local_rank(("t.py", "--lr", "0.1", "--local-ranks=3")) is None  # another option, not the flag
    with pytest.raises(LauncherError, match="has no value"):
        split_local_rank(("t.py", "--local-rank"))
    with pytest.raises(LauncherError, match="'x' is not an integer"):
        split_local_rank(("t.py", "--local-rank=x"))


def test_legacy_launch_errors() -> None:
    with pytest.raises(LauncherError, match="has no value"):
        run(OLD_LAUNCH_RANK3, ("t.py", "--local_rank"))
    with pytest.raises(LauncherError, match="'x' is not an integer"):
        run(OLD_LAUNCH_RANK3, ("t.py", "--local_rank=x"))
    with pytest.raises(LauncherError, match="RANK, WORLD_SIZE"):
        run({}, ("t.py", "--local_rank=0"))
    with pytest.raises(LauncherError, match="disagrees"):
        run(env_of(OLD_LAUNCH_RANK3, LOCAL_RANK="0"), ("t.py", "--local_rank=1"))


def test_env_style_full_set_without_torchelastic() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}
    t = run(env)
    assert t is not None and t.launcher == "env" and "RANK, WORLD_SIZE and MASTER_ADDR" in t.reason
    # LOCAL_RANK without LOCAL_WORLD_SIZE (old launchers): one node holding every rank, as before
    assert (t.local_rank, t.local_world_size, t.num_nodes) == (1, 2, 1)


@pytest.mark.parametrize(("env", "rank"), [(PYTORCHJOB_MASTER_POD, 0), (PYTORCHJOB_WORKER_POD, 1)],
                         ids=["master-pod", "worker-pod"])
def test_pytorchjob_pods_run_in_place_one_rank_each(env: Mapping[str, str], rank: int) -> None:
    t = detect(env, ("train.py",), resolve_host=None)
    assert fields(t) == dict(
        launcher="kubernetes", rank=rank, local_rank=0, world_size=2, local_world_size=1, node_rank=rank,
        num_nodes=2, master_addr="mnist-master-0", master_port=23456)
    assert t is not None and "Kubernetes" in t.reason and "env://" in t.reason
    d = describe(env)
    assert d["launcher"] == "kubernetes" and list(d["candidates"]) == ["kubernetes"]
    assert d["variables"]["KUBERNETES_SERVICE_HOST"] == "10.96.0.1"


def test_plain_env_launcher_outside_kubernetes_and_with_local_variables() -> None:
    plain = env_of(PYTORCHJOB_WORKER_POD, KUBERNETES_SERVICE_HOST=None)
    t = detect(plain, resolve_host=None)
    assert t is not None and (t.launcher, t.rank, t.local_rank, t.local_world_size) == ("env", 1, 0, 1)
    # two processes per pod, said by the launcher
    t = detect(env_of(PYTORCHJOB_WORKER_POD, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"),
               resolve_host=None)
    assert fields(t) == dict(
        launcher="kubernetes", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="mnist-master-0", master_port=23456)


def test_torchrun_in_a_pod_stays_torchrun() -> None:
    """Training Operator v2 / PET_* variables: torchrun runs in the pod and sets its own variables."""
    env = env_of(PYTORCHJOB_MASTER_POD, TORCHELASTIC_RUN_ID="mnist", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                 GROUP_RANK="0", GROUP_WORLD_SIZE="2", WORLD_SIZE="4", PET_NPROC_PER_NODE="2", PET_NNODES="2")
    t = detect(env, resolve_host=None)
    assert t is not None and t.launcher == "torchrun" and (t.world_size, t.local_world_size) == (4, 2)


def test_plain_env_launcher_partial_sets_name_what_is_missing() -> None:
    with pytest.raises(LauncherError, match=r"missing environment variable\(s\) MASTER_PORT"):
        detect(env_of(PYTORCHJOB_MASTER_POD, MASTER_PORT=None), resolve_host=None)
    with pytest.raises(LauncherError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"):
        detect({"RANK": "0", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}, resolve_host=None)


@pytest.mark.parametrize("present", [{"RANK": "0"}, {"WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
def test_partial_rank_set_is_an_error_naming_the_variables(present: dict[str, str]) -> None:
    with pytest.raises(LauncherError) as err:
        run(present)
    msg = str(err.value)
    assert all(f"{k}={v!r}" in msg for k, v in present.items())
    assert "MASTER_ADDR" in msg and "torchrun" in msg


def test_master_addr_alone_is_not_torchrun() -> None:
    # `mpirun -x MASTER_ADDR` or an exported MASTER_ADDR in an sbatch script must not look like torchrun
    assert run({"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}) is None
    t = run(env_of(SRUN_N1_N2_TASK1_RECORDED, MASTER_ADDR="node1"))
    assert t is not None and t.launcher == "slurm"


def test_torchrun_inconsistent_values() -> None:
    base = dict(LAUNCH_MODULE_RANK1_RECORDED)
    with pytest.raises(LauncherError, match=r"RANK='2' is not in \[0, WORLD_SIZE='2'\)"):
        run(env_of(base, RANK="2"))
    with pytest.raises(LauncherError, match="LOCAL_WORLD_SIZE"):
        run(env_of(base, LOCAL_RANK="2"))
    with pytest.raises(LauncherError, match="GROUP_RANK"):
        run(env_of(base, GROUP_RANK="1"))
    with pytest.raises(LauncherError, match="WORLD_SIZE='two' is not an integer"):
        run(env_of(base, WORLD_SIZE="two"))


# ---------------------------------------------------------------------------------------------------------
# Forced launchers
# ---------------------------------------------------------------------------------------------------------


def test_launchers_tuple() -> None:
    assert LAUNCHERS == ("auto", "spawn", "torchrun", "slurm", "mpi", "ray")


def test_unknown_launcher() -> None:
    # launcher names are checked once, by the options (detection takes only the checked names)
    with pytest.raises(ConfigError, match="'pbs' is not valid; use one of 'auto', 'spawn'"):
        Options(launcher="pbs")


@pytest.mark.parametrize("env", [SRUN_N1_N2_TASK1_RECORDED, TORCHRUN_IN_SRUN_RANK3_RECORDED, {}])
def test_forced_spawn_is_always_none(env: Mapping[str, str]) -> None:
    assert run(env, launcher="spawn") is None


def test_forced_torchrun_names_missing_variables() -> None:
    with pytest.raises(LauncherError) as err:
        run(SRUN_N1_N2_TASK1_RECORDED, launcher="torchrun")
    assert "missing environment variable(s) RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in str(err.value)
    with pytest.raises(LauncherError, match=r"MASTER_PORT \(set: RANK='0', WORLD_SIZE='1', LOCAL_RANK='0'"):
        run({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "x"}, launcher="torchrun")


def test_forced_slurm_in_batch_step_and_outside_slurm() -> None:
    with pytest.raises(LauncherError, match=r"batch script or an salloc shell.*srun python script.py"):
        run(SBATCH_BATCH_STEP_RECORDED, launcher="slurm")
    with pytest.raises(LauncherError, match="SLURM_JOB_ID, SLURM_STEP_ID and SLURM_PROCID are not set"):
        run({}, launcher="slurm")


def test_forced_slurm_under_torchrun_in_srun_reads_the_agent_step() -> None:
    t = run(TORCHRUN_IN_SRUN_RANK3_RECORDED, launcher="slurm")
    assert t is not None and (t.launcher, t.rank, t.world_size, t.num_nodes) == ("slurm", 1, 2, 2)


def test_forced_mpi() -> None:
    with pytest.raises(LauncherError) as err:
        run(SBATCH_BATCH_STEP_RECORDED, launcher="mpi")
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "mpirun -np"):
        assert var in str(err.value)
    with pytest.raises(LauncherError, match=r"srun --mpi=pmi2.*launcher='slurm'"):
        run(SRUN_PMI2_TASK1_RECORDED, launcher="mpi")
    t = run(MPIRUN_IN_SBATCH_1NODE_RANK1_RECORDED, launcher="mpi")
    assert t is not None and t.launcher == "mpi"


def test_forced_slurm_missing_layout_variables() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    with pytest.raises(LauncherError) as err:
        run(env, launcher="slurm")
    msg = str(err.value)
    assert "SLURM_LOCALID" in msg and "SLURM_NODEID" in msg and "SLURM_STEP_TASKS_PER_NODE" in msg


# ---------------------------------------------------------------------------------------------------------
# Inconsistent variables
# ---------------------------------------------------------------------------------------------------------


def test_slurm_ntasks_not_equal_to_tasks_per_node_times_nodes() -> None:
    with pytest.raises(LauncherError) as err:
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_STEP_NUM_TASKS="5"))
    msg = str(err.value)
    assert "SLURM_STEP_TASKS_PER_NODE='2(x2)'" in msg and "SLURM_STEP_NUM_TASKS='5'" in msg
    assert "--ntasks-per-node" in msg
    with pytest.raises(LauncherError, match="SLURM_STEP_NUM_NODES='3'"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_STEP_NUM_NODES="3"))


def test_slurm_rank_out_of_range() -> None:
    with pytest.raises(LauncherError, match="SLURM_PROCID='4' is not below SLURM_STEP_NUM_TASKS='4'"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_PROCID="4"))
    with pytest.raises(LauncherError, match="SLURM_LOCALID='2'"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_LOCALID="2"))
    with pytest.raises(LauncherError, match="SLURM_NODEID='2'"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_NODEID="2"))
    with pytest.raises(LauncherError, match="SLURM_PROCID='-1' must be >= 0"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_PROCID="-1"))


@pytest.mark.parametrize("port", ["0", "70000", "-5", "http", "29500.5"])
def test_port_out_of_range(port: str) -> None:
    for env in (SRUN_N1_N2_TASK1_RECORDED, MPIRUN_NP3_RANK1_RECORDED, LAUNCH_MODULE_RANK1_RECORDED):
        with pytest.raises(LauncherError, match=rf"MASTER_PORT='{port}' is not a TCP port \(an integer in 1-65535\)"):
            run(env_of(env, MASTER_PORT=port))


def test_unresolvable_master_host() -> None:
    env = env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_STEP_NODELIST="ghost[1-2]")
    with pytest.raises(LauncherError) as err:
        run(env)
    msg = str(err.value)
    assert "'ghost1'" in msg and "does not resolve" in msg and "MASTER_ADDR" in msg and "/etc/hosts" in msg
    assert detect(env, resolve_host=None) is not None  # the check can be skipped


def test_default_resolver_accepts_loopback_and_ip_literals() -> None:
    for addr in ("127.0.0.1", "localhost", "::1"):
        t = detect(env_of(LAUNCH_MODULE_RANK1_RECORDED, MASTER_ADDR=addr), LAUNCH_MODULE_ARGV)
        assert t is not None and check_master(t).master_addr == addr


def test_garbled_nodelist_names_the_variable() -> None:
    with pytest.raises(LauncherError, match=r"SLURM_STEP_NODELIST='node\[1-2'.*MASTER_ADDR"):
        run(env_of(SRUN_N2_X2_TASK3_RECORDED, SLURM_STEP_NODELIST="node[1-2"))


def test_mpi_inconsistent_values() -> None:
    with pytest.raises(LauncherError, match="OMPI_COMM_WORLD_RANK='3' is not below OMPI_COMM_WORLD_SIZE='3'"):
        run(env_of(MPIRUN_NP3_RANK1_RECORDED, OMPI_COMM_WORLD_RANK="3"))
    with pytest.raises(LauncherError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE='5'.*inconsistent"):
        run(env_of(MPIRUN_NP3_RANK1_RECORDED, OMPI_COMM_WORLD_LOCAL_SIZE="5"))


def test_topology_refuses_impossible_values() -> None:
    good = dict(launcher="slurm", rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0,
                num_nodes=1, master_addr="h", master_port=1234, reason="test")
    Topology(**good)  # type: ignore[arg-type]
    for bad in (dict(rank=2), dict(local_rank=2), dict(node_rank=1), dict(world_size=0), dict(master_port=0),
                dict(local_world_size=3), dict(num_nodes=3)):
        with pytest.raises(LauncherError):
            Topology(**(good | bad))  # type: ignore[arg-type]
    t = Topology(**good)  # type: ignore[arg-type]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        t.rank = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------
# Purity
# ---------------------------------------------------------------------------------------------------------


def test_detect_ignores_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SRUN_N1_N2_TASK1_RECORDED.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "0")
    assert detect({}, (), resolve_host=None) is None


def test_detect_does_not_mutate_its_input() -> None:
    env = dict(TORCHRUN_IN_SRUN_RANK3_RECORDED)
    before = dict(env)
    detect(env, ["x.py"], resolve_host=None)
    assert env == before


# ---------------------------------------------------------------------------------------------------------
# Hostlists and tasks per node
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "hosts"), [
    ("vm", ["vm"]),
    ("node[1-2]", ["node1", "node2"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu-a[01-02],gpu-b[7],cpu1", ["gpu-a01", "gpu-a02", "gpu-b7", "cpu1"]),
    ("x[3,1]", ["x3", "x1"]),
    (" node[1-2] ", ["node1", "node2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty"), ("node[1-2", "'\\[' without '\\]'"), ("node]1", "'\\]' without '\\['"),
    ("node[]", "empty brackets"), ("n[3-1]", "backwards"), ("n[a-b]", "not a number"), ("a,,b", "empty entry"),
    ("n[[1]]", "nested"),
])
def test_expand_hostlist_errors(text: str, match: str) -> None:
    with pytest.raises(LauncherError, match=match):
        expand_hostlist(text)


@pytest.mark.parametrize(("text", "counts"), [
    ("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]), ("4,2(x2)", [4, 2, 2]), (" 3 ", [3]),
])
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x", "0", "2(x0)", "2(3)", "-1"])
def test_expand_tasks_per_node_errors(text: str) -> None:
    with pytest.raises(LauncherError):
        expand_tasks_per_node(text)


def test_derive_port() -> None:
    assert derive_port("1") == PORT_BASE + 1
    assert derive_port(str(PORT_SPAN + 1)) == PORT_BASE + 1
    assert derive_port("abc") == derive_port("abc")  # stable, not hash()-randomised
    assert PORT_BASE <= derive_port("4.0") < PORT_BASE + PORT_SPAN


# ---------------------------------------------------------------------------------------------------------
# describe(), rendezvous resolution, devices
# ---------------------------------------------------------------------------------------------------------


def test_describe_reports_candidates_variables_and_the_winner() -> None:
    d = describe(MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED | {"MASTER_ADDR": "node1"})
    assert d["launcher"] == "mpi" and d["error"] is None
    assert set(d["candidates"]) == {"mpi", "slurm"}
    assert d["variables"]["OMPI_COMM_WORLD_RANK"] == "3" and d["variables"]["SLURM_PROCID"] == "1"
    assert d["topology"]["rank"] == 3 and d["topology"]["node_rank"] == 1
    assert "SLURMD_NODENAME" in d["variables"] and "PMIX_RANK" not in d["variables"]


def test_describe_never_raises_for_launcher_errors() -> None:
    d = describe({"RANK": "1"})
    assert d["launcher"] is None and "partial" in d["error"] and d["topology"] is None
    assert "partial" in d["candidates"]["torchrun"]
    d = describe({})
    assert d["launcher"] == "spawn" and d["candidates"] == {} and d["variables"] == {}


def test_constructors_for_the_undetected_cases() -> None:
    assert fields(Topology.local()) == dict(
        launcher="local", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=None, master_port=None)
    t = Topology.self_spawned(1, 2, 29400)
    assert fields(t) == dict(
        launcher="spawn", rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
        master_addr="127.0.0.1", master_port=29400)
    assert t.reason == "2 workers started by the calling process"
    with pytest.raises(LauncherError, match="rank=2 not in"):
        Topology.self_spawned(2, 2, 29400)
