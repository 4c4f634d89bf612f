"""A decorated training script that tests/test_ray.py runs with ``DISTFN_LAUNCHER=ray`` (no Ray in the code).

Each rank writes ``rank<R>.json`` (what distfn told it, its initial and final weights, its pid and Ray node) into
the directory named at the driver by ``DISTFN_TEST_OUT``; every real checkpoint write appends one line to
``writes.log`` there; each rank also writes ``relative-rank<R>.txt`` by a relative path (it must land in the
driver's working directory, issue 25 item 16). ``DISTFN_TEST_FAIL_RANK`` makes that rank raise;
``DISTFN_TEST_HANG=1`` makes every rank wait (after writing ``started<R>``) until it is killed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn

import distfn.checkpoint
from distfn import distributed

# Read here, in the driver: the function travels by value (it is defined in __main__) and takes these with it;
# the actors' own environment is their raylet's.
OUT = Path(os.environ["DISTFN_TEST_OUT"])
FAIL_RANK = int(os.environ.get("DISTFN_TEST_FAIL_RANK", "-1"))
HANG = os.environ.get("DISTFN_TEST_HANG") == "1"


def flat(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().cpu().flatten()]


def record_writes(rank: int) -> None:
    """Log every checkpoint really written by this process (rank 0 only, if distfn is right)."""
    real = distfn.checkpoint.save

    def logged(*args, **kwargs):
        with open(OUT / "writes.log", "a") as f:  # O_APPEND: one whole line per write
            f.write(f"{rank} {os.getpid()}\n")
        return real(*args, **kwargs)

    distfn.checkpoint.save = logged


def explode(rank: int) -> None:
    raise ValueError(f"rank {rank} fails on purpose")


@distributed(mode="ddp", seed=1234)
def train(cfg: dict, ctx) -> dict:
    record_writes(ctx.rank)
    if HANG:
        (OUT / f"started{ctx.rank}").write_text(str(os.getpid()))
        while True:
            time.sleep(0.2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    bare = nn.Linear(4, 1)
    initial = flat(bare)
    model = ctx.wrap(bare)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(cfg["steps"]):
        if step == 2 and ctx.rank == FAIL_RANK:
            explode(ctx.rank)
        lo = ctx.rank * 32
        loss = nn.functional.mse_loss(model(x[lo:lo + 32]), y[lo:lo + 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
    ctx.save(model, OUT / "model.safetensors")  # every rank calls it; only rank 0 may write
    Path(f"relative-rank{ctx.rank}.txt").write_text(os.getcwd())  # relative: where the driver runs
    import ray  # the actor's node, to check where the ranks ran

    record = {
        "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
        "launcher": ctx.launcher, "host": socket.gethostname(), "pid": os.getpid(),
        "ray_node": ray.get_runtime_context().get_node_id(), "initial": initial, "final": flat(ctx.unwrap(model)),
        "env_rank": os.environ.get("RANK"),
    }
    (OUT / f"rank{ctx.rank}.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    result = train({"steps": 5})
    (OUT / "result.json").write_text(json.dumps(result))
