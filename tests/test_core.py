"""The core promise: the same decorated script under `python script.py` and under torchrun, 2 CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SCRIPTS, clean_env, free_port, run_python

JOB = str(SCRIPTS / "core_job.py")


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(list(out.glob("rank*.json"))))]


def _check_job(out: Path, world: int, launcher: str) -> list[dict]:
    """What every correct run must show, whatever launched it."""
    recs = _records(out)
    assert [r["rank"] for r in recs] == list(range(world))
    assert {r["world_size"] for r in recs} == {world}
    assert {r["launcher"] for r in recs} == {launcher}
    assert [r["is_main"] for r in recs] == [True] + [False] * (world - 1)
    assert len({r["pid"] for r in recs}) == world  # one process per rank
    assert {r["device"] for r in recs} == {"cpu"} and {r["backend"] for r in recs} == {"gloo"}
    # Samplers: disjoint shares covering the 101-sample dataset (padding repeats at most world-1 indices).
    shares = [set(r["indices"]) for r in recs]
    assert set().union(*shares) == set(range(101))
    assert sum(len(r["indices"]) for r in recs) == 101 + (-101 % world)  # padded to a multiple of world
    assert len({len(r["indices"]) for r in recs}) == 1
    # Seeded: identical initialisation everywhere; DDP: identical weights after training.
    assert all(r["init"] == recs[0]["init"] for r in recs)
    assert all(r["params"] == recs[0]["params"] for r in recs)
    assert recs[0]["params"] != recs[0]["init"]
    # Collectives.
    assert {r["mean_rank"] for r in recs} == {sum(range(world)) / world}
    assert {r["max_rank"] for r in recs} == {world - 1}
    assert all(r["gathered"] == list(range(world)) for r in recs)
    assert {r["broadcast"] for r in recs} == {"from 0"}
    # Checkpoint: bare keys, CPU tensors, equal to the trained weights.
    state = load_file(str(out / "model.safetensors"))
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(t.device.type == "cpu" for t in state.values())
    flat = torch.cat([state[k].flatten() for k in ["0.weight", "0.bias", "2.weight", "2.bias"]])
    assert torch.allclose(flat, torch.tensor(recs[0]["params"]), atol=0, rtol=0)
    return recs


def _torchrun(out: Path, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    return run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", JOB, str(out)])


@pytest.mark.slow
def test_same_script_self_spawn_twice_at_once_and_torchrun(tmp_path: Path) -> None:
    a, b, t = tmp_path / "a", tmp_path / "b", tmp_path / "torchrun"
    for d in (a, b, t):
        d.mkdir()
    # Two self-spawned jobs at the same time on one machine (no fixed port), the second scaled to 3 ranks
    # from the environment; then the same file under torchrun.
    pa = subprocess.Popen([sys.executable, JOB, str(a)], env=clean_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    pb = subprocess.Popen([sys.executable, JOB, str(b)], env=clean_env(DISTFN_NPROCS="3"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=240) for p in (pa, pb)]
    assert pa.returncode == 0, outs[0][1]
    assert pb.returncode == 0, outs[1][1]
    spawned = _check_job(a, 2, "spawn")
    _check_job(b, 3, "spawn")
    done = _torchrun(t)
    assert done.returncode == 0, done.stderr
    torchrun = _check_job(t, 2, "torchrun")
    # Same seed, same data, same world: the two ways of launching train identical weights.
    assert spawned[0]["params"] == torchrun[0]["params"]
    # The caller of a self-spawned job gets rank 0's value with tensors on the CPU; torchrun's ranks their own.
    caller = json.loads((a / "result-caller.json").read_text())
    assert caller["rank"] == 0 and caller["params"] == spawned[0]["params"]
    assert caller["params_device"] == "cpu" and caller["params_type"] == "Tensor"
    assert [json.loads((t / f"result-{r}.json").read_text())["rank"] for r in (0, 1)] == [0, 1]
    # Logged once, by rank 0, with the reason.
    assert outs[0][1].count("launcher: self-spawned (") == 1
    assert "launcher: torchrun" in done.stderr and "TORCHELASTIC_RUN_ID" in done.stderr
    # Two local processes share the 2 cores: one thread each, unless OMP_NUM_THREADS says otherwise.
    assert {r["threads"] for r in spawned} == {1}


@pytest.mark.slow
def test_falls_back_to_spawn_when_fork_is_unsafe(tmp_path: Path) -> None:
    """A parent that ran a multi-threaded matmul would hang forked children (GNU OpenMP): distfn must notice,
    say so, and spawn instead, with the same results."""
    done = run_python([JOB, str(tmp_path)], env=clean_env(PRE_MATMUL="1", OMP_NUM_THREADS="2"))
    assert done.returncode == 0, done.stderr
    assert "start method forkserver" in done.stderr and "threads" in done.stderr
    recs = _check_job(tmp_path, 2, "spawn")
    assert len(recs) == 2


def test_legacy_launch_local_rank_argument(tmp_path: Path) -> None:
    """`python -m torch.distributed.launch` passes --local-rank=N; the in-place path must take it."""
    script = tmp_path / "legacy.py"
    script.write_text(
        "import sys\nfrom distfn import distributed\n"
        "@distributed\ndef f(cfg, ctx):\n    return (ctx.launcher, ctx.rank, ctx.local_rank, ctx.world_size)\n"
        "if __name__ == '__main__':\n    print('RESULT', f())\n"
    )
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(script), f"--local-rank={r}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr
    # torch < 1.9's launcher sets no TORCHELASTIC_RUN_ID: the plain env:// set with the flag's LOCAL_RANK
    assert "RESULT ('env', 0, 0, 2)" in outs[0][0]
    assert "RESULT ('env', 1, 1, 2)" in outs[1][0]
