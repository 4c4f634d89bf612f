"""One task per node on the real two-virtual-node Slurm: distfn starts the node's ranks itself (distfn.launch.pernode).

``srun -N2 --ntasks-per-node=1`` (and ``mpirun -npernode 1`` across the two nodes of an ``sbatch`` job) with
``DISTFN_NPROCS=2`` must give 4 ranks, numbered node by node, with identical weights and one checkpoint write;
node 0's launching process returns rank 0's value and node 1's returns ``None``. Bad layouts (tasks spread
unevenly, a second task on a node) fail on every task at once with the error naming the fix.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import (
    ROOT,
    SRUN_TIMEOUT,
    check_job,
    job_name,
    launch_env,
    require_slurm,
    require_tool,
    run,
    sbatch_and_poll,
    srun,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLUSTER_DIR = Path(__file__).resolve().parent

# The cluster script's train(), called by a launching process that writes down what it got back.
CALLER = """
import os, sys
sys.path.insert(0, CLUSTER_DIR)
from script import train

if __name__ == "__main__":
    result = train({"epochs": 2})
    node = os.environ.get("SLURM_NODEID", os.environ.get("OMPI_COMM_WORLD_RANK"))
    with open(os.path.join(os.environ["DISTFN_TEST_OUT"], f"result-node{node}.txt"), "w") as f:
        f.write(f"node {node} rank {None if result is None else result['rank']}")
"""


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def _caller(tmp_path: Path) -> Path:
    path = tmp_path / "caller.py"
    path.write_text(CALLER.replace("CLUSTER_DIR", repr(str(CLUSTER_DIR))))
    return path


def _check_results(out: Path, output: str) -> None:
    results = sorted(p.read_text() for p in out.glob("result-node*.txt"))
    assert results == ["node 0 rank 0", "node 1 rank None"], output[-4000:]
    assert output.count("one task per node (") == 1, "the layout is logged once"
    assert "2 workers on each of 2 nodes, world size 4" in output


def test_srun_one_task_per_node_spawns_two_workers_on_each(out_dir: Path, tmp_path: Path) -> None:
    nodes = require_slurm(2)
    name = job_name()
    res = run(srun("-J", name, "-N2", "--ntasks-per-node=1", sys.executable, str(_caller(tmp_path))),
              launch_env(out_dir, DISTFN_NPROCS="2"), SRUN_TIMEOUT, slurm_job=name)
    ranks = check_job(out_dir, world=4, nodes=2, launcher="slurm", context=res.stdout)
    assert [r["slurmd_nodename"] for r in ranks] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    _check_results(out_dir, res.stdout)


def test_mpirun_npernode_1_across_two_sbatch_nodes(out_dir: Path, tmp_path: Path) -> None:
    nodes = require_slurm(2)
    require_tool("mpirun")
    require_tool("sbatch")
    log = tmp_path / "job.log"
    wrap = (f"mpirun --oversubscribe -npernode 1 -np 2 -x MASTER_ADDR={nodes[0]} -x DISTFN_NPROCS "
            f"{sys.executable} {_caller(tmp_path)}")
    output = sbatch_and_poll(["-O", "-N2", "--ntasks-per-node=1", "-o", str(log), "--wrap", wrap],
                             launch_env(out_dir, DISTFN_NPROCS="2"), SRUN_TIMEOUT, log)
    check_job(out_dir, world=4, nodes=2, launcher="mpi", context=output)
    _check_results(out_dir, output)


@pytest.mark.parametrize(
    ("layout", "nprocs", "message"),
    [(["-N2", "-n3"], "2", "spread 3 tasks unevenly over 2 nodes"),
     (["-N1", "-n2"], "3", "started 2 tasks on this node (a second task on a node")],
    ids=["uneven-nodes", "second-task-on-a-node"],
)
def test_bad_layouts_fail_fast_on_every_task(out_dir: Path, layout: list[str], nprocs: str, message: str) -> None:
    require_slurm(2 if layout[0] == "-N2" else 1)
    name = job_name()
    start = time.monotonic()
    proc = subprocess.run(srun("-J", name, *layout, sys.executable, str(CLUSTER_DIR / "script.py")),
                          env=launch_env(out_dir, DISTFN_NPROCS=nprocs), cwd=ROOT, capture_output=True, text=True,
                          timeout=SRUN_TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert message in output and "--ntasks-per-node=1" in output, output[-4000:]
    assert time.monotonic() - start < 90, "a bad layout must not wait for a rendezvous"
    assert not list(out_dir.glob("rank*.json"))
