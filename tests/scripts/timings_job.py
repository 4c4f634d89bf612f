"""A 2-4 rank DDP job for tests/test_timings.py: ``python timings_job.py SCENARIO NPROCS STEPS [OUT]``.

SCENARIO: ``data`` (rank 1's dataset sleeps 50 ms per item), ``compute`` (rank 1 busy-loops 30 ms in forward) or
``none`` (identical ranks, with the user's own DDP comm hook). Prints ``RESULT <json>`` with rank 0's view: the
warnings logged during the loop, the last window's table and ``ctx.timings()`` on every rank. The end-of-run
summary is logged to stderr. With OUT (a directory), the job also tracks ``track=CSV(root=OUT)`` (the loss at
each step) and writes ``ctx.timings(plot=OUT/timings.svg)`` (and ``.png`` when matplotlib is installed) at the end, and
once into a folder (a write that fails on rank 0 only).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import attrs
import torch
from loguru import logger
from torch import nn

from distfn import distributed
from distfn.tracking import CSV

SLOW_RANK = 1


class Items(torch.utils.data.Dataset):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        return torch.full((16,), float(i % 7)), torch.ones(2)


class Net(nn.Module):
    def __init__(self, spin: float) -> None:
        super().__init__()
        self.spin = spin
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.perf_counter() + self.spin
        while time.perf_counter() < end:  # extra compute on this rank
            pass
        return self.body(x)


def job(cfg: dict, ctx) -> dict:
    scenario, steps = cfg["scenario"], cfg["steps"]
    slow = ctx.rank == SLOW_RANK
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m).strip()), level="WARNING", format="{message}")
    model = ctx.wrap(Net(0.03 if slow and scenario == "compute" else 0.0))
    if scenario == "none":  # the timings use no comm hook: the user's own still registers (and is timed)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ctx.dataloader(Items(0.05 if slow and scenario == "data" else 0.0), batch_size=1)
    bar = ctx.progress(loader, desc="train", total=steps)
    out = cfg.get("out")
    for i, (x, y) in enumerate(bar):
        loss = nn.functional.mse_loss(model(x), y)
        ctx.backward(loss)
        ctx.step(opt)
        if out:
            ctx.log_metrics({"loss": loss}, step=100 + i)  # the user's steps: not the timings' own count
        if i + 1 >= steps:
            break
    logger.remove(sink)
    table = ctx.timings(plot=f"{out}/timings.svg" if out else None)
    if out:  # a folder where rank 0 writes: a warning there, and every rank goes on to the gather below
        if ctx.is_main:
            Path(out, "blocked.svg").mkdir(exist_ok=True)
        ctx.timings(plot=f"{out}/blocked.svg")
    if out and importlib.util.find_spec("matplotlib"):
        ctx.timings(plot=f"{out}/timings.png")
    return {"rank": ctx.rank, "warnings": warnings, "table": None if table is None else attrs.asdict(table),
            "text": None if table is None else table.format(),
            "others_none": ctx.gather_object(table is None)}


if __name__ == "__main__":
    scenario, nprocs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else None
    track = {"track": CSV(root=out)} if out else {}
    result = distributed(mode="ddp", nprocs=nprocs, backend="gloo", seed=0, **track)(job)(
        {"scenario": scenario, "steps": steps, "out": out})
    print("RESULT " + json.dumps(result), flush=True)
