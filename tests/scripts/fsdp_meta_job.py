"""A model built on the meta device in mode="fsdp" (tests/test_fsdp.py): ``python fsdp_meta_job.py OUT`` runs on 2
CPU ranks and writes OUT/meta.json: the initialised full state, and whether a meta-built and a CPU-built model
trained from the same checkpoint end with identical weights."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from distfn import distributed


class MetaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 4)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.norm(self.a(self.emb(i)))))


def _train_and_save(ctx, model: nn.Module, start: str, out: str) -> None:
    ctx.load(start, into=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model((torch.arange(8) + step + ctx.rank) % 10).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ctx.save(model, out)


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 100})
def _meta_job(cfg, ctx):
    from safetensors.torch import load_file

    ctx.save(MetaNet(), f"{cfg}/start.safetensors")  # a bare CPU-built model: rank 0 writes it
    ctx.barrier()
    with torch.device("meta"):
        meta = MetaNet()
    meta = ctx.wrap(meta)
    local = {n: p.to_local().clone() for n, p in meta.named_parameters()}
    ctx.save(meta, f"{cfg}/initialised.safetensors")
    _train_and_save(ctx, meta, f"{cfg}/start.safetensors", f"{cfg}/meta.safetensors")
    _train_and_save(ctx, ctx.wrap(MetaNet()), f"{cfg}/start.safetensors", f"{cfg}/cpu.safetensors")
    ctx.barrier()
    if not ctx.is_main:
        return None
    init = load_file(f"{cfg}/initialised.safetensors")
    meta_w, cpu_w = load_file(f"{cfg}/meta.safetensors"), load_file(f"{cfg}/cpu.safetensors")
    return {
        "names": sorted(MetaNet().state_dict()),
        "init": {k: v.tolist() for k, v in init.items()},
        "local_a": local["a.weight"].tolist(),
        "trained_equal": sorted(meta_w) == sorted(cpu_w) and all(torch.equal(meta_w[k], cpu_w[k]) for k in meta_w),
        "trained": not torch.equal(meta_w["a.weight"], load_file(f"{cfg}/start.safetensors")["a.weight"]),
    }




if __name__ == "__main__":
    result = _meta_job(sys.argv[1])
    with open(f"{sys.argv[1]}/meta.json", "w") as f:
        json.dump(result, f)
