"""FSDP jobs for tests/test_fsdp.py: ``python fsdp_job.py OUT`` runs every case on 2 CPU ranks, writes OUT/result.json.

Cases, in order: a DDP reference run (writes a step-5 checkpoint), an FSDP run (sharding, loss parity, full-file
save, resume from its own and from the DDP checkpoint), and jobs that wrongly call ctx.save / ctx.load on rank 0 only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import distfn
from distfn import WorkerError, distributed

STEPS, SAVE_AT, BATCH = 10, 5, 16


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.Sequential(Block(64), Block(64))
        self.out = nn.Linear(64, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(torch.relu(self.inp(x)))) * self.scale


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)
    return x[rank::world], y[rank::world]


def run_steps(ctx, model, opt, first: int, last: int, save_to: Path | None = None) -> list[float]:
    losses = []
    for step in range(first, last + 1):
        x, y = batch(step, ctx.rank, ctx.world_size)
        loss = nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(ctx.all_reduce(loss.detach()).item())
        if save_to is not None and step == SAVE_AT:
            ctx.save({"model": model, "optimizer": opt, "step": step}, save_to)
    return losses


def fresh(ctx, seed: int = 123):
    torch.manual_seed(seed)  # a different init: everything must come from the checkpoint
    model = ctx.wrap(Net())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@distributed(mode="ddp", nprocs=2, seed=0)
def ddp_job(out: Path, ctx):
    model = ctx.wrap(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {"losses": run_steps(ctx, model, opt, 1, STEPS, out / "ddp-5.safetensors")}


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 1000})
def fsdp_job(out: Path, ctx):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = ctx.wrap(Net())
    shards = {
        "total": sum(p.numel() for p in model.parameters()),
        "local": sum(p.to_local().numel() for p in model.parameters()),
        "dtensors": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "units": sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
    }
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    straight = run_steps(ctx, model, opt, 1, STEPS, out / "fsdp-5.safetensors")
    ctx.save(model, out / "final.safetensors")
    ctx.save({"model": model, "step": STEPS}, out / "rng.safetensors", rng=True)  # check-in, RNG gather, gather
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    bare_equal = None
    if ctx.is_main:
        bare = Net()
        bare.load_state_dict(distfn.load(out / "final.safetensors"))  # strict: same keys, full shapes
        bare_equal = all(torch.equal(bare.state_dict()[k], full[k]) for k in full) and sorted(full) == sorted(
            bare.state_dict())
    resumed = {}
    for name in ("fsdp-5", "ddp-5"):
        model2, opt2 = fresh(ctx)
        rest = ctx.load(out / f"{name}.safetensors", into={"model": model2, "optimizer": opt2})
        resumed[name] = {"rest": rest, "losses": run_steps(ctx, model2, opt2, SAVE_AT + 1, STEPS)}
    return {"shards": ctx.gather_object(shards), "losses": straight, "bare_equal": bare_equal, "resumed": resumed}


# Also the pass-through of mixed precision and CPU offload (a no-op for placement on a CPU-only machine).
@distributed(mode="fsdp", nprocs=2, seed=0,
             fsdp={"module_classes": ["Block"], "mixed_precision": "bf16", "cpu_offload": True})
def rank0_save_then_train(out: Path, ctx):
    model = ctx.wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_steps(ctx, model, opt, 1, 2)
    with torch.no_grad():  # the Block units' forward (a collective: on every rank); the root's ends in fp32 scale
        output = model.blocks(torch.zeros(2, 64)).dtype
    if ctx.is_main:
        (out / "mixed.json").write_text(json.dumps({
            "output": str(output),  # computed in bf16
            "params": sorted({str(p.dtype) for p in model.parameters()}),  # sharded master weights stay fp32
        }))
    if ctx.is_main:  # the DDP habit: wrong in fsdp mode
        ctx.save(model, out / "never.safetensors")
    run_steps(ctx, model, opt, 3, 4)


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"module_classes": [Block]})
def rank0_save_then_barrier(out: Path, ctx):
    model = ctx.wrap(Net())
    if ctx.is_main:  # the pattern DDP mode documents: save on rank 0, then a barrier (rng=True: a gather first)
        ctx.save({"model": model}, out / "never.safetensors", rng=True)
    ctx.barrier()


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"module_classes": [Block], "save_timeout": 1.0})
def rank0_save_then_raw_collective(out: Path, ctx):
    import torch.distributed as dist

    model = ctx.wrap(Net())
    if ctx.is_main:
        ctx.save({"model": model}, out / "never.safetensors")
    dist.barrier()  # not through distfn: leaves no trace, so only save_timeout can end it


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 1000})
def rank0_load_then_train(out: Path, ctx):
    model = ctx.wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if ctx.is_main:  # e.g. "load pretrained weights on the main rank": every rank must receive its shard
        ctx.load(out / "final.safetensors", into=model)
    run_steps(ctx, model, opt, 1, 2)


def expect_failure(job, out: Path) -> dict:
    start = time.monotonic()
    try:
        job(out)
    except WorkerError as exc:
        return {"seconds": time.monotonic() - start, "message": str(exc), "ranks": [f.rank for f in exc.failures]}
    return {"seconds": time.monotonic() - start, "message": None, "ranks": []}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result = {"ddp": ddp_job(out), "fsdp": fsdp_job(out)}
    result["rank0_forward"] = expect_failure(rank0_save_then_train, out)
    result["rank0_barrier"] = expect_failure(rank0_save_then_barrier, out)
    result["rank0_raw"] = expect_failure(rank0_save_then_raw_collective, out)
    result["rank0_load"] = expect_failure(rank0_load_then_train, out)
    (out / "result.json").write_text(json.dumps(result, default=str))
