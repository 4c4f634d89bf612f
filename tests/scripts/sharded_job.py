"""Sharded-checkpoint jobs for tests/test_checkpoint_sharded.py (2 and 4 CPU ranks, gloo).

``python sharded_job.py OUT reshard``: fsdp runs on 4 and 2 ranks save at step 5 both a sharded directory
(``w{W}/ckpt-5``) and the one-file gather (``w{W}/full-5.safetensors``) and train on to step 10; then 2 fsdp ranks
and 2 ddp ranks load each of them, save what they loaded as one file (``check-*``), and train steps 6..10.
``python sharded_job.py OUT kill RANK``: a 2-rank fsdp run saves ``ckpt-1``, then ``RANK`` is killed (SIGKILL)
during the sharded save of ``ckpt-2``, right after writing its shard. ``python sharded_job.py OUT replan``: the save
plan's memo (`replan_job`). Results go to OUT/result.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from distfn import WorkerError, distributed

STEPS, SAVE_AT, BATCH = 10, 5, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)
    return x[rank::world], y[rank::world]


def train(model, opt, first: int, last: int, rank: int = 0, world: int = 1, reduce=None) -> list[float]:
    losses = []
    for step in range(first, last + 1):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(reduce(loss.detach()) if reduce else loss.detach()))
    return losses


def fresh(ctx, seed: int = 123):
    torch.manual_seed(seed)  # a different init: everything must come from the checkpoint
    model = ctx.wrap(Net())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def save_job(out: Path, ctx):
    model, opt = fresh(ctx, 0)
    reduce = ctx.all_reduce
    losses = train(model, opt, 1, SAVE_AT, ctx.rank, ctx.world_size, reduce)
    state = {"model": model, "optimizer": opt, "step": SAVE_AT}
    d = out / f"w{ctx.world_size}"
    ctx.save(state, d / "ckpt-5")  # no .safetensors suffix in fsdp mode: sharded
    ctx.save(state, d / "full-5.safetensors")  # the one-file gather, for comparison
    local = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    losses += train(model, opt, SAVE_AT + 1, STEPS, ctx.rank, ctx.world_size, reduce)
    return {"losses": losses, "local": local}


def _load_and_continue(out: Path, ctx, tag: str) -> dict:
    results = {}
    for w in (2, 4):
        for src in ("ckpt-5", "full-5.safetensors"):
            model, opt = fresh(ctx)
            state = {"model": model, "optimizer": opt, "step": 0}
            rest = ctx.load(out / f"w{w}" / src, into=state)
            name = f"{tag}-w{w}-{src.split('.')[0]}"
            ctx.save({"model": model, "optimizer": opt}, out / f"check-{name}.safetensors")
            losses = train(model, opt, SAVE_AT + 1, STEPS, ctx.rank, ctx.world_size, ctx.all_reduce)
            ctx.save(model, out / f"final-{name}.safetensors")
            results[name] = {"rest": rest, "step": state["step"], "losses": losses}
    return results


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def fsdp_load_job(out: Path, ctx):
    return _load_and_continue(out, ctx, "fsdp2")


@distributed(mode="ddp", nprocs=2, seed=0)
def ddp_load_job(out: Path, ctx):
    return _load_and_continue(out, ctx, "ddp2")


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def kill_job(cfg: tuple[Path, int], ctx):
    from distfn.checkpoint import storage

    out, victim = cfg
    model, opt = fresh(ctx, 0)
    train(model, opt, 1, 2, ctx.rank, ctx.world_size)
    ctx.save({"model": model, "optimizer": opt, "step": 2}, out / "ckpt-1")
    if ctx.rank == victim:
        write = storage.write

        def write_then_die(plan, target):
            write(plan, target)  # this rank's shard is on disk, the index is not
            os.kill(os.getpid(), signal.SIGKILL)

        storage.write = write_then_die
    train(model, opt, 3, 4, ctx.rank, ctx.world_size)
    ctx.save({"model": model, "optimizer": opt, "step": 4}, out / "ckpt-2")
    return "not killed"


def _async(out: Path, ctx) -> dict:
    model, opt = fresh(ctx, 0)
    train(model, opt, 1, 3, ctx.rank, ctx.world_size)
    state = {"model": model, "optimizer": opt, "step": 3}
    d = out / ctx.mode
    ctx.save(state, d / "ref-3.safetensors")  # blocking, one file: the reference
    ctx.save(state, d / "async-3.safetensors", blocking=False)
    train(model, opt, 4, 4, ctx.rank, ctx.world_size)  # changes the live tensors while the write may still run
    ctx.save({**state, "step": 4}, d / "ref-4.safetensors")  # waits for the previous save first
    ctx.save({**state, "step": 4}, d / "ckpt-4", sharded=True, blocking=False)
    train(model, opt, 5, 5, ctx.rank, ctx.world_size)
    ctx.save({**state, "step": 5}, d / "ref-5.safetensors")
    ctx.save({**state, "step": 5}, d / "ckpt-5", sharded=True, blocking=False)
    # the host copies of ckpt-5 went into ckpt-4's buffers: nothing new was allocated
    return {"returned": True, "allocated": ctx.saves.buffers.allocated}


@distributed(mode="ddp", nprocs=2, seed=0)
def ddp_async_job(out: Path, ctx):
    return _async(out, ctx)


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def fsdp_async_job(out: Path, ctx):
    return _async(out, ctx)


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def async_kill_job(out: Path, ctx):
    import threading

    from distfn.checkpoint import storage

    model, opt = fresh(ctx, 0)
    train(model, opt, 1, 2, ctx.rank, ctx.world_size)
    ctx.save({"model": model, "optimizer": opt, "step": 2}, out / "ckpt-1", blocking=False)
    ctx.saves.wait()  # ckpt-1 is complete before the writer is booby-trapped
    if ctx.rank == 0:
        write = storage.write

        def write_then_die(plan, target, **how):
            assert threading.current_thread() is not threading.main_thread()
            write(plan, target, **how)  # in the background thread, with this rank's shard on disk
            os.kill(os.getpid(), signal.SIGKILL)

        storage.write = write_then_die
    ctx.save({"model": model, "optimizer": opt, "step": 2}, out / "ckpt-2", blocking=False)
    train(model, opt, 3, 40, ctx.rank, ctx.world_size)
    return "not killed"


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def replan_job(out: Path, ctx):
    """The save plan's memo (the shard offsets by layout): a warm save writes the same bytes as a fresh one, and a
    state whose shapes changed under the same names is planned again."""
    from distfn.checkpoint.sharded import write

    model, opt = fresh(ctx, 0)
    train(model, opt, 1, 2, ctx.rank, ctx.world_size)
    state = {"model": model, "optimizer": opt, "step": 2}
    write._OFFSETS.clear()
    ctx.save(state, out / "fresh" / "ckpt-2")  # planned from nothing
    memo = len(write._OFFSETS)
    ctx.save(state, out / "warm" / "ckpt-2", blocking=False)  # planned from the memo
    ctx.saves.wait()
    sizes = {}
    for width in (64, 96):  # the same names, other shapes: every rank's offsets change
        torch.manual_seed(width)
        other = ctx.wrap(nn.Sequential(nn.Linear(16, width), nn.Linear(width, 4)))
        ctx.save({"model": other}, out / f"w{width}" / "ckpt-1", blocking=False)
        ctx.save({"model": other}, out / f"w{width}" / "ref.safetensors")
        sizes[width] = len(write._OFFSETS)
    return {"memo": memo, "sizes": sizes}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if sys.argv[2] == "reshard":
        result: dict = {"save": {}}
        for w in (4, 2):
            result["save"][w] = save_job.options(nprocs=w)(out)
        result["fsdp2"] = fsdp_load_job(out)
        result["ddp2"] = ddp_load_job(out)
    elif sys.argv[2] == "async":
        result = {"ddp": ddp_async_job(out), "fsdp": fsdp_async_job(out)}
        result["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    elif sys.argv[2] == "replan":
        result = replan_job(out)
    elif sys.argv[2] == "async-kill":
        try:
            result = {"returned": async_kill_job(out)}
        except WorkerError as exc:
            result = {"error": str(exc)[:2000]}
    else:
        try:
            result = {"returned": kill_job((out, int(sys.argv[3])))}
        except WorkerError as exc:
            result = {"error": str(exc)[:2000]}
    (out / "result.json").write_text(json.dumps(result))
