"""Collectives of what a loop logs, vs world size: µs per call of ``ctx.all_reduce`` and ``ctx.gather_for_metrics``
(and ``ctx.gather_object``) beside the raw ``torch.distributed`` calls that do the same job, at 2 and 4 ranks.

One distfn job per world size (gloo, CPU, loopback; a small DDP-wrapped model, so the step timings that count a
collective's wait are on, as in a training loop) runs every variant once per round, in a rotated order. A sample is
rank 0's time for ``--calls`` back-to-back calls divided by ``--calls``, after a raw barrier that lines the ranks up.
The floors run in the same job and rounds:

* ``all_reduce`` of a float: the raw round trip a Python number needs (``torch.tensor`` → ``dist.all_reduce`` →
  ``.item()`` / world size), with the raw ``dist.all_reduce`` of a ready 1-element tensor (the communication alone)
  beside it. Target: ``ctx.all_reduce(float)`` ≤ 1.1× the raw round trip.
* ``all_reduce`` of a dict of 4 floats (loss, accuracy, learning rate, gradient norm): the raw floor puts them in
  one tensor, one ``dist.all_reduce``, back to a dict. Target ≤ 1.1×; the per-key loop (4 collectives, what the
  dict form replaces) is shown beside it.
* ``gather_for_metrics`` of 32 rows: the hand-written gather of rows whose count may differ per rank (an
  ``all_gather_object`` of the row count, one ``all_gather`` of rows padded to the longest, trimmed, concatenated),
  with ``dist.all_gather`` of equal sizes (the communication alone) and ``dist.all_gather_object`` of the rows (the
  naive way) beside it. Target: ``ctx.gather_for_metrics(rows)`` ≤ 1.1× the hand-written gather. The row with a
  loader also puts the rows in the sampler's order and drops its padding (one more sort), shown without a target.
* ``gather_object`` of a float vs ``dist.all_gather_object``. Target ≤ 1.1×.

Every variant's result is checked against the expected value after the rounds (``correct`` in the JSON). Each row
also carries ``cpu_median``, the calling thread's CPU time per call (a note lists it for each target): unlike the
wall time it is not inflated by waiting for the other ranks, so on a loaded machine it still shows what distfn
adds per call.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLDS = (2, 4)
ROWS = 32
KEYS = ("loss", "accuracy", "lr", "grad_norm")

# table -> (title, baseline, [(variant, note)], the variant with a target)
AR_FLOAT = "raw: float → tensor → all_reduce → float"
AR_TENSOR = "raw dist.all_reduce, 1-element tensor"
CTX_FLOAT = "ctx.all_reduce(float)"
AR_DICT = "raw: dict → one tensor → all_reduce → dict"
CTX_DICT = "ctx.all_reduce(dict)"
CTX_PER_KEY = "ctx.all_reduce per key (4 calls)"
GATHER_FLOOR = "raw: all_gather_object(row count) + all_gather(padded rows)"
GATHER_EQUAL = "raw dist.all_gather, equal sizes"
GATHER_OBJECT_ROWS = "raw dist.all_gather_object(rows)"
CTX_GFM = "ctx.gather_for_metrics(rows)"
CTX_GFM_LOADER = "ctx.gather_for_metrics(rows, loader)"
AGO_FLOAT = "dist.all_gather_object(float)"
CTX_GO_FLOAT = "ctx.gather_object(float)"

TABLES: tuple[tuple[str, str, tuple[tuple[str, str], ...], str], ...] = (
    ("ctx.all_reduce of a float", AR_FLOAT,
     ((AR_FLOAT, "the floor: what a Python number needs"), (AR_TENSOR, "the communication alone"), (CTX_FLOAT, "")),
     CTX_FLOAT),
    (f"ctx.all_reduce of a dict of {len(KEYS)} floats", AR_DICT,
     ((AR_DICT, "the floor: one collective"), (CTX_DICT, "one collective"),
      (CTX_PER_KEY, "what the dict form replaces")), CTX_DICT),
    (f"ctx.gather_for_metrics of {ROWS} rows", GATHER_FLOOR,
     ((GATHER_FLOOR, "the floor: row counts may differ per rank"), (GATHER_EQUAL, "the communication alone"),
      (GATHER_OBJECT_ROWS, "the naive way"), (CTX_GFM, ""),
      (CTX_GFM_LOADER, "also the sampler's order, padding dropped")), CTX_GFM),
    ("ctx.gather_object of a float", AGO_FLOAT, ((AGO_FLOAT, "the floor"), (CTX_GO_FLOAT, "")), CTX_GO_FLOAT),
)


def _variants(ctx: Any) -> dict[str, tuple[Callable[[], Any], Any]]:
    """Every variant as ``(one call, the result its call must return)``."""
    import torch
    import torch.distributed as dist

    from distfn import data

    world, rank = ctx.world_size, ctx.rank
    value = float(rank + 1)
    mean = (world + 1) / 2
    metrics = {k: value * (i + 1) for i, k in enumerate(KEYS)}
    mean_metrics = {k: mean * (i + 1) for i, k in enumerate(KEYS)}
    ready = torch.zeros(1)
    rows = torch.arange(ROWS, dtype=torch.float32) + rank * ROWS
    every_row = torch.arange(ROWS * world, dtype=torch.float32)
    # a loader of its own (no run tracker), so that ctx.gather_for_metrics(rows) without a loader stays that
    loader = data.dataloader(torch.utils.data.TensorDataset(torch.arange(ROWS * world * 4)), ROWS, ctx.sampler,
                             rank=rank, seed=ctx.seed, device=ctx.device, shuffle=False)
    (batch,) = next(iter(loader))  # sampler order: global row i is rank i % world's row i // world
    in_order = torch.arange(ROWS * world)

    def ar_float() -> float:
        t = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / world

    def ar_tensor() -> float:
        dist.all_reduce(ready)
        return float(ready.item() == 0.0)

    def ar_dict() -> dict[str, float]:
        t = torch.tensor(list(metrics.values()), dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(metrics, (v / world for v in t.tolist()), strict=True))

    def gather_floor() -> torch.Tensor:
        sizes: list[Any] = [None] * world
        dist.all_gather_object(sizes, rows.shape[0])
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=rows.dtype)
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    def gather_equal() -> torch.Tensor:
        parts = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(parts, rows)
        return torch.cat(parts)

    def gather_object_rows() -> torch.Tensor:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, rows)
        return torch.cat(parts)

    def ago_float() -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value)
        return out

    floats = [float(r + 1) for r in range(world)]
    return {
        AR_FLOAT: (ar_float, mean),
        AR_TENSOR: (ar_tensor, 1.0),
        CTX_FLOAT: (lambda: ctx.all_reduce(value), mean),
        AR_DICT: (ar_dict, mean_metrics),
        CTX_DICT: (lambda: ctx.all_reduce(metrics), mean_metrics),
        CTX_PER_KEY: (lambda: {k: ctx.all_reduce(v) for k, v in metrics.items()}, mean_metrics),
        GATHER_FLOOR: (gather_floor, every_row),
        GATHER_EQUAL: (gather_equal, every_row),
        GATHER_OBJECT_ROWS: (gather_object_rows, every_row),
        CTX_GFM: (lambda: ctx.gather_for_metrics(rows), every_row),
        CTX_GFM_LOADER: (lambda: ctx.gather_for_metrics(batch, loader), in_order),
        AGO_FLOAT: (ago_float, floats),
        CTX_GO_FLOAT: (lambda: ctx.gather_object(value), floats),
    }


def _same(got: Any, want: Any) -> bool:
    import torch

    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got.to(want.dtype), want)
    return bool(got == want)


def collectives_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """``cfg["rounds"]`` interleaved rounds of every variant; rank 0's µs per call, and whether each was right."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(8, 8))  # the step timings are on (they count a ctx collective's wait)
    model(torch.randn(4, 8)).sum().backward()
    variants = _variants(ctx)
    calls, last = cfg["calls"], {}
    cpu: dict[str, list[float]] = {name: [] for name in variants}

    def timed(name: str) -> Callable[[], float]:
        call = variants[name][0]

        def sample() -> float:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                result = call()
            elapsed, cpu_time = time.perf_counter() - start, time.thread_time() - cpu_start
            last[name] = result
            cpu[name].append(cpu_time / calls * 1e6)
            return elapsed / calls * 1e6

        return sample

    for call, _ in variants.values():  # warm-up: first-call costs (pickler, allocator) out of the rounds
        call()
    samples = c.interleave({name: timed(name) for name in variants}, cfg["rounds"],
                           c.log if ctx.is_main and cfg["verbose"] else None)
    correct = {name: name in last and _same(last[name], want) for name, (_, want) in variants.items()}
    return {"samples": samples, "cpu": cpu, "correct": ctx.gather_object(correct)}


