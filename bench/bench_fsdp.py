"""mode="fsdp": step time of distfn's FSDP against the same ``fully_shard`` calls written by hand, and DDP; and
the training state each rank holds (weights + gradients + Adam moments) under DDP vs FSDP.

Every variant is a fresh 2-rank ``python`` process per round (gloo, CPU), interleaved, with the same model,
seeded init, per-rank data and thread budget. "hand-written" shards the very same units with ``fully_shard``
inside a ``mode="ddp"`` job (so launch and process group are identical); the difference to distfn's fsdp is what
distfn adds per step: the forward pre-hook that keeps the ``ctx.save`` check-in bookkeeping (two store round
trips per forward). A round's sample is rank 0's median step time after ``--warmup`` steps. Both FSDP variants
must end with identical losses. Target: distfn fsdp ≤ 1.05× hand-written.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2
SEED = 0
VARIANTS = {"hand-written fully_shard": "manual", "distfn fsdp": "fsdp", "distfn ddp": "ddp"}


def make_model(width: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _held_bytes(model: Any, opt: Any) -> int:
    """Bytes of weights, gradients and optimizer state this rank holds (its shards under FSDP)."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in opt.state.values():
        total += sum(local(t).numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def job(cfg: dict[str, Any], ctx: Any) -> None:
    import torch
    import torch.nn.functional as F

    from distfn.fsdp import FsdpOptions, plan_units

    model = make_model(cfg["width"])
    if cfg["kind"] == "manual":
        from torch.distributed.fsdp import fully_shard

        for unit in plan_units(model, FsdpOptions(min_params=cfg["min_params"])):
            fully_shard(unit)
        fully_shard(model)
    else:
        model = ctx.wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    xs = torch.randn(cfg["steps"], cfg["batch"], 256, generator=g)
    ys = torch.randint(0, 10, (cfg["steps"], cfg["batch"]), generator=g)
    times, losses = [], []
    for i in range(cfg["steps"]):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated: they count in the held bytes
        loss = F.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    sync = None
    if cfg["kind"] == "fsdp":  # the bookkeeping alone, per sync point (every rank calls it equally often)
        from distfn import checkin  # fsdp's check-in protocol (distfn.checkin) since the fsdp.py split

        start = time.perf_counter()
        for _ in range(200):
            checkin.note_progress()
        sync = (time.perf_counter() - start) / 200
    held = ctx.gather_object(_held_bytes(model, opt))
    if ctx.is_main:
        Path(cfg["out"]).write_text(json.dumps({"times": times, "losses": losses, "held": held, "sync": sync}))


def _worker(kind: str, cfg: dict[str, Any]) -> None:
    from distfn import distributed

    opts: dict[str, Any] = {"mode": "fsdp", "fsdp": {"min_params": cfg["min_params"]}} if kind == "fsdp" else {
        "mode": "ddp"}
    distributed(nprocs=WORLD, seed=SEED, backend="gloo", **opts)(job)({**cfg, "kind": kind})


def _round(kind: str, cfg: dict[str, Any], records: dict[str, list[dict[str, Any]]], warmup: int) -> float:
    out = Path(tempfile.mkstemp(prefix=f"fsdp-{kind}-", suffix=".json", dir=cfg["tmp"])[1])
    c.timed_run([sys.executable, __file__, "--worker", kind, "--cfg", json.dumps({**cfg, "out": str(out)})],
                env=c.clean_env(), timeout=600)
    record = json.loads(out.read_text())
    records[kind].append(record)
    return statistics.median(record["times"][warmup:])


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--worker", choices=sorted(set(VARIANTS.values())), help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, json.loads(args.cfg))
        return 0
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.width = 1, 6, 2, 64
    with tempfile.TemporaryDirectory(prefix="distfn-bench-fsdp-") as tmp:
        # each width x width layer is its own unit; the first and last layers stay with the root
        cfg = {"steps": args.steps, "batch": args.batch, "width": args.width, "tmp": tmp,
               "min_params": args.width * args.width // 2}
        records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in VARIANTS.values()}
        variants = {name: (lambda kind=kind: _round(kind, cfg, records, args.warmup))
                    for name, kind in VARIANTS.items()}
        c.log(f"fsdp: {', '.join(variants)}; {args.rounds} round(s) of {args.steps} steps")
        samples = c.interleave(variants, args.rounds, c.log)
    step = c.table(f"Step time, {WORLD} ranks (gloo, CPU), MLP 256-{args.width}x3-10, Adam, batch {args.batch}/rank, "
                   f"median of steps {args.warmup + 1}..{args.steps}", "s", samples,
                   baseline="hand-written fully_shard", targets=[{"variant": "distfn fsdp", "max_ratio": 1.05}])
    held = {name: [r["held"][0] / 2**20 for r in records[kind]] for name, kind in VARIANTS.items()}
    memory = c.table("Training state held by rank 0 (weights + gradients + Adam moments)", "MiB", held,
                     baseline="distfn ddp")
    sync = c.table("ctx.save bookkeeping per sync point (forward of a wrapped model or distfn collective): two "
                   "store round trips", "s", {"distfn fsdp": [r["sync"] for r in records["fsdp"]]}, baseline=None)
    manual, ours = records["manual"], records["fsdp"]
    same = bool(manual and ours) and all(r["losses"] == manual[0]["losses"] for r in manual + ours)
    how = ("distfn fsdp and hand-written fully_shard: identical losses in every run" if same
           else "losses of the two FSDP variants differ (or a variant did not finish)")
    c.emit({"benchmark": "fsdp", "tables": [step, memory, sync], "identical_losses": same, "notes": [how]}, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
