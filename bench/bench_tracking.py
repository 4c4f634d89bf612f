"""Experiment tracking's cost: time per training step with ``ctx.log_metrics`` every step vs no logging.

One 2-rank distfn job (gloo, CPU) with ``@distributed(track=...)`` (``csv`` by default: needs nothing; any
backend name with ``--track``) runs both loops side by side, interleaved round by round in a rotated order:

* ``no logging``: forward, ``ctx.backward``, ``ctx.step`` of a small MLP under DDP;
* ``ctx.log_metrics every step``: the same, plus ``ctx.log_metrics({"loss": loss, "lr": lr}, step=step)``
  with the loss as a tensor, called on both ranks (rank 1 returns at once; rank 0 reads the tensor and queues a
  row, the tracking thread writes in the background).

Many short rounds (a rotated order each) rather than a few long ones, so that a noisy neighbour hits both
variants alike. A second table times the call alone on each rank (``--calls`` calls, no training); a third
gives the tracking thread's CPU time per logged step on rank 0 (``/proc/self/task/<tid>/schedstat`` over the
rounds and one flush after them): what the background writer takes from the ranks on a shared machine.

The run is opened (and the backend's package imported) by one call before the first round, so the rounds
measure the steady state. A round's sample is rank 0's median time per step over ``--steps`` steps.
Target (issue 29): logging every step costs at most 1.01x the step without it.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2
NONE = "no logging"
LOGGED = "ctx.log_metrics every step"


def _thread_cpu_ns(name: str) -> int | None:
    """CPU time (ns) the thread ``name`` of this process has run, from ``/proc/self/task/<tid>/schedstat``
    (``None`` where there is no such thread or no /proc): what the tracking thread takes from the ranks."""
    import threading

    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/schedstat", encoding="ascii") as f:
                    return int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None
    return None


def tracking_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """``cfg["rounds"]`` rounds of both variants; rank 0's per-round median step times."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(nn.Linear(256, cfg["width"]), nn.ReLU(), nn.Linear(cfg["width"], cfg["width"]),
                                   nn.ReLU(), nn.Linear(cfg["width"], 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(cfg["batch"], 256), torch.randint(0, 10, (cfg["batch"],))
    step = 0

    def run(log: bool) -> float:
        nonlocal step
        times = []
        for _ in range(cfg["steps"]):
            start = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            ctx.backward(loss)
            ctx.step(opt)
            step += 1
            if log:
                ctx.log_metrics({"loss": loss, "lr": 0.01}, step=step)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    run(log=False)  # warm-up: allocator, DDP buckets

    ctx.log_metrics({"warmup": 0.0}, step=step)  # opens the run (imports the backend) before the rounds
    time.sleep(cfg["open_wait"])
    out: dict[str, list[float]] = {NONE: [], LOGGED: []}
    variants = [NONE, LOGGED]
    thread_before = _thread_cpu_ns("distfn-tracking")
    for r in range(cfg["rounds"]):
        for name in variants[r % 2:] + variants[:r % 2]:
            out[name].append(run(log=name == LOGGED))
        if ctx.is_main:
            c.log(f"  round {r + 1}/{cfg['rounds']}: " + ", ".join(f"{v} {out[v][-1] * 1000:.3f} ms/step"
                                                                   for v in variants))
    ctx.barrier()
    time.sleep(1.5 * 1.0)  # one more flush period (tracking.session.FLUSH_EVERY): the rounds' rows are written
    thread_after = _thread_cpu_ns("distfn-tracking")
    logged_steps = cfg["rounds"] * cfg["steps"]
    thread_us = None if thread_before is None or thread_after is None else \
        (thread_after - thread_before) / 1e3 / logged_steps
    # the call alone, on each rank: rank 0 reads the tensor and queues a row, rank 1 returns at once
    calls, loss = cfg["calls"], F.cross_entropy(model(x), y).detach()
    begin = time.perf_counter()
    for i in range(calls):
        ctx.log_metrics({"loss": loss, "lr": 0.01}, step=step + 1 + i)
    per_call = (time.perf_counter() - begin) / calls
    return {"steps": out, "per_call": ctx.gather_object(per_call), "thread_us_per_step": thread_us}


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=31)
    p.add_argument("--steps", type=int, default=50, help="steps per variant per round")
    p.add_argument("--calls", type=int, default=20000, help="ctx.log_metrics calls timed alone, per rank")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--track", default="csv", help="the backend (csv, tensorboard, mlflow, wandb)")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.steps, args.width, args.calls = 1, 5, 32, 100
    from distfn import distributed
    from distfn.tracking import CSV, TensorBoard

    with tempfile.TemporaryDirectory() as tmp:  # the run's files go away with the benchmark
        track: Any = {"csv": CSV(root=tmp), "tensorboard": TensorBoard(root=tmp)}.get(args.track, args.track)
        cfg = {k: getattr(args, k) for k in ("rounds", "steps", "batch", "width", "calls")}
        cfg["open_wait"] = 0.2 if args.tiny else 3.0  # seconds for the run to open before the rounds
        c.log(f"tracking: {NONE} vs {LOGGED} (track={args.track!r}); {args.rounds} round(s) of {args.steps} steps")
        out = distributed(nprocs=WORLD, seed=0, backend="gloo", track=track)(tracking_job)(cfg)

    what = (f"{WORLD} ranks (gloo, CPU), MLP 256-{args.width}-{args.width}-10, batch {args.batch}/rank, "
            f"track={args.track!r}")
    tab = c.table(f"Time per training step: {what}", "s", out["steps"], baseline=NONE,
                  targets=[{"variant": LOGGED, "max_ratio": 1.01}])
    rank0, rank1 = out["per_call"]
    calls = c.table(f"One ctx.log_metrics call (a tensor and a float), {args.calls} calls timed alone", "µs",
                    {"rank 0 (reads the tensor, queues a row)": [rank0 * 1e6],
                     "rank 1 (returns at once)": [rank1 * 1e6]}, baseline=None)
    thread = c.table("The tracking thread's CPU time per logged step (rank 0, /proc/self/task/<tid>/schedstat over the "
                     "rounds and one flush after them)", "µs",
                     {"distfn-tracking thread": [out["thread_us_per_step"]] if out["thread_us_per_step"] else []},
                     baseline=None)
    c.emit({"benchmark": "tracking", "tables": [tab, calls, thread],
            "notes": ["rank 0's median step time per round; the tracking thread writes in the background"]},
           args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
