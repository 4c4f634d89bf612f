"""The same decorated script (tests/cluster/script.py) under a real Slurm, Open MPI and multi-node torchrun.

Each test launches it, then checks what every launcher must give: distinct ranks, world size, node ranks,
identical weights on every rank, a disjoint data split, and a checkpoint written once by rank 0.

These tests need a running Slurm (``.ci/slurm-setup.sh up``: two virtual nodes) and Open MPI
(``.ci/mpi-setup.sh up``). Where a tool is missing they are skipped *with the reason*; with
``DISTFN_REQUIRE_CLUSTER=1`` (CI) a missing tool is a failure instead, so CI can never pass by skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "script.py"
SETUP_HINTS = {
    "mpirun": "Open MPI is not installed; `bash .ci/mpi-setup.sh up` installs and checks it",
    "torchrun": "torch is not installed in this environment",
}
SLURM_HINT = "Slurm is not running here; `bash .ci/slurm-setup.sh up` starts one (two virtual nodes)"

# Anything a launcher exports; the tests start from an environment without them (pytest may itself run
# inside a Slurm job or under torchrun).
_LAUNCHER_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_")
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTFN_NPROCS"}


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail when CI demands the cluster (DISTFN_REQUIRE_CLUSTER=1)."""
    if os.environ.get("DISTFN_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"{reason} (DISTFN_REQUIRE_CLUSTER=1: CI must run the cluster tests)")
    pytest.skip(reason)


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} not found on PATH: {SETUP_HINTS.get(name, SLURM_HINT)}")
    return path  # type: ignore[return-value]


def slurm_nodes() -> list[str]:
    """Names of the Slurm nodes that can take jobs now (skips/fails when Slurm is missing or down)."""
    require_tool("srun")
    require_tool("sinfo")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        unavailable("sinfo did not answer in 15 s: slurmctld is not running; " + SLURM_HINT)
    if out.returncode != 0:
        unavailable(f"sinfo failed ({out.stderr.strip()}): slurmctld is not running; {SLURM_HINT}")
    usable = ("idle", "mix", "alloc", "comp")
    return sorted({line.split()[0] for line in out.stdout.splitlines()
                   if len(line.split()) == 2 and line.split()[1].rstrip("*~#") in usable})


def require_slurm(min_nodes: int) -> list[str]:
    nodes = slurm_nodes()
    if len(nodes) < min_nodes:
        unavailable(f"needs {min_nodes} Slurm node(s), sinfo shows {nodes or 'none'} usable; "
                    "run `SLURM_CI_NODES=2 bash .ci/slurm-setup.sh up`")
    return nodes


def launch_env(out: Path, **extra: str) -> dict[str, str]:
    """The test environment: no launcher variables, distfn importable from the checkout, results to ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["DISTFN_TEST_OUT"] = str(out)
    env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores here
    env["PYTHONUNBUFFERED"] = "1"
    # Open MPI refuses root unless both of these are set (an MCA parameter does not exist for it), and
    # wants this for more ranks than cores.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env.update(extra)
    return env


def job_name() -> str:
    return f"distfn-test-{uuid.uuid4().hex[:8]}"


def run(cmd: Sequence[str], env: dict[str, str], timeout: float, *, slurm_job: str | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run a launcher command; on timeout kill it (and cancel its Slurm job) and fail with its output.

    An srun/sbatch asking for more than the partition has queues forever instead of failing, and a stuck
    rendezvous waits for the collective timeout: a hard wall-clock limit keeps CI from hanging.
    """
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if slurm_job:
            subprocess.run(["scancel", "--name", slurm_job], capture_output=True, timeout=15)
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s; output:\n{output[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, output, "")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}; output:\n{output[-6000:]}"
    return result


def load_ranks(out: Path, world: int, context: str = "") -> list[dict[str, Any]]:
    found = sorted(out.glob("rank*.json"))
    assert len(found) == world, f"expected {world} rank files, found {[p.name for p in found]}\n{context[-4000:]}"
    return sorted((json.loads(p.read_text()) for p in found), key=lambda r: r["rank"])


