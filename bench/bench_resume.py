"""Benchmark the restart of a job killed late in an epoch: time to its first batch, against a fresh start.

What is measured, in one process, each variant from nothing to the first batch in hand (``--rounds`` interleaved
rounds, medians):

* **fresh start**: build the model, the optimizer and a ``ctx.dataloader``-style loader (``num_workers=2``, a
  dataset whose ``__getitem__`` costs ``--item-ms``), draw the first batch;
* **resume (sampler position)**: the same, plus ``checkpoint.load_into`` of a checkpoint saved after batch
  ``--at`` of ``--batches`` (model, Adam, the loader's state): the loader starts at the saved position;
* **resume (replay)**: what a loader without a savable position has to do for the same result: restore the
  model, then draw and discard the ``--at`` batches before the one it wants (the pipeline loads them all).

Target (issue 27): resume (sampler position) <= 1.1x fresh start. The process start, the imports and the rank
start-up are the same for every variant and left out (each variant's clock starts once they are done).

Usage::

    python bench/bench_resume.py                       # 15 rounds, 64 batches of 32, resume at batch 60
    python bench/bench_resume.py --tiny --json /tmp/out.json   # smoke: one round, small sizes
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch
from loguru import logger
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from distfn import checkpoint
from distfn import data as ddata

import _common as c


class Slow(Dataset):
    """``n`` samples, each costing about ``item_s`` of work to load (a decoded image, a tokenised line)."""

    def __init__(self, n: int, item_s: float) -> None:
        self.n, self.item_s = n, item_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = time.perf_counter() + self.item_s
        while time.perf_counter() < end:  # busy: a sleeping worker would cost nothing on a loaded machine
            pass
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.tensor(i)


def _build(n: int, batch: int, item_s: float) -> tuple[nn.Module, torch.optim.Optimizer, ddata.DistributedLoader]:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters())

    def make_sampler(ds: Any, shuffle: bool, drop_last: bool) -> DistributedSampler:
        return DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle, seed=0, drop_last=drop_last)

    loader = ddata.dataloader(Slow(n, item_s), batch, make_sampler, rank=0, seed=0, device=torch.device("cpu"),
                              num_workers=2, multiprocessing_context="fork")
    return model, opt, loader


def main(argv: list[str] | None = None) -> int:
    # 15 rounds: ~1 s each, and a 100 ms start spreads 10-15 % from round to round on 2 cores
    p = c.parser("restart to first batch: resumed at a sampler position vs fresh vs replay", rounds=15)
    p.add_argument("--batches", type=int, default=64, help="batches per epoch")
    p.add_argument("--batch", type=int, default=32, help="samples per batch")
    p.add_argument("--at", type=int, default=60, help="the checkpoint is taken after this many batches")
    p.add_argument("--item-ms", type=float, default=0.5, help="cost of loading one sample, in ms")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.batches, args.at, args.item_ms = 1, 8, 6, 0.2
    logger.remove()  # the loaders' INFO lines would flood stdout
    n, item_s = args.batches * args.batch, args.item_ms / 1000
    expected: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / f"ckpt-{args.at}.safetensors"
        model, opt, loader = _build(n, args.batch, item_s)
        it = iter(loader)
        for _ in range(args.at):
            next(it)
        checkpoint.save({"model": model, "optimizer": opt, "loader": loader, "step": args.at}, path)
        expected = next(it)[1].tolist()
        del it

        def fresh() -> float:
            start = time.perf_counter()
            _, _, loader = _build(n, args.batch, item_s)
            next(iter(loader))
            return time.perf_counter() - start

        def resume() -> float:
            start = time.perf_counter()
            model, opt, loader = _build(n, args.batch, item_s)
            checkpoint.load_into(path, {"model": model, "optimizer": opt, "loader": loader})
            batch = next(iter(loader))
            elapsed = time.perf_counter() - start
            assert batch[1].tolist() == expected, "the resumed loader drew another batch"
            return elapsed

        def replay() -> float:
            start = time.perf_counter()
            model, opt, loader = _build(n, args.batch, item_s)
            checkpoint.load_into(path, {"model": model, "optimizer": opt})
            it = iter(loader)
            for _ in range(args.at):
                next(it)
            batch = next(it)
            elapsed = time.perf_counter() - start
            assert batch[1].tolist() == expected
            return elapsed

        samples = c.interleave({"fresh start": fresh, "resume (sampler position)": resume,
                                "resume (replay)": replay}, args.rounds, progress=c.log)
    tab = c.table(f"restart to the first batch, resumed after batch {args.at} of {args.batches} "
                  f"({args.batch} samples, {args.item_ms:g} ms each, 2 workers)", "s", samples, "fresh start",
                  targets=[{"variant": "resume (sampler position)", "max_ratio": 1.1}],
                  notes={"resume (sampler position)": "checkpoint load + loader position",
                         "resume (replay)": f"loads and drops {args.at} batches"})
    c.emit({"benchmark": "resume", "tables": [tab], "notes": [
        "one process; the process start, imports and rank start-up (equal for every variant) are left out"]},
        args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
