"""A small DDP training that records what each rank saw (driven by tests/test_core.py).

Usage: python core_job.py OUT_DIR   (or under torchrun). PRE_MATMUL=1 runs a multi-threaded matmul in the
launching process first, which makes fork unsafe, so distfn must fall back to spawn.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distfn import distributed


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(101, 8, generator=g)  # 101: not divisible by the world size
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


@distributed(mode="ddp", seed=1234, nprocs=2)
def train(cfg, ctx):
    ds = dataset()
    sampler = ctx.sampler(ds, shuffle=True)
    indices = list(iter(sampler))
    model = ctx.wrap(nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1)))
    init = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(ds, batch_size=8, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    params = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    out = Path(cfg["out"])
    record = {
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
        "launcher": ctx.launcher, "device": str(ctx.device), "backend": ctx.backend, "is_main": ctx.is_main,
        "pid": os.getpid(), "indices": indices, "init": init.tolist(), "params": params.tolist(),
        "mean_rank": ctx.all_reduce(float(ctx.rank)), "max_rank": ctx.all_reduce(ctx.rank, op="max"),
        "gathered": ctx.gather_object(ctx.rank), "broadcast": ctx.broadcast_object(f"from {ctx.rank}"),
        "threads": torch.get_num_threads(),
    }
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    ctx.save(model, out / "model.safetensors")
    return {"rank": ctx.rank, "params": params}


if __name__ == "__main__":
    if os.environ.get("PRE_MATMUL"):
        a = torch.randn(600, 600)
        for _ in range(3):
            a = a @ a / 600
    out = Path(sys.argv[1])
    result = train({"out": str(out)})
    tag = os.environ.get("RANK", "caller")
    (out / f"result-{tag}.json").write_text(json.dumps({
        "rank": result["rank"], "params": result["params"].tolist(),
        "params_device": str(result["params"].device), "params_type": type(result["params"]).__name__,
    }))