def check_job(out: Path, *, world: int, nodes: int, launcher: str, context: str = "") -> list[dict[str, Any]]:
    """Assert what every launcher must give: ranks, sizes, node layout, identical weights, one checkpoint."""
    import torch
    from safetensors.torch import load_file

    ranks = load_ranks(out, world, context)
    per_node = world // nodes
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:
        assert (r["world_size"], r["num_nodes"], r["local_world_size"], r["launcher"]) == (
            world, nodes, per_node, launcher), r
        # block layout (srun's default distribution, torchrun, mpirun's default mapping)
        assert (r["node_rank"], r["local_rank"]) == divmod(r["rank"], per_node), r
        assert r["is_main"] == (r["rank"] == 0)
    assert len({r["pid"] for r in ranks}) == world, "every rank is its own process"
    if nodes > 1 and all(r["slurmd_nodename"] for r in ranks):
        # ranks of one node rank really ran on the same (virtual) Slurm node, and nodes differ
        by_node = {n: {r["slurmd_nodename"] for r in ranks if r["node_rank"] == n} for n in range(nodes)}
        assert all(len(names) == 1 for names in by_node.values()), by_node
        assert len({next(iter(v)) for v in by_node.values()}) == nodes, by_node
    # data: the sampler split is disjoint and covers the 64 samples
    seen = [i for r in ranks for i in r["indices"]]
    assert sorted(seen) == list(range(64)), "sampler shares overlap or miss samples"
    # weights: identical at init (seeded) and after training (DDP), and training changed them
    assert all(r["initial"] == ranks[0]["initial"] for r in ranks)
    assert all(r["final"] == ranks[0]["final"] for r in ranks), "ranks ended with different weights"
    assert ranks[0]["final"] != ranks[0]["initial"]
    assert len({r["loss_sum"] for r in ranks}) == 1, "all_reduce gave different values"
    # checkpoint: written once, by rank 0, bare key names, the trained weights
    writes = (out / "writes.log").read_text().splitlines()
    assert len(writes) == 1 and writes[0].split()[0] == "0", f"checkpoint writes: {writes}"
    state = load_file(str(out / "model.safetensors"))
    assert sorted(state) == ["bias", "weight"], sorted(state)
    saved = torch.cat([state["weight"].flatten(), state["bias"].flatten()]).tolist()
    assert saved == ranks[0]["final"]
    return ranks


pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


# ---------------------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------------------

SRUN_TIMEOUT = 240  # seconds; a healthy run takes 5-30 s here (more on a loaded 2-core machine)


def srun(*args: str) -> list[str]:
    """srun that cannot queue forever (-O: overcommit CPUs) and stops every task when one fails."""
    return ["srun", "-O", "--kill-on-bad-exit=1", *args]


def test_srun_one_node_two_tasks(out_dir: Path) -> None:
    require_slurm(1)
    name = job_name()
    res = run(srun("-J", name, "-N1", "-n2", sys.executable, str(SCRIPT)), launch_env(out_dir), SRUN_TIMEOUT,
              slurm_job=name)
    check_job(out_dir, world=2, nodes=1, launcher="slurm", context=res.stdout)


def test_srun_two_virtual_nodes_four_ranks(out_dir: Path) -> None:
    nodes = require_slurm(2)
    name = job_name()
    res = run(srun("-J", name, "-N2", "--ntasks-per-node=2", sys.executable, str(SCRIPT)), launch_env(out_dir),
              SRUN_TIMEOUT, slurm_job=name)
    ranks = check_job(out_dir, world=4, nodes=2, launcher="slurm", context=res.stdout)
    # node rank 0 is the first node of the step's nodelist (the master), node rank 1 the second
    assert [ranks[0]["slurmd_nodename"], ranks[2]["slurmd_nodename"]] == nodes[:2]


_DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def sbatch_and_poll(args: Sequence[str], env: dict[str, str], timeout: float, log: Path, *,
                    expect_ok: bool = True) -> str:
    """``sbatch`` then poll the job every 0.3 s until it ends; assert it COMPLETED with exit code 0.

    Same outcome as ``sbatch --wait``, whose own polling backs off 2 s -> 8 s -> 32 s and so adds up to
    half a minute to a 10-second job; the literal ``--wait`` form is exercised once, by the 1-node example.
    """
    import time

    name = job_name()
    res = run(["sbatch", "--parsable", "-J", name, *args], env, 30, slurm_job=name)
    job_id = res.stdout.strip().split(";")[0].splitlines()[-1]
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=15)
        fields = dict(kv.split("=", 1) for kv in show.stdout.split() if "=" in kv)
        if fields.get("JobState") in _DONE_STATES:
            break
        time.sleep(0.3)
    else:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=15)
        pytest.fail(f"sbatch job {job_id} not done in {timeout:.0f} s (state {fields.get('JobState')}, "
                    f"reason {fields.get('Reason')}); log:\n{log.read_text()[-4000:] if log.exists() else ''}")
    output = log.read_text() if log.exists() else "(no log)"
    if expect_ok:
        assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), output[-6000:]
    else:
        assert fields.get("JobState") == "FAILED", (fields.get("JobState"), output[-6000:])
    return output


