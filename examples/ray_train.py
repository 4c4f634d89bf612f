"""Train on a Ray cluster: every rank is a Ray actor (one GPU each where the cluster has GPUs).

    ray start --head                                  # or use a running cluster: export RAY_ADDRESS=<head>:6379
    python examples/ray_train.py                      # one rank per GPU of the cluster
    DISTFN_NPROCS=4 python examples/ray_train.py      # a cluster without GPUs: say how many ranks (1 CPU each)

Nothing below is Ray code: only ``launcher="ray"`` is. Any distfn script runs on Ray unchanged with
``DISTFN_LAUNCHER=ray python train.py``, and this one runs without Ray when ``launcher="ray"`` is removed. distfn
(and torch) must be installed on every node; the function travels to the actors by value, since it is defined in
the script you run. The checkpoint is written by rank 0, on rank 0's node: give a path on shared storage.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from distfn import distributed


def make_dataset(n: int = 1024, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression task with a known answer: y = sin(x @ w) plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return x, torch.sin(x @ w / 4) + 0.05 * torch.randn(n, 1, generator=g)


@distributed(mode="ddp", seed=0, launcher="ray")
def train(cfg: dict, ctx) -> dict:
    x, y = make_dataset()
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = ctx.sampler(dataset, shuffle=True)  # this rank's share, reshuffled per epoch
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
    model = ctx.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))  # DDP on ctx.device
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        total = torch.zeros((), device=ctx.device)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(ctx.device)), yb.to(ctx.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
        losses.append(ctx.all_reduce(total.item() / len(loader), op="mean"))
        ctx.log.info("epoch {}: mean loss across {} ranks on {} node(s) {:.4f}", epoch, ctx.world_size,
                     ctx.num_nodes, losses[-1])
    ctx.save(model, cfg["checkpoint"])  # rank 0 writes, the others wait
    return {"world_size": ctx.world_size, "num_nodes": ctx.num_nodes, "launcher": ctx.launcher,
            "first_loss": losses[0], "last_loss": losses[-1], "checkpoint": str(cfg["checkpoint"])}


if __name__ == "__main__":
    checkpoint = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "ray_train.safetensors")
    print(train({"epochs": int(os.environ.get("EPOCHS", "5")), "checkpoint": checkpoint}))
