"""Cost of the per-rank timings (issue 30): the DDP step with the accounting on vs off, and what moving the rows
to rank 0 costs through the store vs a collective.

Table 1, the step: the same distfn DDP loop through ``ctx.dataloader`` (bench_step.py's MLP, 2 ranks, gloo), each
variant in a fresh ``python`` process per round, interleaved; ``DISTFN_TIMINGS=0`` installs no hook at all. A
round's sample is rank 0's median time of one iteration (batch fetch, forward, backward, optimizer step) after
``--warmup``. Target: on / off ≤ 1.01. The final weights must be bit-identical (the accounting only reads clocks).

Table 2, the hooks' own cost, robust to a loaded machine: in one process, no process group, a tiny model (so
the step is short and the cost visible), blocks of steps of a watched and an unwatched copy alternating, each
block's CPU time per step (``time.thread_time``: a descheduled thread does not count, so other processes on the
machine do not either); the difference of the medians is the accounting's cost per step, which table 1's step
divides.

Table 3, the exchange, per window: one rank's ``store.set`` of its row (what every rank does every window), rank
0's ``store.check`` + ``multi_get`` of the others' rows (what rank 0 does), against an ``all_gather_object`` of
the same row (the collective it would otherwise take, which also makes every rank wait for the slowest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import SEED, WORLD, make_model

import _common as c

VARIANTS = {"timings off": "0", "timings on": "1"}


def step_job(cfg: dict[str, Any], ctx: Any) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.utils.data import TensorDataset

    model = ctx.wrap(make_model(cfg["width"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    n = cfg["steps"] * cfg["batch"] * ctx.world_size
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))
    batches = iter(ctx.dataloader(data, batch_size=cfg["batch"], shuffle=False))
    times = []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        x, y = next(batches)
        ctx.backward(F.cross_entropy(model(x), y))
        ctx.step(opt)
        times.append(time.perf_counter() - start)
    if ctx.is_main:
        save_file({k: v.detach().contiguous() for k, v in ctx.unwrap(model).state_dict().items()},
                  os.path.join(cfg["out"], "weights.safetensors"))
        Path(cfg["out"], "times.json").write_text(json.dumps(times))


def hook_cost(blocks: int, steps: int) -> dict[str, list[float]]:
    """CPU time per step of each block, for a watched and an unwatched copy of a tiny model, blocks alternating."""
    import torch
    from torch import nn

    from distfn.timings import Timings

    torch.set_num_threads(1)
    timings = Timings(enabled=True, window=50)
    models = {name: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)) for name in ("off", "on")}
    timings.watch(models["on"], torch.device("cpu"), bracket=True)  # everything a DDP rank installs
    batches = [torch.randn(8, 32) for _ in range(steps)]
    out: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(2 * blocks):
        name = ("off", "on")[block % 2]
        model = models[name]
        source = timings.timed_batches(iter(batches)) if name == "on" else iter(batches)
        start = time.thread_time()
        for _ in range(steps):
            model(next(source)).sum().backward()
        out[name].append((time.thread_time() - start) / steps)
    return out


def exchange_job(cfg: dict[str, Any], ctx: Any) -> dict[str, float] | None:
    """Seconds per operation of moving one window's row to rank 0 (median of ``cfg['ops']`` repetitions)."""
    from distfn import stragglers
    from distfn.checkin import default_store
    from distfn.timings import Exchange

    row = stragglers.summarise([(0.001, 0.02, 0.003, 0.024)] * 50, rank=ctx.rank, host="node")
    payload = {"window": 0, "row": stragglers.to_payload(row)}
    exchange = Exchange.start(ctx.rank, ctx.world_size, default_store())
    publish, read, gather = [], [], []
    for i in range(cfg["ops"]):
        t = time.perf_counter()
        exchange.publish(f"w{i % 4}", {**payload, "window": i})
        publish.append(time.perf_counter() - t)
        ctx.barrier()  # every rank has written window i (only so that rank 0's read below finds it)
        if ctx.is_main:
            t = time.perf_counter()
            assert exchange.read(f"w{i % 4}") is not None
            read.append(time.perf_counter() - t)
        ctx.barrier()
        t = time.perf_counter()
        ctx.gather_object(payload)
        gather.append(time.perf_counter() - t)
    if not ctx.is_main:
        return None
    return {"publish": statistics.median(publish), "read": statistics.median(read),
            "gather": statistics.median(gather)}


