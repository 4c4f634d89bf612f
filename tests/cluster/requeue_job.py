"""A loop that checkpoints every step, stops on a stop signal and, with ``requeue=True``, comes back from Slurm's
queue and resumes (driven by tests/cluster/test_requeue.py).

python requeue_job.py OUT_DIR      (one rank per srun task; the same data on every rank, so the DDP result equals
                                    one process training alone: the reference the job computes at the end)
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import distfn
from distfn import distributed

OUT = Path(sys.argv[1])
STEPS = 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def reference() -> list[float]:
    """The same training in one process, uninterrupted."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


@distributed(seed=0, requeue=True)
def train(cfg, ctx):
    model = ctx.wrap(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"model": model, "optimizer": opt}
    start = 0
    if (last := distfn.latest(OUT / "ckpt")) is not None:
        start = ctx.load(last, into=state)["step"] + 1
    run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    for step in range(start, STEPS):
        x, y = batch(step)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ctx.save({**state, "step": step}, OUT / "ckpt" / f"ckpt-{step}.safetensors", keep=2)
        (OUT / f"rank{ctx.rank}.ready").touch()  # the test signals the job once every rank is stepping
        time.sleep(0.5)
        if ctx.should_stop:
            return {"run": run, "rank": ctx.rank, "start": start, "stopped_at": step}
    weights = [v for p in ctx.unwrap(model).parameters() for v in p.detach().flatten().tolist()]
    return {"run": run, "rank": ctx.rank, "start": start, "finished": True, "weights": weights,
            "reference": reference()}


if __name__ == "__main__":
    print("RECORD " + json.dumps(train()), flush=True)