def tables_for(world: int, samples: dict[str, list[float]], cpu: dict[str, list[float]],
               calls: int) -> list[dict[str, Any]]:
    """The result tables of one world size (one per question, its floor the baseline). Each row also gets
    ``cpu_median``: the calling thread's CPU time per call, which waiting for the other ranks does not inflate
    (on a loaded machine the wall time's noise hides a few µs of overhead; this shows them)."""
    out = []
    for title, baseline, rows, target in TABLES:
        tab = c.table(f"{title}: {world} ranks (gloo, CPU), µs per call ({calls} calls per sample)", "µs",
                      {name: samples[name] for name, _ in rows}, baseline=baseline,
                      targets=[{"variant": target, "max_ratio": 1.1}], notes=dict(rows))
        for row in tab["rows"]:
            row["cpu_median"] = statistics.median(cpu[row["variant"]]) if cpu[row["variant"]] else None
        tab["world_size"] = world
        out.append(tab)
    return out


def cpu_note(world: int, tables: list[dict[str, Any]]) -> str:
    """One line: the calling thread's CPU µs per call of each target's variant beside its floor's."""
    parts = []
    for tab in tables:
        rows = {r["variant"]: r["cpu_median"] for r in tab["rows"]}
        target = tab["targets"][0]["variant"]
        if rows[target] is not None and rows[tab["baseline"]] is not None:
            parts.append(f"{target} {rows[target]:.1f} vs {rows[tab['baseline']]:.1f}")
    return f"{world} ranks, the calling thread's CPU µs per call (median), distfn vs its floor: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=11)
    p.add_argument("--calls", type=int, default=100, help="calls per variant per round (one sample)")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes, one launch each")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.calls = 1, 5
    from distfn import distributed

    tables, correct, curve, cpu_notes = [], True, {}, []
    for world in (int(w) for w in args.worlds.split(",")):
        c.log(f"collectives: {world} ranks, {args.rounds} round(s) of {args.calls} calls per variant")
        cfg = {"rounds": args.rounds, "calls": args.calls, "verbose": True}
        out = distributed(nprocs=world, seed=0, backend="gloo")(collectives_job)(cfg)
        wrong = sorted({name for rank in out["correct"] for name, ok in rank.items() if not ok})
        if wrong:
            c.log(f"  wrong results at {world} ranks: {', '.join(wrong)}")
        correct = correct and not wrong
        tables += tables_for(world, out["samples"], out["cpu"], args.calls)
        cpu_notes.append(cpu_note(world, tables[-len(TABLES):]))
        curve[world] = {t["title"].split(":")[0]: t["targets"][0]["ratio"] for t in tables[-len(TABLES):]}
    notes = ["ratio to the floor vs world size: " + "; ".join(
        f"{q}: " + ", ".join(f"{w} ranks {r[q]:.3f}×" if r[q] is not None else f"{w} ranks -" for w, r in curve.items())
        for q in next(iter(curve.values())))] if curve else []
    notes += cpu_notes
    c.emit({"benchmark": "collectives", "tables": tables, "correct": correct, "notes": notes}, args.json)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
