"""The per-node launch rule (distfn.launch.pernode): when one task per node becomes L local workers with global ranks.

Pure tests: recorded launcher environments through `distfn.topology.detect`, then `distfn.launch.pernode.plan`; the GPU
count is injected. The real run (srun -N2 --ntasks-per-node=1 with DISTFN_NPROCS=2 -> 4 ranks) is
tests/cluster/test_cluster_pernode.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import pytest

from distfn.errors import LauncherError
from distfn.launch.pernode import NodeLayout, describe, plan, prepare
from distfn.options import Options
from distfn.topology import Topology, detect

from conftest import clean_env, free_port

# srun -N2 --ntasks-per-node=1 (two virtual nodes of the CI Slurm), task 0 and task 1, recorded
SRUN_N2_PERNODE1_TASK0_RECORDED: Final = {
    'SLURMD_NODENAME': 'node1', 'SLURM_CPUS_ON_NODE': '1', 'SLURM_GTIDS': '0', 'SLURM_JOBID': '42',
    'SLURM_JOB_CPUS_PER_NODE': '1(x2)', 'SLURM_JOB_ID': '42', 'SLURM_JOB_NAME': 'bash',
    'SLURM_JOB_NODELIST': 'node[1-2]', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_LAUNCH_NODE_IPADDR': '127.0.0.1',
    'SLURM_LOCALID': '0', 'SLURM_NNODES': '2', 'SLURM_NODEID': '0', 'SLURM_NODELIST': 'node[1-2]',
    'SLURM_NPROCS': '2', 'SLURM_NTASKS': '2', 'SLURM_NTASKS_PER_NODE': '1', 'SLURM_OVERCOMMIT': '1',
    'SLURM_PROCID': '0', 'SLURM_SRUN_COMM_HOST': '127.0.0.1', 'SLURM_STEPID': '0', 'SLURM_STEP_ID': '0',
    'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_STEP_NUM_TASKS': '2',
    'SLURM_STEP_TASKS_PER_NODE': '1(x2)', 'SLURM_TASKS_PER_NODE': '1(x2)', 'SLURM_TOPOLOGY_ADDR': 'node1',
}
SRUN_N2_PERNODE1_TASK1_RECORDED: Final = {
    **SRUN_N2_PERNODE1_TASK0_RECORDED, 'SLURMD_NODENAME': 'node2', 'SLURM_GTIDS': '1', 'SLURM_NODEID': '1',
    'SLURM_PROCID': '1', 'SLURM_TOPOLOGY_ADDR': 'node2',
}
# srun -N2 --ntasks-per-node=2, task 3 (recorded)
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
# srun -n3 over 2 nodes: 2 tasks on node1, 1 on node2 (uneven)
SRUN_UNEVEN_BASE: Final = {
    'SLURM_JOB_ID': '77', 'SLURM_STEP_ID': '0', 'SLURM_NTASKS': '3', 'SLURM_STEP_NUM_TASKS': '3',
    'SLURM_STEP_NUM_NODES': '2', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_STEP_TASKS_PER_NODE': '2,1',
    'SLURM_STEP_NODELIST': 'node[1-2]',
}
SRUN_UNEVEN_ALONE: Final = {**SRUN_UNEVEN_BASE, 'SLURM_PROCID': '2', 'SLURM_LOCALID': '0', 'SLURM_NODEID': '1'}
SRUN_UNEVEN_PAIRED: Final = {**SRUN_UNEVEN_BASE, 'SLURM_PROCID': '1', 'SLURM_LOCALID': '1', 'SLURM_NODEID': '0'}
# mpirun -npernode 1 on two hosts with MASTER_ADDR exported (Open MPI 4.1 variables), rank 1
MPIRUN_NPERNODE1_RANK1: Final = {
    'OMPI_COMM_WORLD_LOCAL_RANK': '0', 'OMPI_COMM_WORLD_LOCAL_SIZE': '1', 'OMPI_COMM_WORLD_NODE_RANK': '0',
    'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_MCA_ess_base_jobid': '2141585409',
    'OMPI_MCA_orte_num_nodes': '2', 'PMIX_RANK': '1', 'MASTER_ADDR': 'node1', 'MASTER_PORT': '29500',
}
# one PyTorchJob pod per node (plain env://), worker pod
PYTORCHJOB_WORKER_POD: Final = {
    "HOSTNAME": "mnist-worker-0", "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
    "MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "2",
}
TORCHRUN_ONE_PER_NODE: Final = {
    'TORCHELASTIC_RUN_ID': 'x', 'RANK': '1', 'LOCAL_RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '1',
    'GROUP_RANK': '1', 'GROUP_WORLD_SIZE': '2', 'MASTER_ADDR': 'node1', 'MASTER_PORT': '29500',
}

REPO: Final = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT: Final = REPO / "tests" / "cluster" / "script.py"

RESOLVABLE: Final = {"node1", "node2", "mnist-master-0"}


def _resolve(host: str) -> None:
    if host not in RESOLVABLE:
        raise OSError(f"unknown host {host!r}")


def topo_of(env: Mapping[str, str]) -> Topology:
    found = detect(types.MappingProxyType(dict(env)), (), "auto", resolve_host=_resolve)
    assert found is not None
    return found


def no_gpus() -> int:
    return 0


def gpus(n: int) -> Callable[[], int]:
    def count() -> int:
        return n
    return count


def refuse_gpus() -> int:
    raise AssertionError("the GPU count must not be asked when DISTFN_NPROCS says how many")


DDP = Options(mode="ddp")


def plan_for(env: Mapping[str, str], opts: Options = DDP, extra: Mapping[str, str] | None = None,
             visible: Callable[[], int] = refuse_gpus) -> NodeLayout | None:
    return plan(topo_of(env), opts, {**env, **(extra or {})}, visible)


# -- one task per node: the layout rule ------------------------------------------------------------------------

def test_srun_one_task_per_node_with_distfn_nprocs_gives_global_ranks_node_by_node() -> None:
    layouts = [plan_for(env, extra={"DISTFN_NPROCS": "2"})
               for env in (SRUN_N2_PERNODE1_TASK0_RECORDED, SRUN_N2_PERNODE1_TASK1_RECORDED)]
    assert all(layout is not None for layout in layouts)
    ranks = [(t.rank, t.node_rank, t.local_rank, t.world_size, t.local_world_size, t.num_nodes)
             for layout in layouts if layout is not None for t in map(layout.topology, range(2))]
    # global rank = node_rank * local_world_size + local_rank; world = nodes * local_world_size
    assert ranks == [(0, 0, 0, 4, 2, 2), (1, 0, 1, 4, 2, 2), (2, 1, 0, 4, 2, 2), (3, 1, 1, 4, 2, 2)]
    # every node meets on the same rendezvous: the first host of the step's nodelist, the job's derived port
    assert {(layout.master_addr, layout.master_port) for layout in layouts if layout} == {
        (layouts[0].master_addr, layouts[0].master_port)}  # type: ignore[union-attr]
    assert layouts[0].master_addr == "node1"  # type: ignore[union-attr]
    assert {t.launcher for layout in layouts if layout for t in map(layout.topology, range(2))} == {"slurm"}


def test_more_than_one_visible_gpu_spawns_one_worker_per_gpu_per_node() -> None:
    layout = plan_for(SRUN_N2_PERNODE1_TASK1_RECORDED, visible=gpus(4))
    assert layout is not None and (layout.node_rank, layout.local_world_size, layout.world_size) == (1, 4, 8)
    assert layout.topology(3).rank == 7
    with_devices = plan_for(SRUN_N2_PERNODE1_TASK1_RECORDED, Options(mode="fsdp", devices="0,1"), visible=gpus(4))
    assert with_devices is not None and with_devices.local_world_size == 2


def test_nothing_to_spawn_keeps_one_rank_per_task() -> None:
    # CPU only, one GPU, DISTFN_NPROCS=1: the task itself is the node's one rank, as before
    assert plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, visible=no_gpus) is None
    assert plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, visible=gpus(1)) is None
    assert plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, extra={"DISTFN_NPROCS": "1"}) is None


def test_the_decorators_nprocs_keeps_its_meaning_under_a_launcher() -> None:
    # nprocs=2 is written for `python train.py`; under `srun -N2 -n2` it stays ignored (two ranks, as ever),
    # and it does not fall back to the GPU count either. DISTFN_NPROCS, set at launch time, is what asks.
    assert plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, Options(mode="ddp", nprocs=2), visible=gpus(8)) is None
    layout = plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, Options(mode="ddp", nprocs=2), {"DISTFN_NPROCS": "3"})
    assert layout is not None and layout.local_world_size == 3


@pytest.mark.parametrize("mode", ["single", "dp"])
def test_one_process_modes_never_spawn_per_node(mode: str) -> None:
    assert plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, Options(mode=mode), visible=gpus(8)) is None


def test_torchrun_starts_its_own_local_workers() -> None:
    assert plan_for(TORCHRUN_ONE_PER_NODE, extra={"DISTFN_NPROCS": "2"}) is None


def test_mpirun_npernode_1_on_two_hosts() -> None:
    layout = plan_for(MPIRUN_NPERNODE1_RANK1, extra={"DISTFN_NPROCS": "2"})
    assert layout is not None
    assert (layout.launcher, layout.node_rank, layout.num_nodes, layout.master_addr, layout.master_port) == (
        "mpi", 1, 2, "node1", 29500)
    assert [layout.topology(i).rank for i in range(2)] == [2, 3]


def test_one_pod_per_node_with_env_rendezvous() -> None:
    layout = plan_for(PYTORCHJOB_WORKER_POD, extra={"DISTFN_NPROCS": "4"})
    assert layout is not None
    t = layout.topology(1)
    assert (t.launcher, t.rank, t.world_size, t.node_rank, t.master_addr, t.master_port) == (
        "kubernetes", 5, 8, 1, "mnist-master-0", 23456)


# -- several tasks per node: the old rule, or a clear error ---------------------------------------------------

def test_several_tasks_per_node_keep_one_rank_per_task_when_the_count_agrees_or_nothing_asks() -> None:
    assert plan_for(SRUN_N2_X2_TASK3_RECORDED, visible=gpus(8)) is None  # GPUs alone never override the tasks
    assert plan_for(SRUN_N2_X2_TASK3_RECORDED, extra={"DISTFN_NPROCS": "2"}) is None  # = tasks per node
    assert plan_for(SRUN_N2_X2_TASK3_RECORDED, extra={"DISTFN_NPROCS": "4"}) is None  # = tasks in the step


def test_a_second_task_on_a_node_is_an_error_when_a_per_node_count_is_asked() -> None:
    with pytest.raises(LauncherError) as err:
        plan_for(SRUN_N2_X2_TASK3_RECORDED, extra={"DISTFN_NPROCS": "3"})
    text = str(err.value)
    assert "DISTFN_NPROCS=3" in text and "started 2 tasks on this node" in text
    assert "--ntasks-per-node=1" in text and "unset DISTFN_NPROCS" in text


@pytest.mark.parametrize("env", [SRUN_UNEVEN_ALONE, SRUN_UNEVEN_PAIRED], ids=["alone-on-its-node", "paired"])
def test_uneven_tasks_per_node_is_an_error_on_every_task(env: Mapping[str, str]) -> None:
    # both kinds of task fail before any rendezvous, so no node waits for one that never comes
    with pytest.raises(LauncherError, match=r"spread 3 tasks unevenly over 2 nodes"):
        plan_for(env, extra={"DISTFN_NPROCS": "2"})
    # nothing asked (GPUs only): one rank per task on every node, as before; the count of the step itself too
    assert plan_for(env, visible=gpus(4)) is None
    assert plan_for(env, extra={"DISTFN_NPROCS": "3"}) is None


# -- the launch's options and log -----------------------------------------------------------------------------

def test_prepare_drops_max_restarts_and_describe_names_the_rule() -> None:
    layout = plan_for(SRUN_N2_PERNODE1_TASK0_RECORDED, extra={"DISTFN_NPROCS": "2"})
    assert layout is not None
    assert prepare(layout, Options(mode="ddp", max_restarts=2)).max_restarts == 0
    assert prepare(layout, DDP) is DDP
    line = describe(layout)
    assert "2 workers on each of 2 nodes, world size 4" in line
    assert "global rank = node_rank * 2 + local_rank" in line and f"node1:{layout.master_port}" in line


# -- end to end: two "pods" on loopback, one launching process each ---------------------------------------------

def two_pods(script: Path, out: Path) -> tuple[list[int], list[str]]:
    """Run ``script`` as two env:// "pods" (one launching process each) with DISTFN_NPROCS=2; exit codes, outputs."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script)],
        env=clean_env(RANK=str(node), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DISTFN_NPROCS="2", DISTFN_TEST_OUT=str(out), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [p.returncode for p in procs], outputs


KILLED_JOB: Final = """
import os, signal
from distfn import distributed

@distributed(mode="ddp", timeout=20)
def f(cfg, ctx):
    ctx.barrier()
    if ctx.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.barrier()
    return ctx.rank

if __name__ == "__main__":
    print("job " + "returned", f())
"""


@pytest.mark.slow
def test_a_killed_worker_is_reported_by_its_global_rank_and_every_node_ends(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED_JOB)
    codes, outputs = two_pods(script, tmp_path)
    assert codes == [1, 1], "\n".join(o[-3000:] for o in outputs)
    assert "WorkerError: rank 3 (pid" in outputs[1] and "was killed by SIGKILL" in outputs[1], outputs[1][-3000:]
    assert "WorkerError" in outputs[0] and "job returned" not in "".join(outputs)


@pytest.mark.slow
def test_two_env_pods_with_distfn_nprocs_2_train_four_ranks(tmp_path: Path) -> None:
    # Two processes with the plain env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no LOCAL_*)
    # stand in for one pod per node; each starts 2 workers: 4 ranks, identical weights, one checkpoint write.
    codes, outputs = two_pods(CLUSTER_SCRIPT, tmp_path)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"], r["launcher"]) for r in ranks] == [
        (0, 0, 0, 4, "env"), (1, 0, 1, 4, "env"), (2, 1, 0, 4, "env"), (3, 1, 1, 4, "env")]
    assert all(r["final"] == ranks[0]["final"] for r in ranks) and ranks[0]["final"] != ranks[0]["initial"]
    writes = (tmp_path / "writes.log").read_text().splitlines()
    assert len(writes) == 1 and writes[0].split()[0] == "0", writes
    assert "".join(outputs).count("one task per node (env)") == 1
