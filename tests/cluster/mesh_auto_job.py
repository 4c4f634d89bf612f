"""``mesh="auto"`` under a real multi-node launcher (tests/cluster/test_cluster.py): replicate across the job's
nodes, shard within one. Each rank trains the same model a few FSDP steps and writes ``rank<R>.json`` into
``DISTFN_TEST_OUT``: what its mesh says (names, shape, its coordinate), its node and its loss."""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import torch
from torch import nn

from distfn import distributed

OUT = Path(os.environ["DISTFN_TEST_OUT"])


@distributed(mode="fsdp", mesh="auto", seed=0)
def train(cfg: dict, ctx) -> None:
    device_mesh = ctx.mesh  # torch's DeviceMesh
    bare = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    reference = copy.deepcopy(bare)  # the same model trained in this process alone on the global batch
    model = ctx.wrap(bare)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(ctx.dp_size)]  # one batch per data-parallel rank
    losses = []
    for _ in range(3):
        batches = [torch.randn(4, 8, generator=g) for g in gens]
        x = batches[ctx.dp_rank]
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(ctx.all_reduce(loss.detach(), op="mean").item())
        whole = torch.cat(batches)
        ref_loss = (reference(whole) - whole.sum(1, keepdim=True)).pow(2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    weight = model[0].weight
    gap = (weight.full_tensor() - reference[0].weight.detach()).abs().max().item()
    record = {"rank": ctx.rank, "node_rank": ctx.node_rank, "host": os.environ.get("SLURMD_NODENAME",
              socket.gethostname()), "names": list(device_mesh.mesh_dim_names), "shape": list(device_mesh.shape),
              "coordinate": device_mesh.get_coordinate(), "dp_rank": ctx.dp_rank, "dp_size": ctx.dp_size,
              "placements": [str(p) for p in weight.placements], "losses": losses,
              "full": weight.full_tensor().flatten().tolist(), "gap_to_one_process": gap}
    (OUT / f"rank{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    train({})