def test_sbatch_wait_example_one_node(out_dir: Path, tmp_path: Path) -> None:
    require_slurm(1)
    name = job_name()
    log = tmp_path / "slurm.out"
    # `-O` (overcommit) on the command line lets the job start on a 2-core node instead of queueing forever.
    cmd = ["sbatch", "--wait", "-O", "-J", name, "-o", str(log), str(ROOT / "examples/slurm/train_1node.sbatch"),
           str(SCRIPT)]
    run(cmd, launch_env(out_dir, PYTHON=sys.executable), SRUN_TIMEOUT, slurm_job=name)
    check_job(out_dir, world=2, nodes=1, launcher="slurm", context=log.read_text() if log.exists() else "")


def test_sbatch_example_multinode(out_dir: Path, tmp_path: Path) -> None:
    require_slurm(2)
    log = tmp_path / "slurm.out"
    sbatch_and_poll(["-O", "-o", str(log), str(ROOT / "examples/slurm/train_multinode.sbatch"), str(SCRIPT)],
                    launch_env(out_dir, PYTHON=sys.executable), SRUN_TIMEOUT, log)
    check_job(out_dir, world=4, nodes=2, launcher="slurm", context=log.read_text())


def test_sbatch_without_srun_self_spawns_on_the_node(out_dir: Path, tmp_path: Path) -> None:
    # The batch step looks like "rank 0 of 2" (SLURM_PROCID=0, SLURM_NTASKS=2) but is one process:
    # distfn must spawn its own workers there instead of waiting for peers that never come.
    require_slurm(1)
    log = tmp_path / "slurm.out"
    sbatch_and_poll(["-O", "-N1", "--ntasks-per-node=2", "-o", str(log), "--wrap", f"{sys.executable} {SCRIPT}"],
                    launch_env(out_dir, DISTFN_TEST_NPROCS="2"), SRUN_TIMEOUT, log)
    check_job(out_dir, world=2, nodes=1, launcher="spawn", context=log.read_text())


def test_srun_single_task_self_spawns_inside_the_step(out_dir: Path) -> None:
    # `srun -n1 python script.py` (or srun --pty) is how people get onto a compute node: one task is no
    # distributed job, so distfn spawns its own workers there.
    require_slurm(1)
    name = job_name()
    res = run(srun("-J", name, "-N1", "-n1", "-c2", sys.executable, str(SCRIPT)),
              launch_env(out_dir, DISTFN_TEST_NPROCS="2"), SRUN_TIMEOUT, slurm_job=name)
    check_job(out_dir, world=2, nodes=1, launcher="spawn", context=res.stdout)


def test_srun_inconsistent_variables_fail_fast_with_a_clear_error(out_dir: Path) -> None:
    # A bad MASTER_PORT must stop every task before init_process_group, not hang it.
    require_slurm(1)
    import time

    name = job_name()
    env = launch_env(out_dir, MASTER_PORT="70000")
    start = time.monotonic()
    proc = subprocess.run(srun("-J", name, "-N1", "-n2", sys.executable, str(SCRIPT)), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=SRUN_TIMEOUT)
    assert proc.returncode != 0
    assert "MASTER_PORT='70000' is not a TCP port" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    assert not list(out_dir.glob("rank*.json"))


def test_expand_hostlist_agrees_with_scontrol() -> None:
    # Cross-check of the pure Python expansion against Slurm's own (where scontrol accepts the form;
    # slurm 22.05 rejects suffixes after brackets such as a[1-2]-ib, which distfn still expands).
    require_tool("scontrol")
    from distfn.topology import expand_hostlist

    for text in ("node[01-04,07]", "n[098-101]", "n[8-10]", "r[1-2]n[01-02]", "gpu-a[01-02],gpu-b7,cpu1", "vm"):
        res = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=15)
        assert res.returncode == 0, res.stderr
        assert expand_hostlist(text) == res.stdout.split(), text


# ---------------------------------------------------------------------------------------------------------
# Open MPI
# ---------------------------------------------------------------------------------------------------------


def test_mpirun_two_ranks(out_dir: Path) -> None:
    require_tool("mpirun")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(SCRIPT)]
    res = run(cmd, launch_env(out_dir), SRUN_TIMEOUT)
    check_job(out_dir, world=2, nodes=1, launcher="mpi", context=res.stdout)


