"""The decorated training script the cluster tests launch under srun, sbatch, mpirun and torchrun.

It is run unchanged by every launcher; each rank writes ``rank<R>.json`` (what distfn told it, its
initial and final weights) into the directory named by ``DISTFN_TEST_OUT``, and every *real* checkpoint
write is logged as one line in ``writes.log`` there, so a test can check that ``ctx.save`` wrote once.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distfn.checkpoint
from distfn import distributed

OUT = Path(os.environ["DISTFN_TEST_OUT"])
_real_save = distfn.checkpoint.save


def _logged_save(*args, **kwargs):
    """Record every checkpoint that is really written (rank 0 only, if distfn is right)."""
    with open(OUT / "writes.log", "a") as f:  # O_APPEND: one whole line per write, whichever process
        f.write(f"{os.environ.get('DISTFN_TEST_RANK', '?')} {socket.gethostname()} {os.getpid()}\n")
    return _real_save(*args, **kwargs)


distfn.checkpoint.save = _logged_save


def flat(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().cpu().flatten()]


@distributed(mode="ddp", seed=1234, nprocs=int(os.environ.get("DISTFN_TEST_NPROCS", "2")))
def train(cfg: dict, ctx) -> dict:
    os.environ["DISTFN_TEST_RANK"] = str(ctx.rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    dataset = TensorDataset(x, y)
    sampler = ctx.sampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    bare = nn.Linear(4, 1)
    initial = flat(bare)  # seeded identically on every rank before any communication
    model = ctx.wrap(bare)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[int] = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        if epoch == 0:
            seen = list(iter(sampler))
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(ctx.device)), yb.to(ctx.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
    ctx.save(model, OUT / "model.safetensors")  # every rank calls it; only rank 0 may write
    record = {
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
        "launcher": ctx.launcher, "is_main": ctx.is_main, "device": str(ctx.device),
        "host": socket.gethostname(), "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "pid": os.getpid(), "initial": initial, "final": flat(ctx.unwrap(model)), "indices": seen,
        "loss_sum": ctx.all_reduce(loss.item(), op="sum"),
    }
    (OUT / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    train({"epochs": int(os.environ.get("DISTFN_TEST_EPOCHS", "2"))})
