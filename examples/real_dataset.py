"""A real dataset with no download: scikit-learn's bundled handwritten digits (1,797 8×8 images, 10 classes),
trained with DDP to ≥ 95 % test accuracy (about 97 % with the defaults).

    pip install 'distfn[examples]'          # scikit-learn
    python examples/real_dataset.py         # 2 CPU workers here, one per GPU on a GPU machine
    torchrun --nproc_per_node=2 examples/real_dataset.py --epochs 30

Shows ``ctx.dataloader`` (per-rank batches, reshuffled every epoch by itself), the mean loss across ranks,
``ctx.gather_for_metrics`` (an exact test accuracy over the whole test set, with ``DistributedSampler``'s
padding duplicates dropped), and ``ctx.save`` of the trained model.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distfn
from distfn import distributed


def load_digits_split(test_fraction: float = 0.25) -> tuple[TensorDataset, TensorDataset]:
    """The digits as float tensors scaled to [0, 1], split the same way on every rank (a fixed seed)."""
    # Imported here, in the workers: scikit-learn loads thread pools (OpenMP/BLAS), and a process with extra
    # threads cannot fork safely, so importing it before the launch would make distfn fall back to spawn.
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


# 2 CPU workers without GPUs. device_count() asks NVML, which keeps this process safe to fork; is_available()
# would initialise the CUDA driver here, and forked workers could not use CUDA (docs: troubleshooting).
@distributed(mode="ddp", seed=0, nprocs=None if torch.cuda.device_count() else 2)
def train(cfg: dict, ctx: distfn.Context) -> dict | None:
    train_set, test_set = load_digits_split()
    ctx.print(f"digits: {len(train_set)} training and {len(test_set)} test images on {ctx.world_size} rank(s)")
    model = ctx.wrap(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    loader = ctx.dataloader(train_set, batch_size=cfg["batch_size"])  # batch_size is per rank
    test_loader = ctx.dataloader(test_set, batch_size=256, shuffle=False)

    for epoch in range(cfg["epochs"]):
        model.train()
        total, count = torch.zeros((), device=ctx.device), 0
        for x, y in loader:  # a new shuffle each epoch, no set_epoch to forget
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + loss.detach(), count + 1
        mean_loss = ctx.all_reduce(total / count).item()  # averaged over ranks: the same on all of them
        if epoch % max(1, cfg["epochs"] // 5) == 0 or epoch == cfg["epochs"] - 1:
            ctx.print(f"epoch {epoch:3d}: mean loss across ranks {mean_loss:.4f}")

    model.eval()
    predictions, labels = [], []
    with torch.no_grad():
        for x, y in test_loader:
            predictions.append(model(x.to(ctx.device)).argmax(dim=1))
            labels.append(y.to(ctx.device))
    # every rank scored its share; gather all of them, without the sampler's padding duplicates
    pred = ctx.gather_for_metrics(torch.cat(predictions), test_loader)
    true = ctx.gather_for_metrics(torch.cat(labels), test_loader)
    accuracy = (pred == true).float().mean().item()
    ctx.print(f"test accuracy {accuracy:.4f} on {len(true)} images (all {len(test_set)} exactly once)")
    path = ctx.save(model, cfg["out"])  # rank 0 writes; bare keys, loadable with distfn.load for inference
    ctx.print(f"model saved to {path}")
    result = {"accuracy": accuracy, "loss": mean_loss, "test_images": len(true), "checkpoint": str(path)}
    return result if ctx.is_main else None  # one report: under torchrun/srun/mpirun every process returns its own


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="digits.safetensors")
    args = p.parse_args()
    result = train({"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "out": args.out})
    if result is not None:  # None on the other ranks under an external launcher
        print(result)
