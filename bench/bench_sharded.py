"""Sharded checkpoints of fsdp state (issue 14): distfn's sharded save vs the one-file gather to rank 0 vs torch
DCP's default ``FileSystemWriter`` on 1, 2 and 4 ranks, the host memory each needs, how long an asynchronous save
blocks training, and what saving every N steps costs a training loop.

Every world size in ``--ranks`` is its own ``mode="fsdp"`` launch (gloo, CPU) holding a model of ``--layers``
square ``Linear(--width)`` layers with Adam state (weights + two moments; the default is 1.1 GiB). After an
untimed warm-up of every variant on a tiny model (imports, process groups), every round runs each variant once,
in a rotated order, between barriers; a sample is rank 0's wall time from a barrier before the save to a barrier
after it (all ranks done, files complete):

* ``distfn sharded`` - ``ctx.save(state, dir)`` (every rank writes its own safetensors shards, then the index);
* ``distfn one file (gather)`` - ``ctx.save(state, "x.safetensors")``: full state gathered to rank 0, which writes;
* ``DCP FileSystemWriter`` - ``torch.distributed.checkpoint.save`` of the same sharded state dicts, default writer
  (its ``.metadata`` is a pickle);
* ``distfn async (blocked)`` - the time ``ctx.save(..., blocking=False)`` keeps training blocked (the write then
  completes in the background before the next variant starts; not part of the sample, but its end - the time
  until written - is reported next to the blocking save).

Peak extra host memory: before each sample every rank returns free heap to the system (``malloc_trim``), resets
its peak RSS (``5`` into ``/proc/self/clear_refs``) and reads ``VmRSS``; after the save (for async: after
``ctx.saves.wait()``, i.e. including the background write) it reads ``VmHWM``. The extra is
``VmHWM - VmRSS``, the max over ranks; memory an async save keeps after its first run (reused host buffers) is
counted in every async sample. Compared with each rank's shard (state / world size).

Training while saving (``--train-ranks``): forward, backward and Adam step of a random batch, ``--steps`` steps,
three ways in a rotated order per round: no saves; ``ctx.save(state, f"ckpt-{step}", blocking=False, keep=2)``
every ``--every`` steps; the same blocking. A sample is rank 0's loop time per step, from a barrier to a barrier
after the final ``ctx.saves.wait()``, over ``--train-rounds`` rounds (after an untimed warm-up: 3 steps and
one async save). Saves come after steps every, 2*every, ... < steps, so each async write has a full interval
to overlap. The loop has its own model, ``--train-width``/``--train-layers`` (default 72 MiB of state): one
step of the save model takes ~5 s on 2 CPU cores (gloo all-gathers of 400 MB per step). A second table gives
rank 0's cost per save in those loops: the ``ctx.save`` call's time (what training waits for) and, for async saves,
the background writer thread's CPU time (``Saves.write_cpu_s``): on a machine whose cores the training ranks keep
busy, that CPU is taken from training.

The save-vs-ranks curve is one table of the ``distfn sharded`` and ``DCP FileSystemWriter`` samples of every world
size, with each rank's bandwidth (its shard, state / world size, over the save's time) and the ratio to DCP at the
same world size.

Targets: distfn sharded <= 1.0x DCP (at every world size); extra memory of distfn sharded and async <= shard +
64 MiB; async blocked <= 0.10x a blocking save; async saves every N steps <= 1.05x the loop without saves.
Run: ``python bench/bench_sharded.py [--tiny] [--json out.json] [--ranks 1,2,4] [--train-ranks 2]``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

VARIANTS = ("distfn sharded", "distfn one file (gather)", "DCP FileSystemWriter", "distfn async (blocked)")
TRAIN = ("no saves", "async save every N", "blocking save every N")
#: What one save of the training loop costs rank 0 (its own table): the training thread's time in the call, and
#: the CPU time of the background writer thread (user + system: page-cache copies, system calls, Python).
SAVE_COSTS = ("async: ctx.save call (training blocked)", "async: background writer thread CPU",
              "blocking: ctx.save call")
MIB = 2**20


# --------------------------------------------------------------------------------------------------
# The job (shipped to every rank)


def _model(ctx: Any, width: int, layers: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = ctx.wrap(nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_variants(ctx: Any, model: Any, opt: Any, root: Path) -> dict[str, Any]:
    """One function per variant: ``() -> (seconds, extra bytes or None, seconds until written or None)``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict


    state = {"model": model, "optimizer": opt, "step": 1}

    def timed(fn: Any) -> tuple[float, int | None, None]:
        base = c.reset_peak_rss()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        took = time.perf_counter() - start
        return took, c.peak_extra(base), None

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, storage_writer=dcp.FileSystemWriter(str(root / "dcp")))

    held: list[int] = []  # what the first async save left in memory (reused host buffers): counted every time

    def blocked() -> tuple[float, int | None, float]:
        base = c.reset_peak_rss()
        dist.barrier()
        start = time.perf_counter()
        ctx.save(state, root / "async", blocking=False)
        took = time.perf_counter() - start
        ctx.saves.wait()
        extra = c.peak_extra(base)
        if base is not None and extra is not None:
            if not held:
                c.trim_heap()
                held.append(max(0, c.proc_status("VmRSS") - base))
            else:
                extra += held[0]
        dist.barrier()
        return took, extra, time.perf_counter() - start

    return {"distfn sharded": lambda: timed(lambda: ctx.save(state, root / "sharded")),
            "distfn one file (gather)": lambda: timed(lambda: ctx.save(state, root / "one.safetensors")),
            "DCP FileSystemWriter": lambda: timed(dcp_save), "distfn async (blocked)": blocked}


