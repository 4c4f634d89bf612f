"""Per-rank exact resume (driven by tests/test_resume.py).

python resume_job.py OUT full     -> 10 steps, saving ckpt-5 with every rank's RNG on the way
python resume_job.py OUT resume   -> a fresh job: load ckpt-5 (model, Adam, scheduler, RNG), 5 more steps
python resume_job.py OUT restart CRASH_AT -> ctx.resume from OUT/ckpt (if any), 10 steps saving every 2 with
                                   keep=2 and rng=True; rank 1 kills itself (SIGKILL) at step CRASH_AT once (-1: never)
Each rank draws its own noise and dropout masks, so resuming bit-for-bit needs each rank's own RNG state.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from distfn import distributed


@distributed(mode="ddp", nprocs=2, seed=5)
def job(cfg, ctx):
    out = Path(cfg["out"])
    model = ctx.wrap(nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    start = 0
    if cfg["phase"] == "resume":
        start = ctx.load(out / "ckpt-5.safetensors", into=state, rng=True)["step"]
    else:
        torch.rand(ctx.rank + 1)  # ranks' generators diverge from here on
    for step in range(start, 10):
        if step == 5 and cfg["phase"] == "full":
            ctx.save({**state, "step": step}, out / "ckpt-5.safetensors", rng=True)
        x = torch.randn(8, 6)  # this rank's own data
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    params = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    return {"params": params.tolist(), "next_draw": ctx.gather_object(torch.rand(1).item())}


@distributed(mode="ddp", nprocs=2, seed=5)
def restart_job(cfg, ctx):
    model = ctx.wrap(nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    directory = Path(cfg["out"]) / "ckpt"
    start = ctx.resume(state, directory)  # 0 (state untouched) on the first run, else the newest saved step
    assert state["step"] == start
    if start == 0:
        torch.rand(ctx.rank + 1)  # ranks' generators diverge (restored on resume)
    for step in range(start, 10):
        marker = Path(cfg["out"]) / "crashed"
        if step == cfg["crash_at"] and ctx.rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of training, once
        x = torch.randn(8, 6)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 2 == 0:  # the checkpoint after step+1 completed steps
            ctx.save({**state, "step": step + 1}, directory / f"ckpt-{step + 1}.safetensors", keep=2, rng=True)
    params = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    return {"params": params.tolist(), "next_draw": ctx.gather_object(torch.rand(1).item()), "start": start,
            "files": sorted(p.name for p in directory.iterdir())}


if __name__ == "__main__":
    if sys.argv[2] == "restart":
        result = restart_job({"out": sys.argv[1], "crash_at": int(sys.argv[3])})
        Path(sys.argv[1], "restart.json").write_text(json.dumps(result))
        sys.exit(0)
    result = job({"out": sys.argv[1], "phase": sys.argv[2]})
    Path(sys.argv[1], f"{sys.argv[2]}.json").write_text(json.dumps(result))
