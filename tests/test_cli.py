"""``python -m distfn env`` / the ``distfn`` console script: what it detects, in text and JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from distfn import __main__ as cli

# A task of `srun -N2 --ntasks-per-node=2` (rank 3 on the second node), as Slurm sets it.
SLURM_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NODELIST": "node[01-02]",
}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC_", "DISTFN_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "distfn", *args], env=clean, capture_output=True, text=True,
                          timeout=120)


def test_env_text_and_json_in_a_plain_shell() -> None:
    text = _run("env", env={"DISTFN_NPROCS": "3", "CUDA_VISIBLE_DEVICES": ""})
    assert text.returncode == 0, text.stderr
    assert "detected             spawn" in text.stdout
    assert "3 worker(s) (DISTFN_NPROCS)" in text.stdout
    assert "torch                " in text.stdout and "gloo yes" in text.stdout
    # every self-spawned rank is listed with its device
    assert [line.split()[2] for line in text.stdout.splitlines() if line.strip().startswith("local rank")] == \
        ["0", "1", "2"]

    raw = _run("env", "--json", env={"DISTFN_NPROCS": "3"})
    info = json.loads(raw.stdout)
    assert info["launcher"]["launcher"] == "spawn"
    assert info["plan"]["nprocs"] == "3" and info["plan"]["start_method"] in ("fork", "spawn")
    assert info["variables"]["DISTFN_NPROCS"] == "3"
    assert info["versions"]["torch"].startswith("2.")


def test_env_under_torchrun_variables_and_inconsistent_ones() -> None:
    ok = _run("env", "--json", env={"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"})
    info = json.loads(ok.stdout)
    assert ok.returncode == 0
    assert info["launcher"]["launcher"] == "torchrun"
    assert info["launcher"]["topology"]["rank"] == 1 and info["launcher"]["topology"]["world_size"] == 2
    assert [d["local_rank"] for d in info["plan"]["devices"]] == [1]

    bad = _run("env", env={"RANK": "1", "WORLD_SIZE": "2"})  # a stray partial torchrun set
    assert bad.returncode == 1
    assert "MASTER_ADDR" in bad.stdout and "error" in bad.stdout


def test_collect_slurm_task_in_process() -> None:
    info = cli.collect(SLURM_TASK)
    det = info["launcher"]
    assert det["launcher"] == "slurm" and det["error"] is None
    topo = det["topology"]
    assert (topo["rank"], topo["local_rank"], topo["world_size"]) == (3, 1, 4)
    assert (topo["node_rank"], topo["num_nodes"]) == (1, 2)
    assert topo["master_addr"] == "node01"
    assert info["variables"]["SLURM_STEP_NODELIST"] == "node[01-02]"
    text = cli.render(info)
    assert re.search(r"\n  rank\s+3 of 4\n", text) and re.search(r"node\s+1 of 2", text) and "node01:" in text


def test_forced_launcher_and_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.collect({}, launcher="mpi")["launcher"]["error"]  # forced MPI without MPI variables
    with pytest.raises(SystemExit):
        cli.main(["env", "--launcher", "nonsense"])
    assert "--launcher must be one of" in capsys.readouterr().err
    assert cli.main([]) == 2  # no command: help


def test_visible_devices_mapping_per_rank() -> None:
    """CUDA_VISIBLE_DEVICES='0,5' makes cuda:1 physical GPU 5."""
    env = {"CUDA_VISIBLE_DEVICES": "0,5", "DISTFN_NPROCS": "2"}
    cuda = {"device_count": 2, "mapping": cli._visible_mapping(env, 2)}
    plan = cli._plan({"launcher": "spawn", "topology": None}, cuda, env)
    assert plan["backend"] == "nccl"
    assert [(d["device"], d["physical_gpu"]) for d in plan["devices"]] == [("cuda:0", "0"), ("cuda:1", "5")]
    torchrun = {"launcher": "torchrun", "topology": {"local_rank": 3}}
    assert cli._plan(torchrun, cuda, env)["devices"] == [{"local_rank": 3, "device": "cuda:1", "physical_gpu": "5"}]
