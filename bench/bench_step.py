"""Step overhead: median time of one DDP training step through distfn vs the same loop hand-written (and, when
``--peers-python`` has them, through Lightning Fabric and Accelerate).

Both variants run the identical loop (same model, same seeded init, same per-rank data, same thread budget, same
loopback interface) on 2 ranks with gloo, each in a fresh ``python`` process per round, interleaved. The first
``--warmup`` steps are dropped; a round's sample is rank 0's median step time. The final weights of every run must be
bit-identical across variants and rounds (Lightning's parity-test design). Target: ratio ≤ 1.01.

``--gpu``: the same comparison on CUDA over NCCL, one rank per GPU (``min(2, GPUs)`` ranks), for distfn and the
hand-written loop only (what ``bench/gpu_check.sh`` runs on the first machine with a GPU).

The "distfn, no step hooks" row is distfn with its per-step Python hooks off: the hang report's DDP step counter
(`distfn.ledger`, taken off the wrapped model) and the step accounting (`distfn.timings`, ``DISTFN_TIMINGS=0``):
their share of the step time; what is left between it and the hand-written loop is not per-step work of distfn's.
The notes add the ledger's cost per collective (one entry recorded, measured in this process).

The "distfn, ctx.step" rows step through ``ctx.backward`` / ``ctx.step``, with and without the RNG snapshot each
``ctx.step`` takes for exact resume (``DISTFN_RNG_CAPTURE=0``; issue 43, target ratio <= 1.01); their runs end with
five ``ctx.save`` calls on rank 0 alone, whose time (every rank's streams fetched from the store, or none) is in
the notes, with the snapshot's own cost per step measured in this process.

Separate runs per variant leave the on/off ratio at the mercy of a shared machine's load (a 0.5% effect under
swings of several percent), so a second table compares them inside each run: ``--capture-steps`` steps of
``ctx.step`` with the capture switched on and off in alternate blocks of `BLOCK` steps (every rank alike), one
sample per round for each half (rank 0's median step), and the capture itself (one ``Boundaries.mark`` call)
timed at every step of the same runs; the notes give the paired ratio (each run's on / off, median over rounds)
and the capture's time as a share of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2
SEED = 0


def make_model(width: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def train_loop(model: Any, rank: int, cfg: dict[str, int], prepare: Any = None, backward: Any = None,
               step: Any = None) -> list[float]:
    """The loop every variant runs; returns the wall time of every step.

    ``prepare(model, optimizer) -> (model, optimizer)`` and ``backward(loss)`` are the peers' hooks
    (``fabric.setup`` / ``fabric.backward``, ``accelerator.prepare`` / ``accelerator.backward``); ``step(opt)``
    replaces ``opt.step()`` (distfn's ``ctx.step``, which also sets the gradients to None).
    """
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if prepare is not None:
        model, opt = prepare(model, opt)
    backward = backward or torch.Tensor.backward
    g = torch.Generator().manual_seed(1000 + rank)
    device = next(model.parameters()).device
    xs = torch.randn(cfg["steps"], cfg["batch"], 256, generator=g).to(device)
    ys = torch.randint(0, 10, (cfg["steps"], cfg["batch"]), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time the GPU's work too
    times = []
    for i in range(cfg["steps"]):
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        backward(F.cross_entropy(model(xs[i]), ys[i]))
        if step is None:
            opt.step()
        else:
            step(opt)
        sync()
        times.append(time.perf_counter() - start)
    return times


def _write(out: str, times: list[float], module: Any) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()},
              os.path.join(out, "weights.safetensors"))
    Path(out, "times.json").write_text(json.dumps(times))


# -- variant 1: distfn ------------------------------------------------------------------------------------------
def distfn_job(cfg: dict[str, Any], ctx: Any) -> None:
    model = ctx.wrap(make_model(cfg["width"]))
    if cfg.get("no_hooks"):
        # with DISTFN_TIMINGS=0 (set by _round), the ledger's DDP step counter is the only hook distfn puts there
        model._forward_pre_hooks.clear()
    if not cfg.get("ctx_step"):
        times = train_loop(model, ctx.rank, cfg)
    else:  # ctx.backward / ctx.step: the step boundary where every rank snapshots its generators (issue 43)
        import torch

        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        record: dict[str, list[Any]] = {}
        # capture on and off in alternate blocks of steps, the capture itself timed
        step = _alternating(ctx, record) if cfg.get("alternate") else ctx.step
        times = train_loop(model, ctx.rank, cfg, prepare=lambda m, _: (m, opt), backward=ctx.backward,
                           step=step)
        if record and ctx.is_main:
            Path(cfg["out"], "capture.json").write_text(json.dumps(record))
        if ctx.is_main and not record:  # the save on rank 0 alone, which fetches every rank's streams of the last
            # ctx.step (not in the alternating runs, which only compare steps)
            saves = []
            for i in range(5):
                start = time.perf_counter()
                ctx.save({"model": model, "optimizer": opt, "step": i},
                         os.path.join(cfg["out"], f"ckpt-{i}.safetensors"))
                saves.append(time.perf_counter() - start)
            Path(cfg["out"], "saves.json").write_text(json.dumps(saves))
        ctx.barrier()
    if ctx.is_main:
        _write(cfg["out"], times, ctx.unwrap(model))


BLOCK = 4  # steps per block of the in-process capture on/off comparison


def _alternating(ctx: Any, record: dict[str, list[Any]]) -> Any:
    """``ctx.step`` with the RNG capture switched on for the steps of even blocks (`BLOCK` steps each) and off for
    the others, on every rank alike (the boundary count stays the same on every rank); the capture itself
    (`distfn.boundary.Boundaries.mark`) is timed at every call. ``record`` gets ``"on"`` (per step) and
    ``"mark"`` (seconds per call).

    The same process, model, memory and neighbours for both halves, interleaved every few steps: a shared
    machine's load drifts over seconds and hits both halves alike, which separate runs per variant cannot promise.
    """
    marks = ctx.run.boundaries
    real = marks.mark
    on, spent = record.setdefault("on", []), record.setdefault("mark", [])

    def timed(per_rank: Any = None) -> None:
        start = time.perf_counter()
        real(per_rank)
        spent.append(time.perf_counter() - start)

    marks.mark = timed

    def step(opt: Any) -> None:
        marks.enabled = (len(on) // BLOCK) % 2 == 0
        on.append(marks.enabled)
        ctx.step(opt)

    return step


# -- variant 2: hand-written DDP, the usual recipe ----------------------------------------------------------
def handwritten_worker(rank: int, port: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = cfg["world"]
    # the same thread budget distfn gives each of the node's processes (cpus // processes), so the comparison
    # is of the loop, not of oversubscription
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    # and the same network path: distfn's self-spawned ranks talk over the loopback interface
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cfg["gpu"]:  # the usual recipe: pin the device first, then NCCL
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        torch.manual_seed(SEED)
        model = DDP(make_model(cfg["width"]).cuda(rank), device_ids=[rank])
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(SEED)
        model = DDP(make_model(cfg["width"]))
    times = train_loop(model, rank, cfg)
    if rank == 0:
        _write(cfg["out"], times, model.module)
    dist.destroy_process_group()


# -- peers (only when --peers-python can import them) -------------------------------------------------------------
def _same_budget() -> None:
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // WORLD))


def fabric_main(cfg: dict[str, Any]) -> None:
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    fabric.launch()  # re-runs this command line for the other rank
    _same_budget()
    torch.manual_seed(SEED)
    bare = make_model(cfg["width"])
    times = train_loop(bare, fabric.global_rank, cfg, prepare=fabric.setup, backward=fabric.backward)
    if fabric.global_rank == 0:
        _write(cfg["out"], times, bare)


def accelerate_job(cfg: dict[str, Any]) -> None:
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    _same_budget()
    torch.manual_seed(SEED)
    bare = make_model(cfg["width"])
    times = train_loop(bare, acc.process_index, cfg, prepare=acc.prepare, backward=acc.backward)
    if acc.is_main_process:
        _write(cfg["out"], times, bare)


PEERS = {"fabric": "lightning.fabric", "accelerate": "accelerate"}


def _worker_main(kind: str, cfg: dict[str, Any]) -> None:
    if kind == "fabric":
        fabric_main(cfg)
    elif kind == "accelerate":
        from accelerate import notebook_launcher

        notebook_launcher(accelerate_job, args=(cfg,), num_processes=WORLD)
    elif kind in ("distfn", "distfn-no-hooks", "distfn-ctx-step", "distfn-ctx-step-no-capture", ALTERNATING):
        from distfn import distributed

        backend = "nccl" if cfg["gpu"] else "gloo"
        distributed(nprocs=cfg["world"], seed=SEED, backend=backend)(distfn_job)(
            {**cfg, "no_hooks": kind == "distfn-no-hooks", "ctx_step": kind.startswith("distfn-ctx-step"),
             "alternate": kind == ALTERNATING})
    else:
        import torch.multiprocessing as mp

        # fork is the fastest raw start on CPU; CUDA needs spawn (the launching process never touches CUDA)
        mp.start_processes(handwritten_worker, args=(c.free_port(), cfg), nprocs=cfg["world"],
                           start_method="spawn" if cfg["gpu"] else "fork")


# -- harness ----------------------------------------------------------------------------------------------------
def _round(kind: str, cfg: dict[str, Any], runs: list[Path], warmup: int, python: str = sys.executable) -> float:
    import statistics

    out = Path(tempfile.mkdtemp(prefix=f"step-{kind}-", dir=cfg["tmp"]))
    # every variant's ranks talk over loopback, as distfn's self-spawned ones do
    extra = {"DISTFN_TIMINGS": "0"} if kind == "distfn-no-hooks" else {}
    if kind == "distfn-ctx-step-no-capture":
        extra = {"DISTFN_RNG_CAPTURE": "0"}
    c.timed_run([python, __file__, "--worker", kind, "--cfg", json.dumps({**cfg, "out": str(out)})],
                env=c.clean_env(GLOO_SOCKET_IFNAME="lo", **extra), timeout=600)
    runs.append(out)
    if (out / "saves.json").exists():
        _SAVES.setdefault(kind, []).extend(json.loads((out / "saves.json").read_text()))
    times = json.loads((out / "times.json").read_text())
    if kind == ALTERNATING:  # one sample per half of this run: the median step with the capture on, and off
        record = json.loads((out / "capture.json").read_text())
        kept = list(zip(record["on"], times, record["mark"], strict=True))[warmup:]
        for name, on in (("capture on", True), ("capture off", False)):
            _CAPTURE[name].append(statistics.median(t for o, t, _ in kept if o is on))
        _CAPTURE["the capture itself (timed in the same runs)"].append(
            statistics.median(m for o, _, m in kept if o))
    return statistics.median(times[warmup:])


_SAVES: dict[str, list[float]] = {}  # ctx.save on rank 0 alone, per variant (seconds)
ALTERNATING = "distfn-ctx-step-alternating"
ALTERNATING_ROW = "distfn, ctx.step, capture on/off alternating"  # progress lines only: it has its own table
#: The in-process comparison's samples (seconds), one per round: rank 0's median step with the capture on and off,
#: and the median time of the capture itself (one ``Boundaries.mark`` call) on its steps.
_CAPTURE: dict[str, list[float]] = {"capture on": [], "capture off": [],
                                    "the capture itself (timed in the same runs)": []}


def _capture_cost(n: int = 20_000) -> str:
    """One step boundary's snapshot of the generators (`distfn.boundary.Boundaries.mark`), in microseconds."""
    from distfn.boundary import Boundaries

    marks = Boundaries(enabled=True)
    start = time.perf_counter()
    for _ in range(n):
        marks.mark()
    return f"RNG capture at ctx.step: {(time.perf_counter() - start) / n * 1e6:.1f} us per step boundary"


def _capture_table(args: Any) -> tuple[dict[str, Any], str]:
    """The in-process comparison (issue 43's target: capture on / off <= 1.01x), with the capture's own time."""
    import statistics

    on, off, own = (_CAPTURE[k] for k in _CAPTURE)
    mark = f"one Boundaries.mark call, median per run: {statistics.median(own) * 1e6:.1f} us"
    tab = c.table(f"RNG capture at ctx.step, on vs off within each run (alternate blocks of {BLOCK} steps, "
                  f"{args.capture_steps} steps per run; rank 0's median step per half, one sample per round)", "s",
                  _CAPTURE, baseline="capture off", targets=[{"variant": "capture on", "max_ratio": 1.01}],
                  notes={"the capture itself (timed in the same runs)": mark})
    paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
    share = statistics.median(m / b for m, b in zip(own, off, strict=True))
    tab["paired_ratio"], tab["capture_share"] = paired, share  # in the JSON; the note says it in words
    return tab, (f"RNG capture, in-process comparison: paired ratio (each run's on / off, median over runs) "
                 f"{paired:.4f}x; the capture's own time is {share * 100:.2f}% of a step (median over runs of its "
                 "median / the run's capture-off step)")


def _save_cost() -> list[str]:
    import statistics

    said = {"distfn-ctx-step": "with every rank's streams fetched from the store",
            "distfn-ctx-step-no-capture": "without streams (DISTFN_RNG_CAPTURE=0)"}
    return [f"ctx.save on rank 0 alone, {said[k]}: median {statistics.median(v) * 1e3:.1f} ms ({len(v)} saves)"
            for k, v in _SAVES.items()]


def _ledger_cost(n: int = 100_000) -> str:
    """The ledger's cost per collective: recording one entry (``LEDGER.entered``), in microseconds."""
    from distfn.ledger import Ledger

    book = Ledger()
    start = time.perf_counter()
    for _ in range(n):
        with book.entered("all_reduce"):
            pass
    return f"ledger: {(time.perf_counter() - start) / n * 1e6:.2f} us per collective recorded"


def _importable(python: str, module: str) -> bool:
    code = f"import importlib.util as u, sys; sys.exit(0 if u.find_spec({module.split('.')[0]!r}) else 1)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


def _identical(runs: dict[str, list[Path]]) -> tuple[bool, str]:
    import torch
    from safetensors.torch import load_file

    all_runs = [(k, p) for k, ps in runs.items() for p in ps]
    if not all_runs:
        return False, "no run finished"
    ref_name, ref_path = all_runs[0]
    ref = load_file(ref_path / "weights.safetensors")
    for name, path in all_runs[1:]:
        other = load_file(path / "weights.safetensors")
        if other.keys() != ref.keys() or not all(torch.equal(ref[k], other[k]) for k in ref):
            return False, f"final weights of a {name} run differ from a {ref_name} run"
    return True, f"final weights bit-identical across all {len(all_runs)} runs"


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=15)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--peers-python", default=sys.executable,
                   help="interpreter with lightning / accelerate installed (their loops join the table)")
    p.add_argument("--gpu", action="store_true", help="on CUDA over NCCL, one rank per GPU (at most 2); no peers")
    p.add_argument("--capture-steps", type=int, default=400,
                   help="steps of each run of the in-process capture on/off comparison (default 400: 50 blocks of "
                        f"{BLOCK} steps with the capture on, as many with it off)")
    p.add_argument("--worker", choices=("distfn", "distfn-no-hooks", "distfn-ctx-step", "distfn-ctx-step-no-capture",
                                        ALTERNATING, "handwritten", *PEERS), help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker_main(args.worker, json.loads(args.cfg))
        return 0
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.width, args.capture_steps = 1, 6, 2, 64, 2 * BLOCK + 4
    with tempfile.TemporaryDirectory(prefix="distfn-bench-step-") as tmp:
        world = WORLD
        if args.gpu:
            import torch

            world = min(WORLD, torch.cuda.device_count())  # NVML count: this process stays fork-safe
            if world == 0:
                p.error("--gpu: no CUDA GPU is visible")
        cfg = {"steps": args.steps, "batch": args.batch, "width": args.width, "tmp": tmp, "gpu": args.gpu,
               "world": world}
        runs: dict[str, list[Path]] = {"distfn": [], "hand-written DDP": [], "distfn, no step hooks": [],
                                       "distfn, ctx.step": [], "distfn, ctx.step, no RNG capture": []}
        variants = {
            "hand-written DDP": lambda: _round("handwritten", cfg, runs["hand-written DDP"], args.warmup),
            "distfn": lambda: _round("distfn", cfg, runs["distfn"], args.warmup),
            "distfn, no step hooks": lambda: _round("distfn-no-hooks", cfg, runs["distfn, no step hooks"],
                                                    args.warmup),
        }
        if not args.gpu:  # issue 43: the RNG snapshot each ctx.step takes, on and off (target: on / off <= 1.01);
            # not in --gpu, whose time is budgeted in bench/gpu_check.sh
            variants["distfn, ctx.step"] = lambda: _round("distfn-ctx-step", cfg, runs["distfn, ctx.step"],
                                                          args.warmup)
            variants["distfn, ctx.step, no RNG capture"] = lambda: _round(
                "distfn-ctx-step-no-capture", cfg, runs["distfn, ctx.step, no RNG capture"], args.warmup)
            # the same comparison inside each run, capture on and off every BLOCK steps (its own table); its
            # weights differ from the others' (other steps snapshot), so they are not compared
            variants[ALTERNATING_ROW] = lambda: _round(ALTERNATING, {**cfg, "steps": args.capture_steps}, [],
                                                   args.warmup)
        peer_runs: dict[str, list[Path]] = {}
        for kind, module in ([] if args.tiny or args.gpu else PEERS.items()):
            if _importable(args.peers_python, module):
                c.warm_bytecode(args.peers_python, ("torch", module))
                name = {"fabric": "lightning fabric (ddp)", "accelerate": "accelerate"}[kind]
                peer_runs[name] = []
                variants[name] = (lambda kind=kind, name=name:
                                  _round(kind, cfg, peer_runs[name], args.warmup, args.peers_python))
        c.log(f"step: {', '.join(variants)}; {args.rounds} round(s) of {args.steps} steps")
        samples = c.interleave(variants, args.rounds, c.log)
        samples.pop(ALTERNATING_ROW, None)
        same, how = _identical(runs)
        peers_same = [f"{name}: {'bit-identical to' if _identical({**runs, name: ps})[0] else 'different from'} "
                      f"distfn's final weights" for name, ps in peer_runs.items() if ps]
    where = f"{world} rank(s) (nccl, GPU)" if args.gpu else f"{world} ranks (gloo, CPU)"
    tab = c.table(f"Step time: DDP, {where}, MLP 256-{args.width}-{args.width}-10, batch "
                  f"{args.batch}/rank, median of steps {args.warmup + 1}..{args.steps}", "s", samples,
                  baseline="hand-written DDP", targets=[{"variant": "distfn", "max_ratio": 1.01}])
    tab["identical_weights"] = same
    notes = [how, *peers_same, _ledger_cost(), _capture_cost(), *_save_cost()]
    on, off = samples.get("distfn, ctx.step", []), samples.get("distfn, ctx.step, no RNG capture", [])
    if on and off:
        import statistics

        notes.append(f"RNG capture on / off: {statistics.median(on) / statistics.median(off):.3f}x (target <= 1.01)")
    hand, ours = samples["hand-written DDP"], samples["distfn"]
    if len(hand) == len(ours) == args.rounds and args.rounds > 1:
        import statistics

        # each round ran both variants back to back: the ratio within a round is immune to slow drifts of a
        # shared machine's load, which the ratio of the two medians is not
        paired = statistics.median(o / h for o, h in zip(ours, hand, strict=True))
        tab["paired_ratio"] = paired  # in the JSON only: the page shows one ratio per target, the summary's
    tables = [tab]
    if _CAPTURE["capture on"]:
        capture, said = _capture_table(args)
        tables.append(capture)
        notes.append(said)
    c.emit({"benchmark": "step", "tables": tables, "identical_weights": same, "notes": notes}, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
