"""``ctx.wrap(model, compile=True)`` on 2 CPU ranks (tests/test_mesh.py, bench/bench_mesh.py): ``python
mesh_compile_job.py OUT`` trains the same model compiled and eager, writes OUT/result.json with both losses, the
checkpoint's keys and the first compiled step's seconds (the compile; a second run of this script reuses torch's
compile cache where torch allows it)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from distfn import distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(16, 4))


@distributed(mode="fsdp", nprocs=2, seed=0, backend="gloo", fsdp={"module_classes": [Block]})
def job(cfg: dict, ctx):
    model = ctx.wrap(net(), compile=cfg["compile"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], 0.0
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
        start = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        if step == 0:
            first = time.perf_counter() - start
        opt.step()
        opt.zero_grad()
        losses.append(ctx.all_reduce(loss.detach()).item())
    ctx.save({"model": model}, f"{cfg['out']}/ckpt-{int(cfg['compile'])}")
    return {"losses": losses, "keys": sorted(model.state_dict()), "first_step_s": first}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result = {"compiled": job({"compile": True, "out": str(out)}), "eager": job({"compile": False, "out": str(out)})}
    (out / "result.json").write_text(json.dumps(result))
