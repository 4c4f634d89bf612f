"""distfn quick start: train a small MLP on synthetic data with DDP, then save it.

    python examples/quickstart.py                    # one worker per GPU, or 2 CPU workers here
    torchrun --nproc_per_node=2 examples/quickstart.py
    srun -N1 -n2 python examples/quickstart.py
    mpirun -np 2 python examples/quickstart.py

The same file runs unchanged under each: distfn detects the launcher.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distfn import distributed


def make_dataset(n: int = 2048, seed: int = 0) -> TensorDataset:
    """A regression task with a known answer: y = sin(x @ w) plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.sin(x @ w / 4) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


# With no GPU, run 2 CPU workers so the example is distributed on a laptop too (DISTFN_NPROCS overrides).
# device_count() asks NVML, which keeps this process safe to fork; is_available() would make distfn spawn.
@distributed(mode="ddp", seed=0, nprocs=None if torch.cuda.device_count() else 2)
def train(cfg: dict, ctx) -> dict | None:
    dataset = make_dataset()
    sampler = ctx.sampler(dataset, shuffle=True)            # this rank's share, reshuffled per epoch
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler)
    model = ctx.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))  # DDP on ctx.device
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in ctx.progress(loader, desc=f"epoch {epoch}"):  # a tqdm bar, on rank 0 only
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()                                  # gradients are averaged across ranks here
            opt.step()
            total, batches = total + loss.item(), batches + 1
        mean_loss = ctx.all_reduce(total / batches, op="mean")  # the same number on every rank
        ctx.print(f"epoch {epoch}: mean loss across {ctx.world_size} ranks = {mean_loss:.4f}")

    path = ctx.save(model, cfg["out"])                       # rank 0 writes; bare keys, CPU tensors
    ctx.print(f"saved {path}")
    # Rank 0 reports. Under torchrun, srun or mpirun every process gets its own return value, so the other
    # ranks return None and the result is printed once; a self-spawned run returns rank 0's to the caller.
    return {"final_loss": mean_loss, "world_size": ctx.world_size, "checkpoint": str(path)} if ctx.is_main else None


if __name__ == "__main__":
    cfg = {
        "epochs": int(os.environ.get("EPOCHS", 5)),
        "batch_size": 64,
        "lr": 3e-3,
        "out": sys.argv[1] if len(sys.argv) > 1 else "quickstart.safetensors",
    }
    result = train(cfg)
    if result is not None:  # None on the other ranks under an external launcher
        print(result)
