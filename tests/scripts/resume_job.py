"""Per-rank exact resume (driven by tests/test_resume.py).

python resume_job.py OUT full     -> 10 steps, saving ckpt-5 with every rank's RNG on the way
python resume_job.py OUT resume   -> a fresh job: load ckpt-5 (model, Adam, scheduler, RNG), 5 more steps
Each rank draws its own noise and dropout masks, so resuming bit-for-bit needs each rank's own RNG state.
"""

import json
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


if __name__ == "__main__":
    result = job({"out": sys.argv[1], "phase": sys.argv[2]})
    Path(sys.argv[1], f"{sys.argv[2]}.json").write_text(json.dumps(result))