def _train(ctx: Any, cfg: dict[str, Any], root: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per training step, per way of saving (rank 0's samples), and rank 0's cost of each save (seconds:
    the call's time in the training thread, and for async saves the background writer thread's CPU time)."""
    import torch
    import torch.distributed as dist


    model, opt = _model(ctx, cfg["train_width"], cfg["train_layers"])
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    batch = torch.randn(cfg["batch"], cfg["train_width"])
    steps, every = cfg["steps"], cfg["every"]

    costs: dict[str, list[float]] = {n: [] for n in SAVE_COSTS}

    def loop(name: str) -> float:
        where = root / "train" / name.split()[0]
        blocking = name.startswith("blocking")
        cpu_before = len(ctx.saves.write_cpu_s)
        dist.barrier()
        start = time.perf_counter()
        for step in range(1, steps + 1):
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state["step"] = step
            if name != "no saves" and step % every == 0 and step < steps:
                called = time.perf_counter()
                ctx.save(state, where / f"ckpt-{step}", blocking=blocking, keep=2)
                costs[SAVE_COSTS[2 if blocking else 0]].append(time.perf_counter() - called)
        ctx.saves.wait()
        dist.barrier()
        took = (time.perf_counter() - start) / steps
        if name.startswith("async"):
            costs[SAVE_COSTS[1]].extend(list(ctx.saves.write_cpu_s)[cpu_before:])
        if ctx.rank == 0:
            shutil.rmtree(where, ignore_errors=True)
        return took

    # warm-up, untimed: a few steps and one async save (whose host buffers later saves reuse)
    for _ in range(3):
        model(batch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ctx.save(state, root / "train" / "warmup", blocking=False)
    ctx.saves.wait()
    samples: dict[str, list[float]] = {n: [] for n in TRAIN}
    for r in range(cfg["train_rounds"]):
        for name in TRAIN[r % len(TRAIN):] + TRAIN[:r % len(TRAIN)]:
            samples[name].append(loop(name))
    return samples, costs


def _job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import gc

    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - imported before anything is measured

    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint")  # DCP, on every round
    root = Path(cfg["dir"]) / f"w{ctx.world_size}"
    out: dict[str, Any] = {"world": ctx.world_size}
    if cfg["save"]:
        # warm-up: every variant once on a tiny model (imports, the background save's process group, planners)
        tiny = _save_variants(ctx, *_model(ctx, 64, 2), root / "warmup")
        for name in VARIANTS:
            tiny[name]()
        model, opt = _model(ctx, cfg["width"], cfg["layers"])
        fns = _save_variants(ctx, model, opt, root)
        times: dict[str, list[float]] = {n: [] for n in VARIANTS}
        extra: dict[str, list[int | None]] = {n: [] for n in VARIANTS}
        written: list[float] = []
        for r in range(cfg["rounds"]):
            for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                took, peak, until = fns[name]()
                times[name].append(took)
                extra[name].append(peak)
                if until is not None:
                    written.append(until)
        every_rank: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every_rank, extra)
        memory: dict[str, list[int] | None] = {}
        for name in VARIANTS:
            per_round = list(zip(*(rank_extra[name] for rank_extra in every_rank), strict=True))
            ok = all(v is not None for sample in per_round for v in sample)
            memory[name] = [max(sample) for sample in per_round] if ok else None
        out.update(times=times, written=written, memory=memory,
                   state_bytes=int(sum(p.numel() * 4 * 3 for p in model.parameters())))  # weights + 2 moments
        del fns, model, opt, tiny
        gc.collect()
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if cfg["train"]:
        out["train"], out["save_costs"] = _train(ctx, cfg, root)
    return out


# --------------------------------------------------------------------------------------------------
# Tables


def _world(w: int) -> str:
    return f"{w} rank" + ("s" if w != 1 else "")


def _ranks(text: str) -> list[int]:
    return sorted({int(w) for w in text.split(",") if w.strip()})


def _tables(out: dict[str, Any], args: Any, notes: list[str]) -> dict[str, dict[str, Any]]:
    """This world size's tables by kind: ``save``, ``async``, ``memory``, ``train``, ``train-costs`` (those it
    measured)."""
    w, tabs = out["world"], {}
    if "times" in out:
        mib = out["state_bytes"] / MIB
        shard = mib / w
        tabs["save"] = c.table(
            f"save of {mib:.0f} MiB of fsdp state (model + Adam), {_world(w)}", "s", out["times"],
            baseline="DCP FileSystemWriter", targets=[{"variant": "distfn sharded", "max_ratio": 1.0}],
            notes={"distfn async (blocked)": "time training is blocked; the write finishes in the background"})
        blocking = {"distfn sharded (blocking)": out["times"]["distfn sharded"],
                    "distfn async (blocked)": out["times"]["distfn async (blocked)"],
                    "distfn async (until written)": out["written"]}
        tabs["async"] = c.table(
            f"async save of {mib:.0f} MiB, {_world(w)}: time training is blocked vs a blocking save", "s", blocking,
            baseline="distfn sharded (blocking)", targets=[{"variant": "distfn async (blocked)", "max_ratio": 0.10}],
            notes={"distfn async (until written)": "from the call until the background write's wait() returned"})
        memory = out["memory"]
        if all(v is not None for v in memory.values()):
            rows = {"shard (state / world size)": [shard]}
            rows.update({("distfn async (incl. background write)" if n.startswith("distfn async") else n):
                         [v / MIB for v in memory[n]] for n in VARIANTS})
            tabs["memory"] = c.table(
                f"peak extra host memory per rank during a save of {mib:.0f} MiB, {_world(w)} (max over ranks)", "MiB",
                rows, baseline="shard (state / world size)",
                targets=[{"variant": "distfn sharded", "max_value": shard + 64},
                         {"variant": "distfn async (incl. background write)", "max_value": shard + 64}],
                notes={"distfn one file (gather)": "rank 0 holds the whole state",
                       "distfn async (incl. background write)": "until ctx.saves.wait() returned"})
        else:
            notes.append(f"{w} ranks: peak memory not measured (/proc/self/clear_refs cannot reset VmHWM here)")
    if "train" in out:
        tabs["train"] = c.table(
            f"training step, {_world(w)}, saving {args.train_state_mib:.0f} MiB every {args.every} steps "
            f"({args.steps} steps per sample)", "s", out["train"], baseline="no saves",
            targets=[{"variant": "async save every N", "max_ratio": 1.05}],
            notes={"async save every N": "ctx.save(..., blocking=False, keep=2)",
                   "blocking save every N": "ctx.save(..., keep=2)"})
        tabs["train-costs"] = c.table(
            f"one save of {args.train_state_mib:.0f} MiB in the training loop, {_world(w)}: rank 0's time in the "
            "call and its background writer's CPU", "s", out["save_costs"], baseline=SAVE_COSTS[2],
            notes={SAVE_COSTS[1]: "user + system time of the writer thread (time.thread_time), per save"})
    return tabs


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--ranks", default="1,2,4",
                   help="world sizes of the save benchmark, one launch each (default 1,2,4: the scaling curve)")
    p.add_argument("--width", type=int, default=4096, help="save model: Linear width (default 4096)")
    p.add_argument("--layers", type=int, default=6, help="save model: layers (default 6: 1.1 GiB with Adam)")
    p.add_argument("--train-ranks", default="2", help="world sizes of the training loop ('' for none; default 2)")
    p.add_argument("--train-width", type=int, default=1024, help="training model: Linear width (default 1024)")
    p.add_argument("--train-layers", type=int, default=6, help="training model: layers (default 6)")
    p.add_argument("--batch", type=int, default=32, help="training batch rows (default 32)")
    p.add_argument("--steps", type=int, default=60, help="training steps per sample (default 60)")
    p.add_argument("--every", type=int, default=5, help="save every N training steps (default 5: a harsh cadence, "
                   "so that blocking saves cost visibly)")
    p.add_argument("--train-rounds", type=int, default=4,
                   help="interleaved rounds of the training loop (default 4: the default run stays near 8 minutes)")
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.layers, args.rounds, args.train_rounds = 256, 2, 1, 1
        args.train_width, args.train_layers, args.batch, args.steps, args.every = 256, 2, 8, 4, 2
    ranks, train_ranks = _ranks(args.ranks), _ranks(args.train_ranks)
    args.train_state_mib = (args.train_width + 1) * args.train_width * args.train_layers * 12 / MIB
    from distfn import distributed

    by_kind: dict[str, list[dict[str, Any]]] = {"save": [], "async": [], "memory": [], "train": [],
                                                "train-costs": []}
    notes = [f"save model: width {args.width}, {args.layers} layers, {args.rounds} rounds, ranks {args.ranks}; "
             f"training model: width {args.train_width}, {args.train_layers} layers, batch {args.batch}, "
             f"{args.steps} steps, {args.train_rounds} rounds, ranks {args.train_ranks or 'none'}; gloo, CPU",
             "memory: max over ranks of VmHWM - VmRSS around each save, after malloc_trim and a VmHWM reset; an "
             "async save's figure includes what its first run kept in memory (reused host buffers)"]
    scaling: dict[int, tuple[dict[str, list[float]], int]] = {}  # world -> (save seconds, state bytes)
    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    try:
        for w in sorted(set(ranks) | set(train_ranks)):
            c.log(f"== {w} ranks: {'saves' if w in ranks else ''} {'training' if w in train_ranks else ''}")
            job = distributed(mode="fsdp", nprocs=w, seed=0, fsdp={"min_params": 1000})(_job)
            out = job({"width": args.width, "layers": args.layers, "rounds": args.rounds, "dir": str(tmp),
                       "save": w in ranks, "train": w in train_ranks, "train_width": args.train_width,
                       "train_layers": args.train_layers, "batch": args.batch, "steps": args.steps,
                       "every": args.every, "train_rounds": args.train_rounds})
            if "times" in out:
                scaling[w] = (out["times"], out["state_bytes"])
            for kind, tab in _tables(out, args, notes).items():
                by_kind[kind].append(tab)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tables = [tab for kind in by_kind.values() for tab in kind]  # side by side: each question's world sizes
    if scaling:
        tables.append(c.curve_table(
            "sharded save vs ranks: per-rank bandwidth (each rank writes state / world size)",
            {_world(w): times for w, (times, _) in scaling.items()}, ("distfn sharded", "DCP FileSystemWriter"),
            "DCP FileSystemWriter", {"distfn sharded": 1.0},
            {_world(w): total / w for w, (_, total) in scaling.items()},
            "target at every rank count: distfn sharded <= 1.0x DCP FileSystemWriter (the same state and ranks)"))
    c.emit({"benchmark": "sharded", "tables": tables, "notes": notes}, args.json)
    if args.json is None:
        print(json.dumps({t["title"]: {r["variant"]: r["ratio"] for r in t["rows"]} for t in tables}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
