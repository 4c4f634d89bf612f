"""Exact resume: a process, a self-spawned 2-rank job (every rank gets back its own RNG stream, ctx.save/load
rng=True) and a torchrun group restarted after a crash all continue bit-for-bit."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_helpers import repo_env
from safetensors import safe_open
from safetensors.torch import load_file

from distfn import checkpoint

from conftest import SCRIPTS, run_python


@pytest.mark.slow
def test_per_rank_rng_resume_is_bit_for_bit(tmp_path: Path) -> None:
    for phase in ("full", "resume"):
        done = run_python([str(SCRIPTS / "resume_job.py"), str(tmp_path), phase])
        assert done.returncode == 0, done.stderr
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed["params"] == full["params"]  # exact, not approximate
    assert resumed["next_draw"] == full["next_draw"]  # each rank's generator is where it would have been
    assert full["next_draw"][0] != full["next_draw"][1]  # ... and the ranks' streams really differ
    with safe_open(str(tmp_path / "ckpt-5.safetensors"), "pt") as f:  # a stock safetensors file
        assert any(k.startswith("rng.") for k in f.keys())

_RESUME = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    import torch
    from torch import nn
    from distfn import checkpoint

    mode, out = sys.argv[1], sys.argv[2]
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)

    def step():
        # Every step draws from torch, NumPy and Python RNGs, so all three must be restored exactly.
        x = torch.randn(16, 8) + float(np.random.rand()) + random.random()
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()

    start = 0
    if mode == "resume":
        state = checkpoint.load_into(out + ".ckpt.safetensors",
                                     {"model": model, "optimizer": opt, "scheduler": sched, "rng": checkpoint.RNG})
        start = state["step"]
    stop = 5 if mode == "first" else 10
    for _ in range(start, stop):
        step()
    if mode == "first":
        checkpoint.save({"model": model, "optimizer": opt, "scheduler": sched, "rng": checkpoint.RNG,
                         "step": stop}, out + ".ckpt.safetensors")
    else:
        checkpoint.save(model, out)
    """
)


@pytest.mark.slow
def test_resume_is_bit_for_bit(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    straight, resumed = tmp_path / "straight.safetensors", tmp_path / "resumed.safetensors"

    def run(mode: str, out: pathlib.Path) -> None:
        subprocess.run([sys.executable, str(script), mode, str(out)], check=True, env=repo_env(), timeout=120)

    run("straight", straight)
    run("first", resumed)
    run("resume", resumed)
    a, b = load_file(straight), load_file(resumed)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-for-bit, not allclose
    # Without the RNG state the resumed run diverges (dropout masks and data differ): the test has teeth.
    text = _RESUME.replace(', "rng": checkpoint.RNG}', "}")
    script.write_text(text)
    norng = tmp_path / "norng.safetensors"
    run("first", norng)
    run("resume", norng)
    c = load_file(norng)
    assert not all(torch.equal(a[k], c[k]) for k in a)


_ELASTIC = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    import distfn
    from distfn import distributed

    @distributed(mode="ddp", seed=0)
    def train(cfg, ctx):
        model = ctx.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        start = 0
        last = distfn.latest(cfg["dir"])
        if last is not None:
            start = ctx.load(last, into=state)["step"] + 1
            ctx.print(f"resumed after step {start - 1} from {os.path.basename(last)}")
        for step in range(start, cfg["steps"]):
            if step == cfg["crash_at"] and ctx.rank == 1 and not os.path.exists(cfg["marker"]):
                open(cfg["marker"], "w").close()
                os._exit(3)  # a hard crash of rank 1, once: torchrun restarts the whole group
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)  # this rank's batch of this step
            x = torch.randn(16, 8, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ctx.save({**state, "step": step}, os.path.join(cfg["dir"], f"ckpt-{step}.safetensors"), keep=2)
            ctx.barrier()  # the checkpoint is complete before any rank goes on (or crashes)
        if ctx.is_main:
            ctx.save(state, cfg["out"])

    if __name__ == "__main__":
        d, out, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
        train({"dir": d, "out": out, "steps": 8, "crash_at": crash_at, "marker": out + ".crashed"})
    """
)


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_latest_checkpoint(tmp_path: pathlib.Path) -> None:
    """torchrun --max-restarts=1, rank 1 dies once mid-training: the restarted group resumes from the newest
    checkpoint and ends bit-identical (weights, Adam moments, scheduler) to an uninterrupted run."""
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    script = tmp_path / "elastic.py"
    script.write_text(_ELASTIC)
    env = {k: v for k, v in repo_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("TORCHELASTIC_", "DISTFN_", "SLURM_", "OMPI_", "PMI_"))}

    def run(name: str, crash_at: int) -> subprocess.CompletedProcess[str]:
        (tmp_path / name).mkdir()
        return subprocess.run(
            [str(torchrun), "--standalone", "--nproc_per_node=2", "--max-restarts=1", str(script),
             str(tmp_path / name), str(tmp_path / f"{name}.safetensors"), str(crash_at)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )

    crashed = run("crashed", crash_at=5)
    assert crashed.returncode == 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert (tmp_path / "crashed.safetensors.crashed").exists()  # the crash really happened
    assert "resumed after step 4 from ckpt-4.safetensors" in crashed.stdout + crashed.stderr
    straight = run("straight", crash_at=-1)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert "resumed" not in straight.stdout + straight.stderr
    a, b = load_file(tmp_path / "crashed.safetensors"), load_file(tmp_path / "straight.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert sorted(p.name for p in (tmp_path / "crashed").iterdir()) == ["ckpt-6.safetensors", "ckpt-7.safetensors"]


@pytest.mark.slow
def test_ctx_resume_after_kill_9_is_bit_identical(tmp_path: pathlib.Path) -> None:
    """Issue 13 item 2: a 2-rank job whose rank 1 is killed (-9) mid-training is re-run as it was;
    `ctx.resume` picks up the newest complete checkpoint (with every rank's RNG) and the final weights equal an
    uninterrupted run's bit for bit; keep= rotation goes on numbering from there."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    straight.mkdir()
    crashed.mkdir()
    done = run_python([str(SCRIPTS / "resume_job.py"), str(straight), "restart", "-1"])
    assert done.returncode == 0, done.stderr[-3000:]
    first = run_python([str(SCRIPTS / "resume_job.py"), str(crashed), "restart", "7"])
    assert first.returncode != 0 and not (crashed / "restart.json").exists()  # the job really died
    assert checkpoint.latest(crashed / "ckpt") is not None
    again = run_python([str(SCRIPTS / "resume_job.py"), str(crashed), "restart", "7"])  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    a = json.loads((straight / "restart.json").read_text())
    b = json.loads((crashed / "restart.json").read_text())
    assert a["start"] == 0 and b["start"] in (4, 6)  # resumed from the newest complete checkpoint
    assert b["params"] == a["params"]  # exact, not approximate
    assert b["next_draw"] == a["next_draw"]
    assert b["files"] == a["files"] == ["ckpt-10.safetensors", "ckpt-8.safetensors"]
