"""2-D parallelism with distfn: HSDP (replicate x shard) or FSDP x tensor parallel, on one named mesh.

    python examples/mesh.py hsdp         # 4 workers: dp_replicate=2 x dp_shard=2 (HSDP)
    python examples/mesh.py tp           # 4 workers: dp_shard=2 x tp=2 (each MLP split over a tp pair)
    DISTFN_NPROCS=8 python examples/mesh.py tp
    torchrun --nproc_per_node=4 examples/mesh.py hsdp

On GPUs there is one worker per GPU; on a CPU-only machine 4 gloo workers. ``mesh=`` is one argument of
``@distributed``; ``train.options(mesh=...)`` picks it per call, and ``DISTFN_MESH=dp_replicate=2,dp_shard=-1``
overrides it from the environment. Checkpoints are sharded directories (safetensors, no pickle) that load onto any
other mesh: run ``hsdp`` first, then ``tp``, and the ``tp`` run resumes the ``hsdp`` run's weights. The directory is
the second argument (default: ``distfn-mesh-example`` in the temporary directory); delete it to start afresh.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distfn
from distfn import distributed


class Block(nn.Module):
    """A pre-norm MLP block: FSDP's unit; under ``tp`` its two Linear layers are split column- then row-wise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def plan() -> dict:
    """torch's tensor-parallel plan: module paths ('*' is any one name) to styles, applied on ctx.mesh['tp']."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}


MESHES = {"hsdp": {"dp_replicate": 2, "dp_shard": -1}, "tp": {"dp_shard": -1, "tp": 2}}


@distributed(mode="fsdp", nprocs=int(os.environ.get("DISTFN_NPROCS", "4")), seed=0,
             fsdp={"module_classes": [Block]})
def train(cfg: dict, ctx):
    ctx.print(f"mesh {dict(zip(ctx.mesh.mesh_dim_names, ctx.mesh.shape, strict=True))}: {ctx.dp_size} "
              f"data-parallel rank(s) of {ctx.world_size}; checkpoints go to {cfg['dir']}")
    model = ctx.wrap(Model(), parallelize=plan() if "tp" in ctx.mesh.mesh_dim_names else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = ctx.dataloader(data, batch_size=16)  # a tp group's ranks get the same batches
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0}
    start = ctx.resume(state, cfg["dir"])  # any earlier run's newest checkpoint, from whichever mesh
    step, losses = start, []
    while step < start + cfg["steps"]:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(ctx.device)), yb.to(ctx.device))
            ctx.backward(loss)
            ctx.step(opt)
            losses.append(ctx.all_reduce(loss.detach()).item())
            step += 1
            if step == start + cfg["steps"]:
                break
    ctx.save({**state, "step": step}, f"{cfg['dir']}/ckpt-{step}", keep=2)  # sharded: every rank writes its part
    ctx.print(f"steps {start} -> {step}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"mesh": list(ctx.mesh.mesh_dim_names), "start": start, "step": step, "loss": losses[-1],
            "checkpoints": cfg["dir"]}


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "hsdp"
    where = Path(sys.argv[2] if len(sys.argv) > 2 else Path(tempfile.gettempdir()) / "distfn-mesh-example").resolve()
    result = train.options(mesh=MESHES[which])({"dir": str(where), "steps": 20})
    print(result)
    final = distfn.load(f"{where}/ckpt-{result['step']}")  # the whole model in one process, from any mesh
    print(f"one process reads {sum(v.numel() for k, v in final.items() if k.startswith('model.'))} parameters")
