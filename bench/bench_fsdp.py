"""mode="fsdp": step time of distfn's FSDP against the same ``fully_shard`` calls written by hand, and DDP; and
the training state each rank holds (weights + gradients + Adam moments) under DDP vs FSDP.

Every variant is a fresh 2-rank ``python`` process per round (gloo, CPU), interleaved, with the same model,
seeded init, per-rank data and thread budget. "hand-written" shards the very same units with ``fully_shard``
inside a ``mode="ddp"`` job (so launch and process group are identical); the difference to distfn's fsdp is what
distfn adds per step: the forward pre-hook that keeps the ``ctx.save`` check-in bookkeeping (two store round
trips per forward). A round's sample is rank 0's median step time after ``--warmup`` steps. Both FSDP variants
must end with identical losses. Target: distfn fsdp ≤ 1.05× hand-written.

Peak extra host memory per rank during ``ctx.wrap`` (issue 14): a model of ``--wrap-layers`` square
``nn.Linear(--wrap-width)`` layers (default 16 × 4096: 1 GiB of fp32 parameters) wrapped on each world size in
``--wrap-ranks`` (one ``mode="fsdp"`` launch each, gloo, CPU), three ways, in a rotated order per round:

* ``distfn ctx.wrap, meta-built`` - built under ``with torch.device("meta"):``, then ``ctx.wrap(model)`` (shards
  first, then ``to_empty`` + ``reset_parameters`` of each rank's shards only);
* ``hand-written FSDP2 recipe, meta-built`` - the same model, ``fully_shard`` per layer and the root,
  ``to_empty(device=cpu)``, every ``reset_parameters()`` (the reference);
* ``distfn ctx.wrap, CPU-built`` - built on the CPU (the full model initialised on every rank), then ``ctx.wrap``.

Per rank and sample: ``gc.collect()`` and ``malloc_trim`` (so the baseline holds live memory only), ``5`` into
``/proc/self/clear_refs`` (resets the peak RSS, ``VmHWM``), baseline ``VmRSS``; build + wrap; the extra is
``VmHWM`` - baseline (it includes the shards the wrapped model keeps). A sample is the max over ranks; the model
is deleted before the next variant. Every variant runs once on a tiny model first, unmeasured (imports, lazy
initialisation). Compared with the shard (model bytes / world size). Target: the meta path ≤ shard + 64 MiB
(stated as a ratio to the shard). Sanity: every parameter and buffer of the meta-built model is finite after
``ctx.wrap`` on every rank (the exit status is 1 otherwise).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2
SEED = 0
VARIANTS = {"hand-written fully_shard": "manual", "distfn fsdp": "fsdp", "distfn ddp": "ddp"}
WRAP_VARIANTS = {"distfn ctx.wrap, meta-built": "meta", "hand-written FSDP2 recipe, meta-built": "recipe",
                 "distfn ctx.wrap, CPU-built": "cpu"}
MIB = 2**20


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
        start = time.perf_counter()
        for _ in range(200):
            ctx.run.sync_point()  # the run's check-in protocol (distfn.checkin), as a forward or collective notes it
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


# --------------------------------------------------------------------------------------------------
# Peak host memory of ctx.wrap (Linux: VmHWM reset through /proc/self/clear_refs)


def _wrap_once(ctx: Any, kind: str, width: int, layers: int) -> dict[str, Any]:
    """Build and wrap the model one way; this rank's peak extra bytes, seconds and sanity figures."""
    import itertools

    import torch
    import torch.distributed as dist
    from torch import nn

    dist.barrier()
    base = c.reset_peak_rss()
    start = time.perf_counter()
    with torch.device("cpu" if kind == "cpu" else "meta"):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    if kind == "recipe":  # the FSDP2 recipe for meta-built models, written out
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device=ctx.device)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    else:
        model = ctx.wrap(model)
    seconds = time.perf_counter() - start
    extra = c.peak_extra(base)
    tensors = [t.to_local() if hasattr(t, "to_local") else t
               for t in itertools.chain(model.parameters(), model.buffers())]
    out = {"extra": extra, "seconds": seconds,
           "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "local_bytes": sum(t.numel() * t.element_size() for t in tensors),
           "tensors": len(tensors), "finite": all(bool(torch.isfinite(t).all()) for t in tensors),
           "first": float(tensors[0].detach().double().sum()) if tensors and tensors[0].numel() else 0.0}
    del model, tensors
    dist.barrier()
    return out


