"""GPU figures: launch on GPUs, a save from GPU memory, the time an asynchronous save of GPU state blocks, NCCL hangs.

Run with ``--gpu`` on a machine with NVIDIA GPUs (``bench/gpu_check.sh`` does, one part per step with its own time
limit: ``--only launch``, ``--only save``). Without ``--gpu``, or without CUDA, it measures nothing and exits 0
with a "no CUDA: skipped" note (so ``bench/run.py`` can run it anywhere). ``--rehearse`` runs the same code on the
CPU (gloo, CPU tensors): it checks the plumbing on a machine without a GPU; its figures mean nothing.

* ``launch``: wall time of a whole ``python script.py`` that starts N workers (``min(2, GPUs)``, ``--workers``),
  one per GPU, initialises NCCL, all-reduces a CUDA tensor and exits: distfn (``@distributed(backend="nccl")``, the
  default start method) vs the raw floor, ``torch.multiprocessing`` fork (the launching process never touches
  CUDA, so forking is safe; each worker pins its GPU and passes ``device_id`` to ``init_process_group``), with raw
  spawn beside it. Target: distfn ≤ 1.1× raw fork (the CPU launch target).
* ``save``: one 1-rank distfn job holding a ``--gib`` GiB state of CUDA tensors (64 MiB each) saves it, interleaved
  round by round: ``distfn.checkpoint.save`` (device→host through one reused pinned staging buffer, written in
  chunks, fsync'd) vs safetensors ``save_file`` and ``torch.save`` of the same CUDA tensors, each followed by an
  fsync (what makes a checkpoint survive a crash). Target: distfn ≤ 1.0× ``save_file`` + fsync.
  In the same job and rounds: ``ctx.save(..., blocking=False)``'s blocked time (the device→host copy into reused
  pinned buffers; the write runs in a thread) vs a blocking ``ctx.save``. Target ≤ 0.10×. The first
  asynchronous save, which allocates and pins its buffers, is kept out of the rounds and reported as a note.

* ``hang`` (issue 42; one GPU is enough): three world-1 NCCL jobs (``timeout=10``) made to hang by queueing
  ``torch.cuda._sleep`` of ~5 minutes before the collective (the NCCL stream waits on the current one, and the
  watchdog counts from the enqueue), run side by side: ``number``, ``ctx.all_reduce(1.0)``, which blocks the host
  inside the call (distfn's report expected at about 10 s); ``tensor``, ``ctx.all_reduce`` of a CUDA tensor, which
  returns once queued, then ``torch.cuda.synchronize()`` (the report expected at about 10 s too, from the ledger's
  CUDA event); ``raw``, ``torch.distributed.all_reduce`` of a CUDA tensor, which distfn does not see (no report
  expected). All three then end by NCCL's watchdog; the time of that abort after the collective was queued is
  measured against `distfn.hangs.nccl_abort_after` (10 + 15 + 4 x 15 = 85 s with torch's defaults). Needs CUDA.

Each part stops starting rounds after ``--budget`` seconds (what it has by then is reported), so a slow disk or
a slow NCCL start cannot push ``gpu_check.sh`` past its limit. ``--summary DIR`` writes ``DIR/summary.json``:
every figure of every result JSON in ``DIR`` and every step of ``DIR/steps.txt`` (what ``gpu_check.sh`` runs last).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

PARTS = ("launch", "save", "hang")
SKIPPED = "no CUDA: skipped"
CHUNK = 64 * 2**20  # bytes per tensor of the saved state

SCRIPTS: dict[str, str] = {
    "distfn": """
import sys
import torch
import torch.distributed as dist
from distfn import distributed

N, BACKEND = int(sys.argv[1]), sys.argv[2]

