"""Checkpoint path spellings on 2 fsdp CPU ranks, for tests/test_checkpoint_paths.py (issues 24.3 and 31.2, 31.4).

``python ckpt_paths_job.py OUT`` runs in OUT with ``HOME=OUT/home``; every rank writes what it saw to
``OUT/result-RANK.json`` (each check records its outcome or the error message, so one failure does not hide the
others).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import distfn
from distfn import distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _try(result: dict, key: str, fn) -> None:
    try:
        result[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to read
        result[key] = f"{type(exc).__name__}: {exc}"


@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 10})
def job(out: Path, ctx):
    model = ctx.wrap(_net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt, "step": 7}
    result: dict = {}
    _try(result, "tilde_save", lambda: str(ctx.save(state, "~/ck/ckpt-1")))  # a sharded directory
    fresh = ctx.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    into = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters(), lr=1e-2), "step": 0}
    _try(result, "tilde_ctx_load", lambda: ctx.load("~/ck/ckpt-1", into=into)["step"])
    _try(result, "tilde_load_shapes", lambda: {k: list(v.shape) for k, v in distfn.load("~/ck/ckpt-1").items()
                                               if k.startswith("model.")})
    _try(result, "one_file", lambda: str(ctx.save({"model": model}, "rel/one.safetensors")))
    _try(result, "slash_dir", lambda: str(ctx.save(state, "out/")))  # fsdp, no suffix: a sharded directory
    _try(result, "per_rank_sharded", lambda: str(ctx.save(state, f"per/t-rank{ctx.rank}")))
    _try(result, "per_rank_rng", lambda: str(ctx.save(state, f"per/r-rank{ctx.rank}.safetensors", rng=True)))
    _try(result, "per_rank_file", lambda: str(ctx.save({"model": model}, f"per/f-rank{ctx.rank}.safetensors")))
    ctx.barrier()
    (out / f"result-{ctx.rank}.json").write_text(json.dumps(result))
    return "done"


if __name__ == "__main__":
    out = Path(sys.argv[1])
    os.chdir(out)
    print(job(out))