def _worker(kind: str, cfg: dict[str, Any]) -> None:
    from distfn import distributed

    if kind == "exchange":
        result = distributed(nprocs=WORLD, seed=SEED, backend="gloo")(exchange_job)(cfg)
        Path(cfg["out"], "exchange.json").write_text(json.dumps(result))
    else:
        distributed(nprocs=WORLD, seed=SEED, backend="gloo")(step_job)(cfg)


def _round(switch: str, cfg: dict[str, Any], runs: list[Path], warmup: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="timings-", dir=cfg["tmp"]))
    c.timed_run([sys.executable, __file__, "--worker", "step", "--cfg", json.dumps({**cfg, "out": str(out)})],
                env=c.clean_env(GLOO_SOCKET_IFNAME="lo", DISTFN_TIMINGS=switch), timeout=600)
    runs.append(out)
    return statistics.median(json.loads((out / "times.json").read_text())[warmup:])


def _identical(runs: list[Path]) -> bool:
    import torch
    from safetensors.torch import load_file

    first = load_file(runs[0] / "weights.safetensors")
    return all(all(torch.equal(first[k], v) for k, v in load_file(p / "weights.safetensors").items())
               for p in runs[1:])


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=11)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--ops", type=int, default=200, help="repetitions of each exchange operation")
    p.add_argument("--blocks", type=int, default=20, help="blocks of steps per variant for the hooks' own cost")
    p.add_argument("--worker", choices=("step", "exchange"), help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, json.loads(args.cfg))
        return 0
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.width, args.ops, args.blocks = 1, 8, 2, 64, 5, 2
    with tempfile.TemporaryDirectory(prefix="distfn-bench-timings-") as tmp:
        cfg = {"steps": args.steps, "batch": args.batch, "width": args.width, "tmp": tmp}
        runs: dict[str, list[Path]] = {name: [] for name in VARIANTS}
        variants = {name: (lambda name=name: _round(VARIANTS[name], cfg, runs[name], args.warmup))
                    for name in VARIANTS}
        c.log(f"timings: {', '.join(variants)}; {args.rounds} round(s) of {args.steps} steps")
        samples = c.interleave(variants, args.rounds, c.log)
        every = [p for ps in runs.values() for p in ps]
        same = bool(every) and _identical(every)
        out = Path(tmp, "exchange")
        out.mkdir()
        c.timed_run([sys.executable, __file__, "--worker", "exchange", "--cfg",
                     json.dumps({"ops": args.ops, "out": str(out)})], env=c.clean_env(GLOO_SOCKET_IFNAME="lo"),
                    timeout=600)
        ops = json.loads((out / "exchange.json").read_text())
    c.log(f"hooks: {args.blocks} blocks of 500 steps per variant")
    hooks = hook_cost(args.blocks, 500)
    step = c.table(f"Step time with the per-rank timings on vs off: DDP, {WORLD} ranks (gloo, CPU), MLP "
                   f"256-{args.width}-{args.width}-10, batch {args.batch}/rank through ctx.dataloader, median of "
                   f"steps {args.warmup + 1}..{args.steps}", "s", samples, baseline="timings off",
                   targets=[{"variant": "timings on", "max_ratio": 1.01}])
    step["identical_weights"] = same
    off, on = samples["timings off"], samples["timings on"]
    if len(off) == len(on) == args.rounds > 1:  # within-round ratios: immune to slow drifts of the machine's load
        step["paired_ratio"] = statistics.median(o / f for o, f in zip(on, off, strict=True))
    extra = statistics.median(hooks["on"]) - statistics.median(hooks["off"])
    hook_table = c.table("The accounting's own cost per step, one process, a 32-32-1 MLP, batch 8 (blocks of 500 "
                         "steps alternating; CPU time per step of each block)", "s",
                         {"unwatched": hooks["off"], "watched (hooks, data timer, windows)": hooks["on"]},
                         baseline="unwatched")
    hook_table["extra_per_step_s"] = extra
    medians = [m for m in (step["rows"][0]["median"], step["rows"][1]["median"]) if m]
    exchange = c.table(f"Moving one window's row to rank 0 ({WORLD} ranks, median of {args.ops}): once per window "
                       "of 50 steps", "s", {"store.set (every rank)": [ops["publish"]],
                                            "store.check + multi_get (rank 0)": [ops["read"]],
                                            "all_gather_object (a collective)": [ops["gather"]]},
                       baseline="all_gather_object (a collective)")
    notes = ["final weights bit-identical with the timings on and off" if same else "final weights DIFFER",
             f"the accounting costs {extra * 1e6:.1f} us per step in one process"
             + (f": {extra / min(medians):.2%} of table 1's step" if medians else "")]
    c.emit({"benchmark": "timings", "tables": [step, hook_table, exchange], "identical_weights": same,
            "notes": notes}, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
