"""A model built on the meta device in mode="fsdp" (tests/test_fsdp.py): ``python fsdp_meta_job.py OUT`` runs on 2
CPU ranks and writes OUT/meta.json: the initialised full state, whether it equals a single process's init, whether a
meta-built and a CPU-built model trained from the same checkpoint end with identical weights, and the same checks for
a model whose rank's device is a GPU while its shards are offloaded to the CPU (issue 42, finding 1: faked here by
handing `materialize` a CUDA device with CPU shards, which is what `cpu_offload` on GPUs does)."""

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
    offload = _offloaded_init(ctx)
    _train_and_save(ctx, meta, f"{cfg}/start.safetensors", f"{cfg}/meta.safetensors")
    _train_and_save(ctx, ctx.wrap(MetaNet()), f"{cfg}/start.safetensors", f"{cfg}/cpu.safetensors")
    ctx.barrier()
    if not ctx.is_main:
        return None
    init = load_file(f"{cfg}/initialised.safetensors")
    torch.manual_seed(0)  # a single process, seeded as the job: the start model's draws, then the meta model's
    MetaNet()
    single = MetaNet().state_dict()
    meta_w, cpu_w = load_file(f"{cfg}/meta.safetensors"), load_file(f"{cfg}/cpu.safetensors")
    return {
        "names": sorted(MetaNet().state_dict()),
        "init": {k: v.tolist() for k, v in init.items()},
        "local_a": local["a.weight"].tolist(),
        "init_is_single_process": sorted(single) == sorted(init) and all(torch.equal(single[k], init[k]) for k in init),
        **offload,
        "trained_equal": sorted(meta_w) == sorted(cpu_w) and all(torch.equal(meta_w[k], cpu_w[k]) for k in meta_w),
        "trained": not torch.equal(meta_w["a.weight"], load_file(f"{cfg}/start.safetensors")["a.weight"]),
    }


def _offloaded_init(ctx) -> dict:
    """Materialise a sharded meta Linear as `cpu_offload` on GPUs does: the rank's device is cuda:rank, the shards
    live on the CPU (no buffers, so nothing is moved to the fake GPU). -> whether the ranks' rows differ and the whole
    weight equals a single process's init from the same RNG state."""
    from torch.distributed.fsdp import fully_shard

    from distfn import fsdp

    with torch.device("meta"):
        lin = nn.Linear(32, 64, bias=False)
    fully_shard(lin)
    state = torch.random.get_rng_state()
    fsdp.materialize(lin, torch.device("cuda", ctx.rank), offload=True)
    local = lin.weight.to_local()
    whole = lin.weight.full_tensor()
    torch.random.set_rng_state(state)
    single = nn.Linear(32, 64, bias=False).weight.detach()
    return {
        "offload_local_rows": local.shape[0],
        "offload_local_device": str(local.device),
        "offload_rows_differ": not torch.equal(whole[:32], whole[32:]),
        "offload_is_single_process": torch.equal(whole, single),
    }


if __name__ == "__main__":
    result = _meta_job(sys.argv[1])
    with open(f"{sys.argv[1]}/meta.json", "w") as f:
        json.dump(result, f)
