"""A complete training loop with distfn's helpers: per-rank data loading that reshuffles itself, gradient
accumulation without needless all-reduces, bf16 autocast, a rank-0 progress bar, the loss averaged over ranks,
TensorBoard from rank 0 only, and exact evaluation over the whole test set.

    python examples/train_loop.py                       # one worker per GPU, or 2 CPU workers here
    python examples/train_loop.py --epochs 5 --every 2 --precision 32
    torchrun --nproc_per_node=2 examples/train_loop.py
    tensorboard --logdir runs/train_loop                # when tensorboard is installed

Batch sizes: ``--batch-size`` is per rank and per micro-batch, so one optimizer step sees
``batch_size x world_size x every`` samples (the script prints it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distfn import distributed

CLASSES = 4


def make_dataset(n: int, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 32 dimensions (the same blobs for every seed; the seed picks the samples)."""
    centers = torch.randn(CLASSES, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(centers[labels] + 2.5 * torch.randn(n, 32, generator=g), labels)


def train(cfg: dict, ctx) -> dict | None:
    train_loader = ctx.dataloader(make_dataset(4000, seed=1), cfg["batch_size"])   # batch_size is per rank
    test_loader = ctx.dataloader(make_dataset(1001, seed=2), 256, shuffle=False)   # 1001: not divisible
    model = ctx.wrap(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, CLASSES)))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    acc = ctx.accumulate(model, every=cfg["every"])       # all-reduce once per `every` micro-batches
    writer = ctx.writer(cfg["log_dir"]) if cfg["tensorboard"] else None   # SummaryWriter on rank 0 only
    ctx.print(f"{ctx.world_size} rank(s) on {ctx.device}, precision {ctx.precision}; optimizer step = "
              f"{cfg['batch_size']} x {ctx.world_size} ranks x {cfg['every']} micro-batches = "
              f"{cfg['batch_size'] * ctx.world_size * cfg['every']} samples")

    history = []
    for epoch in range(cfg["epochs"]):            # each pass over train_loader is a new, reshuffled epoch
        model.train()
        # A tqdm bar on rank 0, nothing elsewhere (plain log lines in a batch job's log). It shows no loss:
        # the one loss of an epoch is the mean over all ranks, printed below (bar.log(loss=...) would show
        # rank 0's own, a different number).
        total, batches = torch.zeros((), device=ctx.device), 0
        for x, y in ctx.progress(train_loader, desc=f"epoch {epoch}"):
            x, y = x.to(ctx.device), y.to(ctx.device)
            with acc:                               # no all-reduce until the window's last micro-batch
                with ctx.autocast():                # bf16 (also on CPU) or fp16, per precision=
                    loss = F.cross_entropy(model(x), y)
                ctx.backward(loss)                  # divided by `every`; GradScaler'd for fp16
                ctx.step(opt)                       # steps and zero_grads when the window closes
            total += loss.detach().float()
            batches += 1
        train_loss = ctx.all_reduce(total / batches).item()   # the mean over all ranks, on every rank

        model.eval()
        predictions, labels = [], []
        with torch.no_grad(), ctx.autocast():
            for x, y in test_loader:
                predictions.append(model(x.to(ctx.device)).argmax(dim=1))
                labels.append(y.to(ctx.device))
        # Every rank's predictions, without the duplicates DistributedSampler pads the last batch with:
        pred, true = ctx.gather_for_metrics((torch.cat(predictions), torch.cat(labels)))
        accuracy = (pred == true).float().mean().item()
        history.append({"epoch": epoch, "train_loss": round(train_loss, 4), "test_accuracy": round(accuracy, 4),
                        "test_samples": len(true)})
        ctx.print(f"epoch {epoch}: train loss {train_loss:.4f} (mean over {ctx.world_size} ranks), "
                  f"test accuracy {accuracy:.3f} on {len(true)} samples, {acc.steps} optimizer steps so far")
        if writer is not None:
            writer.add_scalar("loss/train", train_loss, epoch)   # a no-op on ranks other than 0
            writer.add_scalar("accuracy/test", accuracy, epoch)
    if writer is not None:
        writer.close()
    # One report: under torchrun/srun/mpirun every process returns its own, the other ranks' is None.
    return {"history": history, "optimizer_steps": acc.steps} if ctx.is_main else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="samples per micro-batch per rank")
    p.add_argument("--every", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--precision", default="bf16", choices=["32", "bf16", "16"])
    p.add_argument("--log-dir", default=os.path.join("runs", "train_loop"))
    args = p.parse_args()
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if not tensorboard:
        print("tensorboard is not installed (pip install 'distfn[tensorboard]'): training without ctx.writer",
              file=sys.stderr)
    cfg = {"epochs": args.epochs, "batch_size": args.batch_size, "every": args.every, "lr": args.lr,
           "log_dir": args.log_dir, "tensorboard": tensorboard}
    # With no GPU, run 2 CPU workers so the example is distributed on a laptop too (DISTFN_NPROCS overrides).
    job = distributed(mode="ddp", seed=0, precision=args.precision,
                      nprocs=None if torch.cuda.device_count() else 2)(train)
    result = job(cfg)
    if result is None:  # another rank under an external launcher: rank 0 prints the result
        return
    last = result["history"][-1]
    print(f"done: {result['optimizer_steps']} optimizer steps, final train loss {last['train_loss']}, "
          f"test accuracy {last['test_accuracy']} on {last['test_samples']} samples")
    print(result)


if __name__ == "__main__":
    main()
