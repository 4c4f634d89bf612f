"""Resume after an interruption: checkpoint every epoch, pick up from the newest one on the next run.

    python examples/resume.py --dir runs/resume --crash-at 3     # rank 1 crashes in epoch 3 ...
    python examples/resume.py --dir runs/resume                  # ... the rerun resumes at epoch 3

The first run trains epochs 0-2 (one checkpoint each), then rank 1 crashes in epoch 3 on purpose: distfn stops
the other rank and raises a WorkerError naming rank 1. The second run finds the newest checkpoint (epoch 2),
resumes at epoch 3 and trains to epoch 5. Without ``--crash-at`` a run trains all 6 epochs; run again, it
finds them done.

The state saved each epoch is the whole training state (model, Adam moments, LR scheduler, epoch) in one
safetensors file, written atomically by rank 0: a crash or ``kill -9`` at any moment leaves either the old or
the new checkpoint, never a torn one. A resumed run ends with bit-identical weights to an uninterrupted one:
the data order comes from ``loader.set_epoch(epoch)``, everything else from the checkpoint.

Under SLURM, ``#SBATCH --signal=B:TERM@120`` with ``exec python examples/resume.py`` in the batch script (or
``--signal=TERM@120`` when the ranks are ``srun`` tasks; ``scancel --signal=TERM`` by hand) makes
``ctx.should_stop`` true on every rank: the loop saves at the end of the epoch and exits cleanly, and the requeued
job resumes. ``B:`` is what sends the signal to a script run directly in the batch shell (docs/failures.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distfn
from distfn import distributed


def make_dataset(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :10].sum(dim=1) > x[:, 10:].sum(dim=1)).long()  # a learnable two-class rule
    return TensorDataset(x, y)


# 2 CPU workers without GPUs. device_count() asks NVML, which keeps this process safe to fork; is_available()
# would initialise the CUDA driver here, and forked workers could not use CUDA (docs: troubleshooting).
@distributed(mode="ddp", seed=0, nprocs=None if torch.cuda.device_count() else 2)
def train(cfg: dict, ctx: distfn.Context) -> dict | None:
    model = ctx.wrap(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = ctx.dataloader(make_dataset(), batch_size=32)  # per-rank batch; reshuffles every epoch
    state = {"model": model, "optimizer": opt, "scheduler": sched}  # what a checkpoint restores in place

    start, loss_mean = 0, float("nan")
    last = distfn.latest(cfg["dir"])  # newest complete ckpt-<epoch>.safetensors, or None
    if last is not None:
        extra = ctx.load(last, into=state)  # every rank: model, optimizer and scheduler back, on ctx.device
        start = extra["epoch"] + 1  # non-tensor values come back as saved
        loss_mean = extra["loss"]  # what a run with nothing left to train reports
        ctx.print(f"resumed from {last} (epoch {extra['epoch']} was done, loss {extra['loss']:.4f})")

    for epoch in range(start, cfg["epochs"]):
        loader.set_epoch(epoch)  # the same shuffle as an uninterrupted run would see
        total, batches = torch.zeros((), device=ctx.device), 0
        for i, (x, y) in enumerate(loader):
            if epoch == cfg["crash_at"] and ctx.rank == 1 and i == 3:
                raise RuntimeError(f"simulated crash in epoch {epoch}: run the same command again to resume")
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, batches = total + loss.detach(), batches + 1
        sched.step()
        loss_mean = ctx.all_reduce(total / batches).item()  # mean over ranks
        path = ctx.save({**state, "epoch": epoch, "loss": loss_mean},
                        Path(cfg["dir"]) / f"ckpt-{epoch}.safetensors", keep=2)  # rank 0 writes; 2 newest kept
        ctx.barrier()  # the checkpoint is complete before any rank moves on (or crashes, in this demo)
        ctx.print(f"epoch {epoch}: mean loss {loss_mean:.4f}, checkpoint {path}")
        if ctx.should_stop:  # SIGTERM/SIGUSR2 on any rank (preemption, time limit): true on all ranks at once
            ctx.print("stop requested: the checkpoint above is complete; run again to resume")
            break
    result = {"epochs_run": cfg["epochs"] - start, "loss": loss_mean, "checkpoint": str(distfn.latest(cfg["dir"]))}
    return result if ctx.is_main else None  # one report: under torchrun/srun/mpirun every process returns its own


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/resume", help="checkpoint directory")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--crash-at", type=int, default=-1, help="make rank 1 crash in this epoch (a demo)")
    args = p.parse_args()
    result = train({"dir": args.dir, "epochs": args.epochs, "crash_at": args.crash_at})
    if result is not None:  # None on the other ranks under an external launcher
        print(result)