def _wrap_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Every rank: each variant once on a tiny model (warm-up), then ``rounds`` rotated rounds at full size."""
    kinds = list(WRAP_VARIANTS.values())
    for kind in kinds:
        _wrap_once(ctx, kind, 64, 2)
    records: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(cfg["rounds"]):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            records[kind].append(_wrap_once(ctx, kind, cfg["width"], cfg["layers"]))
    return {"world": ctx.world_size, "ranks": ctx.gather_object(records)}


def _wrap_tables(outs: list[dict[str, Any]], args: Any, notes: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """One table per world size; and whether the meta-built models were finite everywhere."""
    tables, finite = [], True
    for out in outs:
        w, ranks = out["world"], out["ranks"]
        model_mib = ranks[0]["cpu"][0]["model_bytes"] / MIB if ranks[0]["cpu"] else 0.0
        shard = model_mib / w
        rows: dict[str, list[float]] = {"shard (model / world size)": [shard]}
        row_notes = {"shard (model / world size)": f"rank 0 holds {ranks[0]['meta'][0]['local_bytes'] / MIB:.4g} "
                     "MiB after ctx.wrap" if ranks[0]["meta"] else ""}
        measured = True
        for name, kind in WRAP_VARIANTS.items():
            per_round = list(zip(*(rank[kind] for rank in ranks), strict=True))
            if any(rec["extra"] is None for sample in per_round for rec in sample):
                measured = False
                break
            rows[name] = [max(rec["extra"] for rec in sample) / MIB for sample in per_round]
            secs = statistics.median(max(rec["seconds"] for rec in sample) for sample in per_round)
            row_notes[name] = f"build + wrap {secs:.2f} s"
        rows["whole model (fp32 parameters)"] = [model_mib]
        row_notes["distfn ctx.wrap, CPU-built"] += "; the whole model on every rank first"
        if not measured:
            notes.append(f"ctx.wrap, {w} ranks: peak memory not measured (/proc/self/clear_refs cannot reset VmHWM)")
            continue
        tables.append(c.table(
            f"peak extra host memory per rank during ctx.wrap of a {model_mib:.0f} MiB model "
            f"({args.wrap_layers} x Linear({args.wrap_width})), {w} ranks (max over ranks)", "MiB", rows,
            baseline="shard (model / world size)",
            targets=[{"variant": "distfn ctx.wrap, meta-built", "max_ratio": round(1 + 64 / shard, 3) if shard else 1}],
            notes=row_notes))
        for name, kind in (("distfn ctx.wrap", "meta"), ("hand-written recipe", "recipe")):
            recs = [rec for rank in ranks for rec in rank[kind]]
            ok = bool(recs) and all(rec["finite"] for rec in recs)
            distinct = len({rank[kind][0]["first"] for rank in ranks if rank[kind]}) == w
            if kind == "meta":
                finite = finite and ok
            notes.append(f"{w} ranks, meta-built model after {name}: "
                         + (f"all {recs[0]['tensors']} parameter/buffer shards finite on every rank"
                            if ok else "NON-FINITE values (uninitialised memory?)")
                         + ("; the ranks' shards differ" if distinct else "; every rank drew the SAME values"))
    return tables, finite


def _ranks(text: str) -> list[int]:
    return sorted({int(w) for w in text.split(",") if w.strip()})


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--wrap-ranks", default="2,4",
                   help="world sizes of the ctx.wrap memory table, one launch each ('' for none; default 2,4)")
    p.add_argument("--wrap-width", type=int, default=4096, help="ctx.wrap model: Linear width (default 4096)")
    p.add_argument("--wrap-layers", type=int, default=16, help="ctx.wrap model: layers (default 16: 1 GiB)")
    p.add_argument("--wrap-rounds", type=int, default=2, help="ctx.wrap memory: rotated rounds (default 2)")
    p.add_argument("--worker", choices=sorted(set(VARIANTS.values())), help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, json.loads(args.cfg))
        return 0
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.width = 1, 6, 2, 64
        args.wrap_ranks, args.wrap_width, args.wrap_layers, args.wrap_rounds = "2", 256, 4, 1
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
    notes = [how]
    wrap_tables, finite = _wrap_memory(args, notes)
    c.emit({"benchmark": "fsdp", "tables": [step, memory, sync, *wrap_tables], "identical_losses": same,
            "meta_wrap_finite": finite, "notes": notes}, args.json)
    return 0 if same and finite else 1


def _wrap_memory(args: Any, notes: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The ctx.wrap memory tables: one ``mode="fsdp"`` launch per world size in ``--wrap-ranks``."""
    from distfn import distributed

    outs = []
    for w in _ranks(args.wrap_ranks):
        c.log(f"ctx.wrap memory: {w} ranks, {args.wrap_layers} x Linear({args.wrap_width}), "
              f"{args.wrap_rounds} round(s)")
        job = distributed(mode="fsdp", nprocs=w, seed=SEED, backend="gloo",
                          fsdp={"min_params": args.wrap_width * args.wrap_width // 2})(_wrap_job)
        outs.append(job({"width": args.wrap_width, "layers": args.wrap_layers, "rounds": args.wrap_rounds}))
    if outs:
        notes.append("ctx.wrap memory: per rank VmHWM - VmRSS around build + wrap, after gc.collect, malloc_trim and "
                     "a VmHWM reset; max over ranks; includes the shards the wrapped model keeps")
    return _wrap_tables(outs, args, notes)


if __name__ == "__main__":
    sys.exit(main())
