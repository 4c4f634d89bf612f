"""Mid-epoch exact resume (driven by tests/test_exact_resume.py and bench/bench_resume.py).

python exact_resume_job.py OUT CONFIG_JSON   (the world size comes from DISTFN_NPROCS)

Trains a small model (Adam, optional dropout) for ``epochs`` epochs over a shuffled ``ctx.dataloader`` with the
loader in the saved state (``ctx.save`` after every step, ``ctx.resume`` at the start). Rank 0 appends each step's
global batch (every rank's sample ids) to OUT/log.jsonl. ``kills``: steps at which rank 1 kills itself with
SIGKILL (once each, before that step's save, so the step is trained again after the resume). At the end rank 0
writes OUT/result.json: the final parameters, the world size and the first step this attempt ran.
``ctx_step``: step through ``ctx.backward`` / ``ctx.step`` (the boundary distfn snapshots the generators at);
``rng``: ``"true"`` (``ctx.save(..., rng=True)``, the default) or ``"default"`` (no ``rng=`` argument);
``main_only``: only rank 0 calls ``ctx.save``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from distfn import distributed


class Points(Dataset):
    """Sample i: its id, a fixed input and target (the same in every process and worker)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


@distributed(mode="ddp", seed=3)
def train(cfg, ctx):
    out = Path(cfg["out"])
    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(nn.Linear(4, 16), nn.Dropout(cfg["dropout"]), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = ctx.dataloader(Points(cfg["n"]), cfg["batch"], drop_last=cfg["drop_last"],
                            num_workers=cfg["workers"], global_batch_change=cfg.get("change", "refuse"))
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0}
    began = time.perf_counter()
    step = ctx.resume(state, out / "ckpt")
    first = step
    sharded = cfg.get("sharded", False)
    while loader.next_epoch < cfg["epochs"]:
        for ids, x, y in loader:
            if step == first and ctx.is_main:  # time from the start of the job's body to its first batch
                (out / f"first-batch-{first}.json").write_text(json.dumps(
                    {"body_s": time.perf_counter() - began, "at": time.time()}))
            loss = (model(x) - y).square().mean()
            if cfg.get("ctx_step"):  # the step boundary where distfn snapshots every rank's generators
                ctx.backward(loss)
                ctx.step(opt)
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            step += 1
            everyone = ctx.gather_object(ids.tolist())
            if ctx.is_main:
                with open(out / "log.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "epoch": loader.epoch, "ids": everyone,
                                        "world": ctx.world_size}) + "\n")
            marker = out / f"killed-{step}"
            if step in cfg["kills"] and not marker.exists():
                ctx.barrier()  # rank 0 has logged the step: the kill leaves a complete log line behind
                if ctx.rank == 1:
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)  # rank 0 waits for the launcher to take the job down
            name = f"ckpt-{step}" if sharded else f"ckpt-{step}.safetensors"
            rng = {"true": True, "default": None}[cfg.get("rng", "true")]
            if ctx.is_main or not cfg.get("main_only"):  # the master-only idiom: no collective in ctx.save
                ctx.save({**state, "step": step}, out / "ckpt" / name, keep=2, rng=rng, sharded=sharded,
                         blocking=not cfg.get("async", False))
    if ctx.is_main:
        params = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
        (out / "result.json").write_text(json.dumps({"params": params.tolist(), "first": first,
                                                     "world": ctx.world_size}))


if __name__ == "__main__":
    config = json.loads(sys.argv[2])
    train({**config, "out": sys.argv[1]})