@distributed(nprocs=N, backend=BACKEND)
def job(cfg, ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return t.item()

if __name__ == "__main__":
    print("OK", job(None))
""",
    "raw": """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, n, port, backend):
    if backend == "nccl":  # the usual recipe: pin the GPU first, then NCCL bound to it
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    value = t.item()
    if rank == 0:
        print("OK", value, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    n, port, method, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # the launching process imports torch but never initialises CUDA: fork is safe
    mp.start_processes(worker, args=(n, port, backend), nprocs=n, start_method=method)
""",
}


def rounds_within(variants: dict[str, Callable[[], float]], rounds: int, budget: float) -> dict[str, list[float]]:
    """`_common.interleave` round by round (the order rotated each round), no new round after ``budget`` s."""
    names, samples = list(variants), {n: [] for n in variants}
    start = time.monotonic()
    for r in range(rounds):
        if r and time.monotonic() - start > budget:
            c.log(f"  budget of {budget:.0f} s spent after {r} round(s)")
            break
        order = names[r % len(names):] + names[:r % len(names)]
        for name, values in c.interleave({n: variants[n] for n in order}, 1, c.log).items():
            samples[name] += values
    return samples


# -- launch -----------------------------------------------------------------------------------------------------
def launch_tables(workers: int, backend: str, rounds: int, budget: float, tmp: Path) -> list[dict[str, Any]]:
    for name, text in SCRIPTS.items():
        (tmp / f"launch_{name}.py").write_text(text)
    env = c.clean_env()
    expect = f"OK {float(workers)}"

    def run(name: str, *args: str) -> float:
        return c.timed_run([sys.executable, str(tmp / f"launch_{name}.py"), str(workers), *args], env=env,
                           expect=expect, timeout=120)

    variants = {
        "raw fork": lambda: run("raw", str(c.free_port()), "fork", backend),
        "distfn": lambda: run("distfn", backend),
        "raw spawn": lambda: run("raw", str(c.free_port()), "spawn", backend),
    }
    c.log(f"gpu launch: {workers} worker(s), {backend}; at most {rounds} round(s) within {budget:.0f} s")
    samples = rounds_within(variants, rounds, budget)
    where = f"{workers} worker(s), {backend}" + (", one per GPU" if backend == "nccl" else " (rehearsal on CPU)")
    return [c.table(f"Launch on GPUs: whole python script.py, {where}, one all_reduce", "s", samples,
                    baseline="raw fork", targets=[{"variant": "distfn", "max_ratio": 1.1}],
                    notes={"raw fork": "the floor: torch imported once", "distfn": "default start method"})]


# -- save -------------------------------------------------------------------------------------------------------
def save_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """The save variants on a state of CUDA tensors (CPU ones in a rehearsal), interleaved; seconds per save."""
    import torch
    from safetensors.torch import save_file

    import distfn.checkpoint as ckpt

    device = torch.device(cfg["device"])
    numel = cfg["chunk"] // 4
    state = {f"w{i}": torch.full((numel,), float(i), device=device) for i in range(cfg["tensors"])}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    directory = Path(cfg["dir"])
    blocked: list[float] = []

    def timed(name: str, save: Callable[[str], None]) -> Callable[[], float]:
        def sample() -> float:
            path = str(directory / f"{name}.safetensors")
            sync()
            start = time.perf_counter()
            save(path)
            elapsed = time.perf_counter() - start
            os.remove(path)
            return elapsed

        return sample

    def torch_save(path: str) -> None:
        torch.save(state, path)
        c.fsync_path(path)

    def st_save(path: str) -> None:
        save_file(state, path)
        c.fsync_path(path)

    def async_save(path: str) -> None:
        start = time.perf_counter()
        ctx.save(state, path, blocking=False)
        blocked.append(time.perf_counter() - start)
        ctx.saves.wait()

    def async_blocked() -> float:
        timed("async", async_save)()
        return blocked[-1]

    first = time.perf_counter()  # the first asynchronous save allocates and pins its buffers: not a round
    ctx.save(state, str(directory / "first.safetensors"), blocking=False)
    first_blocked = time.perf_counter() - first
    ctx.saves.wait()
    os.remove(directory / "first.safetensors")
    variants = {
        "save_file+fsync": timed("save_file", st_save),
        "distfn.checkpoint.save": timed("distfn", lambda p: ckpt.save(state, p)),
        "torch.save+fsync": timed("torch_save", torch_save),
        "ctx.save (blocking)": timed("ctx_blocking", lambda p: ctx.save(state, p)),
        "ctx.save(blocking=False), blocked": async_blocked,
    }
    samples = rounds_within(variants, cfg["rounds"], cfg["budget"])
    written = ckpt.load(str(ckpt.save(state, directory / "check.safetensors")), device="cpu")
    intact = all(torch.equal(written[k], state[k].cpu()) for k in state)
    # the host buffers the last asynchronous save used (private: a benchmark's check of the pinned staging)
    buffers = [b for bufs in ctx.saves.buffers._used.values() for b in bufs]
    pinned = bool(buffers) and all(b.is_pinned() for b in buffers) if device.type == "cuda" else None
    return {"samples": samples, "first_blocked": first_blocked, "intact": intact, "pinned": pinned}


def save_tables(gib: float, rounds: int, budget: float, rehearse: bool, tiny: bool) -> tuple[list[dict[str, Any]],
                                                                                             list[str], bool]:
    from distfn import distributed

    chunk = 4 * 2**20 if tiny else CHUNK
    tensors = max(1, round(gib * 2**30 / chunk))
    size = tensors * chunk
    amount = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
    with tempfile.TemporaryDirectory(prefix="distfn-bench-gpu-") as tmp:
        cfg = {"device": "cpu" if rehearse else "cuda", "chunk": chunk, "tensors": tensors, "dir": tmp,
               "rounds": rounds, "budget": budget}
        c.log(f"gpu save: {amount} in {tensors} tensors on {cfg['device']}; at most {rounds} "
              f"round(s) within {budget:.0f} s, in {tmp}")
        out = distributed(nprocs=1, backend="gloo" if rehearse else None)(save_job)(cfg)
    samples = out["samples"]
    on = "CPU (rehearsal)" if rehearse else "GPU"
    save_rows = ("save_file+fsync", "distfn.checkpoint.save", "torch.save+fsync")
    gbps = {n: f"{size / 1e9 / min(v):.2f} GB/s at best" for n, v in samples.items() if v}
    saves = c.table(f"Save from {on} memory: {amount} of tensors, to a file, durable", "s",
                    {n: samples[n] for n in save_rows}, baseline="save_file+fsync",
                    targets=[{"variant": "distfn.checkpoint.save", "max_ratio": 1.0}],
                    notes={**{n: gbps.get(n, "") for n in save_rows},
                           "distfn.checkpoint.save": "pinned staging buffer, chunked; " + gbps.get(
                               "distfn.checkpoint.save", "")})
    blocked = c.table(f"Asynchronous save of {on} state: time training is blocked, {amount}", "s",
                      {n: samples[n] for n in ("ctx.save (blocking)", "ctx.save(blocking=False), blocked")},
                      baseline="ctx.save (blocking)",
                      targets=[{"variant": "ctx.save(blocking=False), blocked", "max_ratio": 0.10}],
                      notes={"ctx.save(blocking=False), blocked": "device→host copy into reused pinned buffers"})
    notes = [f"first asynchronous save (allocates and pins its buffers): blocked {out['first_blocked']:.3f} s",
             f"host buffers of the asynchronous saves pinned: {out['pinned']}",
             f"state written and read back intact: {out['intact']}"]
    return [saves, blocked], notes, bool(out["intact"])


# -- hang -------------------------------------------------------------------------------------------------------
HANG = """
import sys
import time
import torch
from distfn import distributed

VARIANT, TIMEOUT = sys.argv[1], float(sys.argv[2])

@distributed(nprocs=1, backend="nccl", timeout=TIMEOUT)
def job(cfg, ctx):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    per_s = 1e8 / (start.elapsed_time(end) / 1000)  # the GPU's cycles per second, measured
    print("T0", time.time(), flush=True)
    torch.cuda._sleep(int(per_s * 300))  # ~5 minutes of GPU work queued before the collective
    if VARIANT == "number":
        ctx.all_reduce(1.0)  # blocks the host in .tolist(): distfn's deadline sees it
    elif VARIANT == "tensor":
        ctx.all_reduce(torch.ones(1, device=ctx.device))  # returns once queued: the ledger's CUDA event sees it
        torch.cuda.synchronize()  # the rank waits here, outside any distfn call
    else:
        torch.distributed.all_reduce(torch.ones(1, device=ctx.device))  # not seen by distfn
        torch.cuda.synchronize()
    print("FINISHED", time.time(), flush=True)

if __name__ == "__main__":
    job(None)
"""
REPORT_LINE = "did not finish within the timeout of"


def _watch(cmd: list[str], env: dict[str, str], limit: float) -> dict[str, Any]:
    """Run ``cmd``, stamping each output line as it arrives: T0 (the script's), the report line's time, the end."""
    import subprocess
    import threading

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, Any] = {"t0": None, "report": None, "finished": None, "tail": []}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time()
            if line.startswith("T0 "):
                seen["t0"] = float(line.split()[1])
            elif line.startswith("FINISHED "):
                seen["finished"] = now
            elif REPORT_LINE in line and seen["report"] is None:
                seen["report"] = now
            seen["tail"] = [*seen["tail"][-30:], line.rstrip()[:400]]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        seen["killed"] = True
    seen["end"], seen["rc"] = time.time(), rc
    reader.join(5)
    return seen


def hang_tables(tmp: Path, timeout: float = 10.0, limit: float = 105.0) -> tuple[list[dict[str, Any]], list[str],
                                                                                  bool]:
    import concurrent.futures

    from distfn.hangs import nccl_abort_after

    script = tmp / "hang_nccl.py"
    script.write_text(HANG)
    env = c.clean_env()
    after = nccl_abort_after(env)
    expected = None if after is None else timeout + after
    c.log(f"gpu hang: three world-1 NCCL jobs, timeout {timeout:g} s; NCCL's abort expected at "
          f"{expected if expected is not None else 'never'} s after the enqueue")
    variants = ("number", "tensor", "raw")
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        runs = dict(zip(variants, pool.map(
            lambda v: _watch([sys.executable, str(script), v, str(timeout)], env, limit), variants), strict=True))
    samples: dict[str, list[float]] = {}
    notes, ok = [], True
    for variant, run in runs.items():
        t0 = run["t0"]
        if t0 is None:
            notes.append(f"hang {variant}: the job never started its collective (exit {run['rc']}): "
                         + " | ".join(run["tail"][-8:]))
            ok = False
            continue
        if run["report"] is not None:
            samples[f"{variant}: distfn's report"] = [run["report"] - t0]
        samples[f"{variant}: process end (NCCL abort)"] = [run["end"] - t0]
        notes.append(f"hang {variant}: exit {run['rc']} ({'SIGABRT' if run['rc'] == -6 else 'not SIGABRT'})"
                     f"{', killed at the limit' if run.get('killed') else ''}; distfn report "
                     f"{'at %.1f s' % (run['report'] - t0) if run['report'] else 'none'}; end at "
                     f"{run['end'] - t0:.1f} s; last lines: " + " | ".join(run["tail"][-4:]))
        ok = ok and run["finished"] is None and not run.get("killed")
    ok = (ok and "number: distfn's report" in samples and "tensor: distfn's report" in samples
          and "raw: distfn's report" not in samples)
    targets = [{"variant": f"{v}: distfn's report", "max_value": timeout + 6.0} for v in ("number", "tensor")]
    if expected is not None:
        targets += [{"variant": f"{v}: process end (NCCL abort)", "max_value": expected + 10.0} for v in variants]
    title = (f"NCCL hang on one GPU (world 1, timeout={timeout:g} s, collective queued behind torch.cuda._sleep): "
             f"seconds after the enqueue; NCCL's abort expected at {expected} s (distfn.hangs.nccl_abort_after)")
    return [c.table(title, "s", samples, baseline=None, targets=targets)], notes, ok


# -- summary ----------------------------------------------------------------------------------------------------
def summarize(directory: Path) -> dict[str, Any]:
    """Every figure of every result JSON in ``directory`` (and every step of its ``steps.txt``), in one dict."""
    figures, steps = [], []
    for path in sorted(directory.glob("*.json")):
        if path.name == "summary.json":
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            figures.append({"file": path.name, "error": f"unreadable: {exc}"})
            continue
        for tab in result.get("tables", []):
            goals = {t["variant"]: t for t in tab.get("targets", [])}
            for row in tab["rows"]:
                goal = goals.get(row["variant"], {})
                figures.append({"file": path.name, "benchmark": result.get("benchmark"), "table": tab["title"],
                                "variant": row["variant"], "median": row["median"], "unit": tab["unit"],
                                "runs": len(row["samples"]), "ratio": row.get("ratio"),
                                "baseline": tab.get("baseline"),
                                "target": {k: goal[k] for k in ("max_ratio", "max_value") if k in goal} or None,
                                "met": goal.get("met")})
        for note in result.get("notes", []):
            figures.append({"file": path.name, "benchmark": result.get("benchmark"), "note": note})
    steps_file = directory / "steps.txt"
    for line in steps_file.read_text().splitlines() if steps_file.exists() else []:
        name, rc, seconds = line.split()[:3]
        steps.append({"step": name, "exit": int(rc), "seconds": int(seconds)})
    return {"steps": steps, "figures": figures, "all_steps_passed": all(s["exit"] == 0 for s in steps),
            "all_targets_met": all(f.get("met") is not False for f in figures)}


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--gpu", action="store_true", help="measure on CUDA (required: without it nothing runs)")
    p.add_argument("--rehearse", action="store_true", help="the same code on the CPU (gloo): plumbing only")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts, comma-separated ({', '.join(PARTS)})")
    p.add_argument("--workers", type=int, default=None, help="launch: workers (default min(2, GPUs))")
    p.add_argument("--gib", type=float, default=1.0, help="save: GiB of state")
    p.add_argument("--budget", type=float, default=40.0, help="seconds per part after which no round starts")
    p.add_argument("--summary", type=Path, default=None, help="write DIR/summary.json from DIR's results, exit")
    args = p.parse_args(argv)
    if args.summary is not None:
        result = summarize(args.summary)
        (args.summary / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"{len(result['figures'])} figure(s), {len(result['steps'])} step(s) -> {args.summary}/summary.json")
        return 0
    parts = [x for x in args.only.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    if args.tiny:
        args.rounds, args.gib, args.budget = 1, 0.0, 30.0
    import torch

    gpus = torch.cuda.device_count()  # NVML count: this process stays fork-safe
    if not args.rehearse and (not args.gpu or gpus == 0):
        why = SKIPPED if gpus == 0 else "CUDA is visible but --gpu was not passed: skipped"
        c.log(why)
        c.emit({"benchmark": "gpu", "tables": [], "skipped": True, "notes": [why]}, args.json)
        return 0
    workers = args.workers or (2 if args.rehearse else max(1, min(2, gpus)))
    tables, notes, ok = [], [], True
    with tempfile.TemporaryDirectory(prefix="distfn-bench-gpu-launch-") as tmp:
        if "launch" in parts:
            c.warm_bytecode()
            tables += launch_tables(workers, "gloo" if args.rehearse else "nccl", args.rounds, args.budget, Path(tmp))
    if "save" in parts:
        save, save_notes, ok = save_tables(args.gib, args.rounds, args.budget, args.rehearse, args.tiny)
        tables += save
        notes += save_notes
    if "hang" in parts and args.rehearse:
        notes.append("hang: needs NCCL on a GPU, not rehearsed on the CPU")
    elif "hang" in parts:
        with tempfile.TemporaryDirectory(prefix="distfn-bench-gpu-hang-") as tmp:
            hang, hang_notes, hang_ok = hang_tables(Path(tmp))
        tables += hang
        notes += hang_notes
        ok = ok and hang_ok
    if args.rehearse:
        notes.append("rehearsal on the CPU: the code paths ran, the figures mean nothing for a GPU")
    c.emit({"benchmark": "gpu", "tables": tables, "skipped": False, "rehearsal": args.rehearse, "gpus": gpus,
            "notes": notes}, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
