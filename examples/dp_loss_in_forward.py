"""``mode="dp"``: one process, ``nn.DataParallel`` over the visible GPUs, with the loss computed inside
``forward`` (the usual recipe for balancing DataParallel's GPU 0).

    python examples/dp_loss_in_forward.py            # all visible GPUs, or the CPU here
    python examples/dp_loss_in_forward.py --epochs 3

DataParallel splits each batch over the GPUs, runs ``forward`` on each, and gathers the outputs on GPU 0.
When ``forward`` returns the loss, each GPU computes its own share of it and DataParallel returns one loss per
GPU (a vector of length ``torch.cuda.device_count()``): reduce it to a scalar before ``backward``.
``ctx.reduce_loss`` takes the mean (and leaves a scalar alone, so the same code runs on the CPU).

DDP (``mode="ddp"``, one process per GPU) is faster even on one machine; use DP when a single process is a
must (a notebook, code that is hard to make multi-process).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import distfn
from distfn import distributed


class Net(nn.Module):
    """A classifier whose ``forward`` returns the loss when labels are given, so each replica returns its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        outputs = self.body(inputs)
        if labels is not None:
            return self.loss_fn(outputs, labels)  # computed on each GPU for its slice of the batch
        return outputs


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    centers = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 0.5  # the same 4 classes always
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    return centers[labels] + torch.randn(n, 32, generator=g), labels


@distributed(mode="dp", seed=0)
def train(cfg: dict, ctx: distfn.Context) -> dict:
    model = ctx.wrap(Net())  # DataParallel over the visible GPUs (inputs are scattered from ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(4096, seed=1)
    x_test, y_test = make_data(1024, seed=2)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    ctx.print(f"mode={ctx.mode} on {ctx.device}, DataParallel over {gpus or 'no'} GPU(s)")

    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), cfg["batch_size"]):
            idx = perm[i:i + cfg["batch_size"]]
            losses = model(x[idx].to(ctx.device), y[idx].to(ctx.device))  # one loss per GPU (a scalar on CPU)
            loss = ctx.reduce_loss(losses)  # their mean: a scalar to call backward on
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        per_gpu = [round(v, 4) for v in losses.detach().cpu().reshape(-1).tolist()]
        ctx.print(f"epoch {epoch}: loss {total / len(x):.4f} (last step's per-GPU losses: {per_gpu})")

    with torch.no_grad():
        accuracy = (model(x_test.to(ctx.device)).argmax(dim=1).cpu() == y_test).float().mean().item()
    ctx.print(f"test accuracy {accuracy:.3f}")
    return {"loss": total / len(x), "accuracy": accuracy}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()
    print(train({"epochs": args.epochs, "batch_size": args.batch_size}))
