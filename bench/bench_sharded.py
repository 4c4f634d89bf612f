"""Sharded checkpoints of fsdp state (issue 14): distfn's sharded save vs the one-file gather to rank 0 vs torch
DCP's default ``FileSystemWriter``, and how long an asynchronous save blocks training.

One 2-rank ``mode="fsdp"`` job (gloo, CPU) holds a model of ``--layers`` square ``Linear(--width)`` layers with Adam
state (weights + two moments). Every round runs each variant once, in a rotated order, between barriers; a sample
is rank 0's wall time from a barrier before the save to a barrier after it (all ranks done, files complete):

* ``distfn sharded`` - ``ctx.save(state, dir)`` (every rank writes its own safetensors shards, then the index);
* ``distfn one file (gather)`` - ``ctx.save(state, "x.safetensors")``: full state gathered to rank 0, which writes;
* ``DCP FileSystemWriter`` - ``torch.distributed.checkpoint.save`` of the same sharded state dicts, default writer
  (its ``.metadata`` is a pickle);
* ``distfn async (blocked)`` - the time ``ctx.save(..., blocking=False)`` keeps training blocked (the write then
  completes in the background before the next variant starts; not part of the sample).

Target: distfn sharded <= 1.0x DCP. Run: ``python bench/bench_sharded.py [--tiny] [--json out.json]``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

VARIANTS = ("distfn sharded", "distfn one file (gather)", "DCP FileSystemWriter", "distfn async (blocked)")


def _job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import distfn

    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(*(nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["layers"]))))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, cfg["width"])).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    root = Path(cfg["dir"])

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def sharded() -> float:
        return timed(lambda: ctx.save(state, root / "sharded"))

    def gather() -> float:
        return timed(lambda: ctx.save(state, root / "one.safetensors"))

    def dcp_default() -> float:
        def save() -> None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(str(root / "dcp")))
        return timed(save)

    def blocked() -> float:
        dist.barrier()
        start = time.perf_counter()
        ctx.save(state, root / "async", blocking=False)
        took = time.perf_counter() - start
        distfn.checkpoint.background.wait()
        dist.barrier()
        return took

    fns = {"distfn sharded": sharded, "distfn one file (gather)": gather, "DCP FileSystemWriter": dcp_default,
           "distfn async (blocked)": blocked}
    samples: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for r in range(cfg["rounds"]):
        order = list(VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)])
        for name in order:
            samples[name].append(fns[name]())
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # the full model: weights + 2 Adam moments
    return {"samples": samples, "state_bytes": int(state_bytes)}


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.layers, args.rounds = 256, 2, 1
    from distfn import distributed

    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    try:
        job = distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 1000})(_job)
        out = job({"width": args.width, "layers": args.layers, "rounds": args.rounds, "dir": str(tmp)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mib = out["state_bytes"] / 2**20
    tab = c.table(f"save of {mib:.0f} MiB of fsdp state (model + Adam), 2 ranks", "s", out["samples"],
                  baseline="DCP FileSystemWriter", targets=[{"variant": "distfn sharded", "max_ratio": 1.0}],
                  notes={"distfn async (blocked)": "time training is blocked; the write finishes in the background"})
    c.emit({"benchmark": "sharded", "tables": [tab],
            "notes": [f"width {args.width}, {args.layers} layers, {args.rounds} rounds; gloo, CPU"]}, args.json)
    if args.json is None:
        print(json.dumps({r["variant"]: r["ratio"] for r in tab["rows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
