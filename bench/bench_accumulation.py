"""Gradient accumulation with and without ``no_sync``: time per optimizer step and all-reduces per step.

One 2-rank distfn job (gloo, CPU) runs both loops side by side, interleaved round by round in a rotated order,
from the same initial weights on the same data:

* ``all-reduce every micro-batch``: the naive loop (``loss / k``, ``backward()`` on each of the k
  micro-batches under DDP, then ``opt.step()``): DDP all-reduces the gradients k times per optimizer step;
* ``ctx.accumulate (no_sync)``: ``with acc: ctx.backward(loss)`` and ``ctx.step(opt)``: DDP all-reduces once,
  on the last micro-batch.

A DDP comm hook counts the all-reduce calls (one per gradient bucket) and the bytes they carry. A round's
sample is rank 0's median time per optimizer step over the steps after ``--warmup``. Both loops compute the
same update, so their final weights must agree (up to float summation order).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2
NAIVE = "all-reduce every micro-batch"
NO_SYNC = "ctx.accumulate (no_sync)"


def _make_model(width: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _run_variant(ctx: Any, variant: str, init: dict[str, Any], data: list[Any], cfg: dict[str, Any]) -> dict:
    """``cfg["steps"]`` optimizer steps of ``cfg["every"]`` micro-batches; per-step times, calls and bytes."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    net = _make_model(cfg["width"])
    net.load_state_dict(init)
    model = ctx.wrap(net)
    sent: list[int] = []

    # No annotations: DDP rejects a hook whose bucket parameter is not annotated as dist.GradBucket.
    def counting_hook(state, bucket):
        sent.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    k = cfg["every"]
    acc = ctx.accumulate(model, every=k)
    times, calls, sizes = [], [], []
    for step in range(cfg["steps"]):
        ctx.barrier()  # both ranks start the step together, so the time is the step's, not a straggler's
        before = len(sent)
        start = time.perf_counter()
        for micro in range(k):
            x, y = data[(step * k + micro) % len(data)]
            if variant == NAIVE:
                (F.cross_entropy(model(x), y) / k).backward()
            else:
                with acc:
                    ctx.backward(F.cross_entropy(model(x), y))
        if variant == NAIVE:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            assert ctx.step(opt), "the accumulation window should close on the k-th micro-batch"
        times.append(time.perf_counter() - start)
        calls.append(len(sent) - before)
        sizes.append(sum(sent[before:]))
    weights = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    return {"times": times, "calls": calls, "bytes": sizes, "weights": weights}


def accumulation_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import torch

    init = _make_model(cfg["width"]).state_dict()  # identical on both ranks (seeded)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    data = [(torch.randn(cfg["batch"], 256, generator=g), torch.randint(0, 10, (cfg["batch"],), generator=g))
            for _ in range(16)]
    variants = [NAIVE, NO_SYNC]
    out: dict[str, Any] = {"time": {v: [] for v in variants}, "calls": {v: [] for v in variants},
                           "mbytes": {v: [] for v in variants}, "max_weight_diff": []}
    warm = cfg["warmup"]
    for r in range(cfg["rounds"]):
        order = variants[r % 2:] + variants[:r % 2]
        results = {v: _run_variant(ctx, v, init, data, cfg) for v in order}
        for v, res in results.items():
            out["time"][v].append(statistics.median(res["times"][warm:]))
            out["calls"][v].append(statistics.median(res["calls"][warm:]))
            out["mbytes"][v].append(statistics.median(res["bytes"][warm:]) / 1e6)
        diff = (results[NAIVE]["weights"] - results[NO_SYNC]["weights"]).abs().max().item()
        out["max_weight_diff"].append(diff)
        if ctx.is_main:
            c.log(f"  round {r + 1}/{cfg['rounds']}: " + ", ".join(
                f"{v} {out['time'][v][-1] * 1000:.1f} ms/step, {out['calls'][v][-1]:g} all-reduce(s)"
                for v in variants) + f"; weights differ by {diff:.2e}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--steps", type=int, default=25, help="optimizer steps per variant per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=4, help="micro-batches per optimizer step (k)")
    p.add_argument("--batch", type=int, default=16, help="samples per micro-batch per rank")
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.width = 1, 3, 1, 64
    from distfn import distributed

    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "every", "batch", "width")}
    params = sum(t.numel() for t in _make_model(args.width).state_dict().values())
    c.log(f"accumulation: {NAIVE} vs {NO_SYNC}; {args.rounds} round(s) of {args.steps} optimizer steps, "
          f"k={args.every}, {params / 1e6:.2f} M parameters")
    out = distributed(nprocs=WORLD, seed=0, backend="gloo")(accumulation_job)(cfg)

    what = (f"{WORLD} ranks (gloo, CPU), MLP 256-{args.width}-{args.width}-10 ({params / 1e6:.2f} M params), "
            f"k={args.every} micro-batches of {args.batch}/rank")
    time_tab = c.table(f"Time per optimizer step: {what}", "s", out["time"], baseline=NAIVE,
                       targets=[{"variant": NO_SYNC, "max_ratio": 1.0}])
    calls_tab = c.table("All-reduce calls per optimizer step (DDP comm hook; one per gradient bucket)", "calls",
                        out["calls"], baseline=NAIVE, targets=[{"variant": NO_SYNC, "max_ratio": 1 / args.every}])
    bytes_tab = c.table("Megabytes all-reduced per optimizer step, per rank", "MB", out["mbytes"], baseline=NAIVE)
    worst = max(out["max_weight_diff"])
    same = worst < 1e-4
    notes = [(f"final weights of the two loops differ by at most {worst:.2e} (float summation order): "
              f"{'the same update' if same else 'NOT the same update'}")]
    c.emit({"benchmark": "accumulation", "tables": [time_tab, calls_tab, bytes_tab], "max_weight_diff": worst,
            "same_update": same, "notes": notes}, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