def test_mpirun_inside_two_node_sbatch(out_dir: Path, tmp_path: Path) -> None:
    # Open MPI starts its daemons through srun here, so every rank also sees SLURM_STEP_ID=0 and a
    # SLURM_PROCID of its node: MPI's variables must win. Two nodes need an exported MASTER_ADDR.
    require_tool("mpirun")
    nodes = require_slurm(2)
    log = tmp_path / "slurm.out"
    wrap = f"mpirun --oversubscribe -x MASTER_ADDR={nodes[0]} -np 4 {sys.executable} {SCRIPT}"
    sbatch_and_poll(["-O", "-N2", "--ntasks-per-node=2", "-o", str(log), "--wrap", wrap], launch_env(out_dir),
                    SRUN_TIMEOUT, log)
    ranks = check_job(out_dir, world=4, nodes=2, launcher="mpi", context=log.read_text())
    assert [r["slurmd_nodename"] for r in ranks] == [nodes[0], nodes[0], nodes[1], nodes[1]]


def test_mpirun_on_two_nodes_without_a_rendezvous_fails_fast(out_dir: Path, tmp_path: Path) -> None:
    require_tool("mpirun")
    require_slurm(2)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("mpi4py is installed: distfn would broadcast the rendezvous instead of failing")
    log = tmp_path / "slurm.out"
    wrap = f"mpirun --oversubscribe -np 4 {sys.executable} {SCRIPT}"
    output = sbatch_and_poll(["-O", "-N2", "--ntasks-per-node=2", "-o", str(log), "--wrap", wrap],
                             launch_env(out_dir), SRUN_TIMEOUT, log, expect_ok=False)
    assert "MASTER_ADDR is not set and mpi4py is not installed" in output and "mpirun -x MASTER_ADDR" in output
    assert not list(out_dir.glob("rank*.json"))


# ---------------------------------------------------------------------------------------------------------
# Multi-node torchrun, simulated by two agents on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------


def test_torchrun_two_agents_four_ranks(out_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = launch_env(out_dir)
    agents, logs = [], []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT)]
        # Each agent's output to a file, read whole at the end: an agent whose ranks failed exits at once while its
        # peer agent waits in torchrun's exit barrier (300 s), and its output is the one that says why.
        logs.append(tmp_path / f"agent{node_rank}.log")
        with logs[-1].open("w") as log:
            agents.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                           start_new_session=True))
    deadline = time.monotonic() + SRUN_TIMEOUT
    try:
        while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
            if any(a.returncode not in (None, 0) for a in agents):  # the other waits for it in vain
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    for node_rank, agent in enumerate(agents):
        assert agent.returncode == 0, (f"torchrun agent {node_rank} ended with {agent.returncode} (-9: killed "
                                       f"after the wait); the agents' output:\n" +
                                       "\n".join(f"--- agent {i}\n{o[-5000:]}" for i, o in enumerate(outputs)))
    check_job(out_dir, world=4, nodes=2, launcher="torchrun", context="\n".join(outputs))


def test_srun_two_nodes_mesh_auto_replicates_across_nodes_and_shards_within(out_dir: Path) -> None:
    """Issue 45: ``mesh="auto"`` on 2 nodes x 2 tasks is HSDP 2 x 2: the replica dimension runs across the nodes
    (a node's ranks share a ``dp_replicate`` coordinate and shard the weights between them), every rank ends
    with the same full weights and the same losses."""
    require_slurm(2)
    name = job_name()
    job = str(Path(__file__).resolve().parent / "mesh_auto_job.py")
    res = run(srun("-J", name, "-N2", "--ntasks-per-node=2", sys.executable, job), launch_env(out_dir),
              SRUN_TIMEOUT, slurm_job=name)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["names"] == ["dp_replicate", "dp_shard"] and r["shape"] == [2, 2] for r in ranks), res.stdout
    for r in ranks:  # outermost the node, innermost the rank within it
        assert r["coordinate"] == [r["node_rank"], r["rank"] % 2], r
        assert (r["dp_rank"], r["dp_size"]) == (r["rank"], 4)
        assert r["placements"] == ["R", "S(0)"], r["placements"]  # replicated across nodes, sharded within
    assert len({r["host"] for r in ranks}) == 2 and ranks[0]["host"] == ranks[1]["host"] != ranks[2]["host"]
    assert all(r["full"] == ranks[0]["full"] and r["losses"] == ranks[0]["losses"] for r in ranks)
    # the weights are those of the same model trained in one process on the 4 ranks' batches together
    assert all(r["gap_to_one_process"] < 1e-5 for r in ranks), [r["gap_to_one_process"] for r in ranks]
