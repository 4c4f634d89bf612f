"""distfn with mode="fsdp": a small transformer-style model sharded with FSDP2, checkpointed and resumed.

    python examples/fsdp.py                      # one worker per GPU, or 2 CPU workers here
    torchrun --nproc_per_node=2 examples/fsdp.py

Each rank holds about 1/world of the parameters, gradients and Adam moments. ``ctx.save`` is called on every
rank (it gathers the full weights to rank 0, which writes one safetensors file), and the file loads into a bare
model for inference with ``distfn.load``. Run it twice: the second run resumes from the checkpoint and trains
40 more steps.

The checkpoints go to the directory given as the first argument, by default ``distfn-fsdp-example`` in the
system's temporary directory (``/tmp`` on Linux); the script prints it first. Delete it to start from scratch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import distfn
from distfn import distributed


class Block(nn.Module):
    """A pre-norm MLP block: the unit FSDP gathers and frees one at a time."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def batch(step: int, rank: int, world: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a deterministic batch: y = sin of a fixed projection of x."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True) / 4)
    return x[rank::world], y[rank::world]


# module_classes: each Block is one FSDP unit (the transformer recipe); mixed_precision / cpu_offload would go here
# too, e.g. fsdp={"module_classes": [Block], "mixed_precision": "bf16"} on GPUs.
@distributed(mode="fsdp", seed=0, nprocs=None if torch.cuda.device_count() else 2,
             fsdp={"module_classes": [Block]})
def train(cfg: dict, ctx) -> dict | None:
    model = ctx.wrap(Model())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    ckpt = Path(cfg["dir"]).resolve()
    ctx.print(f"checkpoints go to {ckpt} (2 kept; delete the directory to start from scratch)")
    start = 0
    last = distfn.latest(ckpt)
    if last is not None:  # resume: every rank gets its shard of the full tensors in the file
        start = ctx.load(last, into={"model": model, "optimizer": opt})["step"]
        ctx.print(f"resumed from {last.name} at step {start}")
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    ctx.print(f"rank 0 holds {local} of {total} parameters ({local / total:.0%})")

    loss = torch.tensor(float("nan"))
    for step in range(start + 1, start + cfg["steps"] + 1):
        x, y = batch(step, ctx.rank, ctx.world_size)
        loss = nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()  # gradients are reduce-scattered: each rank keeps the slice it owns
        opt.step()
        if step % cfg["save_every"] == 0:
            # Every rank calls it (a collective gather); rank 0 writes. Under `if ctx.is_main:` it would be
            # reported as an error, not hang.
            ctx.save({"model": model, "optimizer": opt, "step": step}, ckpt / f"ckpt-{step}.safetensors", keep=2)
    result = {"step": start + cfg["steps"], "loss": ctx.all_reduce(loss.detach()).item(), "checkpoints": str(ckpt)}
    return result if ctx.is_main else None  # one report: under torchrun/srun/mpirun every process returns its own


if __name__ == "__main__":
    directory = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "distfn-fsdp-example")
    result = train({"lr": 3e-3, "steps": 40, "save_every": 20, "dir": directory})
    if result is not None:  # rank 0 (the other ranks get None under an external launcher)
        # Inference without any process group: the full weights load into a bare model.
        bare = Model()
        bare.load_state_dict({k.removeprefix("model."): v for k, v in distfn.load(distfn.latest(directory)).items()
                              if k.startswith("model.")})
        x, y = batch(0, 0, 1)
        print(result, f"bare-model loss {nn.functional.mse_loss(bare(x), y).item():.4f}")
