"""Benchmark distfn checkpoints against torch.save, safetensors and the raw disk (dd), in one run.

What is measured (float32 tensors, ``--size-mib`` in total, split into ``--tensors`` tensors):

* **save, as users meet it**: every variant runs in its **own fresh process** that first computes its tensors
  (the same ``make_state`` for all), then, after ``os.sync()``, times its **first save**, then ``--repeat``
  more saves in the same process (each after ``os.sync()``). Variants: ``distfn.checkpoint.save`` (durable:
  fsync of file and directory, atomic rename), ``safetensors.torch.save_file`` + fsync, ``torch.save`` + fsync,
  and ``dd bs=1M conv=fdatasync`` copying the same bytes (the checkpoint file, read into the page cache by the
  child before timing): the raw disk floor. The processes are interleaved over ``--rounds`` rounds (the order
  rotates each round); medians and the spread (min-max) are reported.
* **save and load vs size** (``--sizes``, default 64 MiB, 256 MiB, 1 GiB, 4 GiB; ``--curve-rounds`` interleaved
  rounds up to 1 GiB, proportionally fewer above: one at 4 GiB): in this process, ``distfn.save`` and
  ``save_file`` + fsync beside ``dd`` + fdatasync of the same bytes (each after ``os.sync()``), and ``distfn.load``
  beside ``load_file`` (warm page cache, every page touched); one table per curve with each size's ratio to its
  floor at that size and the bandwidth in GB/s.
* **peak extra RSS** during each save, measured in a child process: ``VmHWM`` after the save minus
  ``VmRSS`` before it (the high-water mark is reset through ``/proc/self/clear_refs``; where that is not
  allowed, RSS is sampled every millisecond instead).
* **load** (page cache warm): ``distfn.checkpoint.load`` against ``safetensors.torch.load_file`` and
  ``torch.load(weights_only=True)``, both as returned (memory-mapped loaders are lazy) and including a touch
  of every page of every tensor, which is what using the tensors costs.
* **a model's file** (page cache warm): a transformer-like state dict of 288 small tensors (2-d weights, 1-d
  biases and norms, 72 MiB), ``distfn.load`` vs ``load_file`` with every page touched: the per-tensor cost
  (header entries checked, tensors built) that a few large tensors hide.

Targets from the checkpoint issues: first save <= 1.3x ``dd`` + fdatasync of the same bytes and never slower than
``save_file`` + fsync, peak extra RSS <= largest tensor + 64 MiB, load (with touch) at least as fast as
``load_file`` (a 5 % noise margin applies), for the model's file too; at every size of the curves, save <= 1.3x
``dd`` + fdatasync and load <= 1.05x ``load_file``.

Usage::

    python bench/bench_checkpoint.py                      # 1 GiB, 5 rounds of fresh processes
    python bench/bench_checkpoint.py --tiny --json /tmp/out.json    # smoke: 4 MiB, one round
    python bench/run.py --only checkpoint                           # through the shared harness
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import safetensors
import torch
from loguru import logger
from safetensors.torch import load_file, save_file

from distfn import checkpoint

import _common as c

MIB = 1 << 20
LOAD_ROUNDS = 21  # the fewest interleaved rounds of a load comparison


def make_state(size_mib: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors holding ``size_mib`` MiB in total (random bytes, so nothing compresses)."""
    total = size_mib * MIB // 4
    g = torch.Generator().manual_seed(seed)
    sizes = [total // tensors] * tensors
    sizes[-1] += total - sum(sizes)
    return {f"layer{i}.weight": torch.rand(n, generator=g) for i, n in enumerate(sizes)}


def _dd(source: str, target: str, nbytes: int, sync: bool) -> None:
    # bs=1M: dd's usual block size, and faster here than huge blocks (its buffer stays in cache)
    cmd = ["dd", f"if={source}", f"of={target}", "bs=1M", f"count={nbytes}", "iflag=count_bytes"]
    if sync:
        cmd.append("conv=fdatasync")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _warm(path: pathlib.Path) -> None:
    """Read a file once so that it sits in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * MIB):
            pass


def save_methods(state: dict[str, torch.Tensor], reference: str, nbytes: int) -> dict[str, Callable[[str], Any]]:
    """Every durable way to write the state (or its bytes) that is compared; each takes the target path."""

    def torch_save_fsync(p: str) -> None:
        torch.save(state, p)
        c.fsync_path(p)

    def save_file_fsync(p: str) -> None:
        save_file(state, p)
        c.fsync_path(p)

    return {
        "distfn.save": lambda p: checkpoint.save(state, p),
        "save_file+fsync": save_file_fsync,
        "torch.save+fsync": torch_save_fsync,
        "dd+fdatasync": lambda p: _dd(reference, p, nbytes, sync=True),
    }


SAVE_VARIANTS = ("distfn.save", "save_file+fsync", "torch.save+fsync", "dd+fdatasync")


def _save_child(variant: str, size_mib: int, tensors: int, workdir: str, repeat: int) -> None:
    """One fresh process: compute the tensors, then time the first save and ``repeat`` more (JSON on stdout)."""
    state = make_state(size_mib, tensors)
    reference = os.path.join(workdir, "reference.safetensors")
    method = save_methods(state, reference, os.stat(reference).st_size)[variant]
    if variant.startswith("dd"):
        _warm(pathlib.Path(reference))  # dd reads the bytes from memory, as the savers do; not timed
    times = []
    for i in range(1 + repeat):
        target = os.path.join(workdir, f"out-{os.getpid()}-{i}.bin")
        os.sync()  # no save pays for the previous one's dirty pages
        start = time.perf_counter()
        method(target)
        times.append(time.perf_counter() - start)
        os.unlink(target)
    json.dump({"first": times[0], "repeated": times[1:]}, sys.stdout)


def bench_save(config: dict[str, Any], workdir: pathlib.Path, rounds: int,
               repeat: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """First-save and repeated-save seconds per variant, each run in its own process, interleaved over rounds."""
    checkpoint.save(make_state(config["size_mib"], config["tensors"]), workdir / "reference.safetensors")
    repeated: dict[str, list[float]] = {name: [] for name in SAVE_VARIANTS}

    def child(name: str) -> Callable[[], float]:
        def run() -> float:
            proc = subprocess.run(
                [sys.executable, __file__, "--save-child", name, "--size-mib", str(config["size_mib"]),
                 "--tensors", str(config["tensors"]), "--dir", str(workdir), "--repeat", str(repeat)],
                check=True, capture_output=True, text=True,
            )
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            repeated[name].extend(out["repeated"])
            return float(out["first"])

        return run

    first = c.interleave({name: child(name) for name in SAVE_VARIANTS}, rounds, c.log)
    return first, repeated


def _touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one element of every page of every tensor: what first use of a lazily mapped tensor costs."""
    for t in tensors.values():
        flat = t.reshape(-1)
        step = max(1, 4096 // t.element_size())
        flat[::step].sum()


def _timed_load(load: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], float]:
    """A sample of ``load``: seconds to load and touch every page of what it returns."""
    def run() -> float:
        start = time.perf_counter()
        _touch(load())
        return time.perf_counter() - start
    return run


def bench_load(state: dict[str, torch.Tensor], workdir: pathlib.Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per loader (warm page cache): the call alone, and the call plus a touch of every page."""
    st_path = workdir / "load.safetensors"
    pt_path = workdir / "load.pt"
    checkpoint.save(state, st_path)
    torch.save(state, pt_path)
    os.sync()
    for p in (st_path, pt_path):  # warm the page cache: every loader reads from memory
        _warm(p)
    methods: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
        "distfn.load": lambda: checkpoint.load(st_path),
        "load_file": lambda: load_file(st_path),
        "torch.load(weights_only)": lambda: torch.load(pt_path, weights_only=True, map_location="cpu"),
    }
    for name, fn in methods.items():  # correctness first: a fast wrong loader is worth nothing
        loaded = fn()
        assert set(loaded) == set(state), name
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), name
        del loaded
    lazy: dict[str, list[float]] = {n: [] for n in methods}

    def timed(name: str) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            loaded = methods[name]()
            mid = time.perf_counter()
            _touch(loaded)
            end = time.perf_counter()
            del loaded
            lazy[name].append(mid - start)
            return end - start

        return run

    # a load takes ~10 ms, and one round's noise on a shared 2-core machine is ~5 % of it: many rounds, cheaply
    touched = c.interleave({name: timed(name) for name in methods}, max(rounds * 5, LOAD_ROUNDS), c.log)
    return {"call": lazy, "with_touch": touched}


# -- a real model's file: hundreds of small tensors ---------------------------------------------------

MANY_LAYERS, MANY_WIDTH = 24, 256  # a GPT-2-like stack: 12 tensors per layer, 288 in all, 72 MiB


def model_state(layers: int = MANY_LAYERS, width: int = MANY_WIDTH) -> dict[str, torch.Tensor]:
    """A transformer's state dict in miniature: per layer, 2-d weights and 1-d biases and norms (288 tensors)."""
    g, d = torch.Generator().manual_seed(1), width
    shapes = {"attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d),
              "attn.proj.bias": (d,), "ln1.weight": (d,), "ln1.bias": (d,), "mlp.fc.weight": (4 * d, d),
              "mlp.fc.bias": (4 * d,), "mlp.proj.weight": (d, 4 * d), "mlp.proj.bias": (d,), "ln2.weight": (d,),
              "ln2.bias": (d,)}
    return {f"h.{i}.{k}": torch.rand(shape, generator=g) for i in range(layers) for k, shape in shapes.items()}


def bench_many(workdir: pathlib.Path, rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds per load + touch of a many-tensor file (`model_state`), distfn vs load_file, and the tensor count:
    the per-tensor cost (header entries checked, tensors built) that a few large tensors hide."""
    state = model_state()
    path = workdir / "many.safetensors"
    checkpoint.save(state, path)
    _warm(path)
    loaders = {"distfn.load": lambda: checkpoint.load(path), "load_file": lambda: load_file(path)}
    for name, fn in loaders.items():  # correctness first
        loaded = fn()
        assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items()), name

    samples = c.interleave({name: _timed_load(fn) for name, fn in loaders.items()}, max(rounds * 5, LOAD_ROUNDS),
                           c.log)
    path.unlink()
    return samples, len(state)


# -- scaling curves: save and load vs size ------------------------------------------------------------

CURVE_SAVES = ("distfn.save", "save_file+fsync", "dd+fdatasync")
CURVE_LOADS = ("distfn.load", "load_file")


def bench_curve(sizes: list[int], tensors: int, workdir: pathlib.Path,
                rounds: int) -> dict[int, dict[str, list[float]]]:
    """Seconds per variant at each size (MiB): durable saves (after ``os.sync()``, interleaved, in this process)
    and loads plus a touch of every page (warm page cache: each file was just written and read once)."""
    # above 1 GiB fewer rounds (one at 4 GiB): one round of the three saves there takes ~30 s on this machine
    return {size: _curve_point(size, tensors, workdir, max(1, min(rounds, rounds * 1024 // size))) for size in sizes}


def _curve_point(size: int, tensors: int, workdir: pathlib.Path, rounds: int) -> dict[str, list[float]]:
    state = make_state(size, tensors, seed=size)
    reference = workdir / f"curve-{size}.safetensors"
    target = workdir / f"curve-out-{size}.bin"
    checkpoint.save(state, reference)
    _warm(reference)  # dd copies these bytes from memory, as the savers copy theirs
    methods = save_methods(state, str(reference), reference.stat().st_size)

    def saver(name: str) -> Callable[[], float]:
        def run() -> float:
            os.sync()  # no save pays for the previous one's dirty pages
            start = time.perf_counter()
            methods[name](str(target))
            took = time.perf_counter() - start
            target.unlink()
            return took
        return run

    samples = c.interleave({name: saver(name) for name in CURVE_SAVES}, rounds, c.log)
    loaders = {"distfn.load": lambda: checkpoint.load(reference), "load_file": lambda: load_file(reference)}
    _warm(reference)
    samples.update(c.interleave({name: _timed_load(loaders[name]) for name in CURVE_LOADS},
                                max(rounds * 5, LOAD_ROUNDS), c.log))
    reference.unlink()
    return samples


# -- peak RSS, measured in a child process -------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss_child(method: str, size_mib: int, tensors: int, workdir: str) -> None:
    state = make_state(size_mib, tensors)
    target = os.path.join(workdir, f"rss-{method}.bin")
    fn = {"distfn.save": lambda: checkpoint.save(state, target),
          "torch.save": lambda: torch.save(state, target),
          "save_file": lambda: save_file(state, target)}[method]
    baseline = _status_kib("VmRSS")
    peak_kib = baseline
    how = "VmHWM reset via /proc/self/clear_refs"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        sampler = None
    except OSError:
        how = "VmRSS sampled every 1 ms"
        stop = threading.Event()
        samples = [baseline]

        def sample() -> None:
            while not stop.is_set():
                samples.append(_status_kib("VmRSS"))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    baseline = _status_kib("VmRSS")
    fn()
    if sampler is None:
        peak_kib = _status_kib("VmHWM")
    else:
        stop.set()
        sampler.join()
        peak_kib = max(samples)
    os.unlink(target)
    json.dump({"method": method, "baseline_mib": baseline / 1024, "peak_mib": peak_kib / 1024,
               "extra_mib": (peak_kib - baseline) / 1024, "how": how}, sys.stdout)


def bench_rss(size_mib: int, tensors: int, workdir: pathlib.Path) -> dict[str, dict[str, Any]]:
    out = {}
    for method in ("distfn.save", "torch.save", "save_file"):
        proc = subprocess.run(
            [sys.executable, __file__, "--rss-child", method, "--size-mib", str(size_mib), "--tensors",
             str(tensors), "--dir", str(workdir)],
            check=True, capture_output=True, text=True,
        )
        out[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# -- report ----------------------------------------------------------------------------------------

SAVE_NOTES = {
    "distfn.save": "durable: fsync of file and directory, atomic rename",
    "save_file+fsync": "durable file (no atomic rename)",
    "torch.save+fsync": "durable file (no atomic rename)",
    "dd+fdatasync": "the same bytes, synced: the raw disk floor",
}


def _spread(samples: dict[str, list[float]]) -> dict[str, str]:
    """Each variant's note plus its spread (min-max over the runs)."""
    out = {}
    for name, values in samples.items():
        spread = f"spread {min(values):.3g}-{max(values):.3g} s" if values else "no runs"
        out[name] = f"{SAVE_NOTES.get(name, '')}; {spread}".lstrip("; ")
    return out


def build_result(first: dict[str, list[float]], repeated: dict[str, list[float]],
                 load: dict[str, dict[str, list[float]]], rss: dict[str, dict[str, Any]],
                 config: dict[str, Any], curve: dict[int, dict[str, list[float]]] | None = None,
                 many: tuple[dict[str, list[float]], int] | None = None) -> dict[str, Any]:
    """The benchmark's JSON (the ``bench/_common`` convention) with its tables and targets."""
    largest_mib = config["size_mib"] / config["tensors"]
    what = f"{config['size_mib']} MiB float32 in {config['tensors']} tensors"
    tables = [
        c.table(f"checkpoint save: the first save in a fresh process that just computed its tensors, {what}", "s",
                first, baseline="dd+fdatasync", targets=[{"variant": "distfn.save", "max_ratio": 1.3}],
                notes=_spread(first)),
        c.table("checkpoint first save against safetensors save_file + fsync (never slower)", "s",
                {k: first[k] for k in ("distfn.save", "save_file+fsync")}, baseline="save_file+fsync",
                targets=[{"variant": "distfn.save", "max_ratio": 1.0}]),
        c.table(f"checkpoint save: repeated saves in the same process ({config['repeat']} per process), {what}",
                "s", repeated, baseline="dd+fdatasync", notes=_spread(repeated)),
        c.table("checkpoint load + first touch of every page (warm page cache)", "s", load["with_touch"],
                baseline="load_file", targets=[{"variant": "distfn.load", "max_ratio": 1.05}],
                notes={"distfn.load": "target: at least as fast as load_file (5 % noise margin)"}),
        c.table("checkpoint load, the call alone (memory-mapped loaders are lazy)", "s", load["call"],
                baseline="load_file"),
    ]
    if many:
        samples, count = many
        per_tensor = {k: f"{statistics.median(v) / count * 1e6:.2f} µs per tensor" for k, v in samples.items() if v}
        tables.append(c.table(
            f"checkpoint load + touch of a model's file ({count} tensors, 2-d weights and 1-d biases; warm page cache)",
            "s", samples, baseline="load_file", targets=[{"variant": "distfn.load", "max_ratio": 1.05}],
            notes={k: f"{v}; target: per tensor no slower than load_file (5 % noise margin)" if k == "distfn.load"
                   else v for k, v in per_tensor.items()}))
    if rss:
        tables.append(c.table(
            "peak extra RSS during save", "MiB", {k: [v["extra_mib"]] for k, v in rss.items()}, baseline=None,
            targets=[{"variant": "distfn.save", "max_value": largest_mib + 64}],
            notes={k: v["how"] for k, v in rss.items()},
        ))
    if curve:
        points = {f"{size} MiB": samples for size, samples in curve.items()}
        nbytes = {f"{size} MiB": size * MIB for size in curve}
        tables.append(c.curve_table(
            f"checkpoint save vs size ({config['tensors']} float32 tensors; durable: each save after os.sync(), "
            "fsync/fdatasync included)", points, CURVE_SAVES, "dd+fdatasync", {"distfn.save": 1.3}, nbytes,
            "target at every size: distfn.save <= 1.3x dd + fdatasync (linear, no cliff)"))
        tables.append(c.curve_table(
            "checkpoint load + touch of every page vs size (warm page cache: each file just written and read once)",
            points, CURVE_LOADS, "load_file", {"distfn.load": 1.05}, nbytes,
            "target at every size: distfn.load <= 1.05x load_file"))
    notes = [
        f"largest tensor {largest_mib:.1f} MiB; RSS target = largest tensor + 64 MiB",
        f"written to {config['dir']} ({config['filesystem']}); each save starts after os.sync(); every save "
        "variant runs in its own process, interleaved",
    ]
    return {"benchmark": "checkpoint", "tables": tables, "notes": notes, "config": config, "rss": rss}


def _filesystem(path: pathlib.Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[-1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = c.parser(__doc__.split("\n\n")[0], rounds=5)
    parser.add_argument("--size-mib", type=int, default=1024, help="total float32 data (default 1024)")
    parser.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    parser.add_argument("--repeat", type=int, default=2, help="saves after the first one in each process (default 2)")
    parser.add_argument("--sizes", default="64,256,1024,4096",
                        help="MiB of the save/load-vs-size curves ('' for none; default 64,256,1024,4096)")
    parser.add_argument("--curve-rounds", type=int, default=3,
                        help="interleaved rounds per curve size up to 1 GiB, proportionally fewer above (default 3)")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = sorted({int(w) for w in args.sizes.split(",") if w.strip()})
    if args.tiny:
        args.size_mib, args.rounds, args.repeat = min(args.size_mib, 4), 1, 1
        sizes, args.curve_rounds = [1, 2] if sizes else [], 1
    if args.size_mib < 1 or args.tensors < 1 or args.rounds < 1 or args.repeat < 0:
        parser.error("--size-mib, --tensors and --rounds must be >= 1, --repeat >= 0")
    logger.remove()  # distfn logs each save at DEBUG; keep the output readable
    logger.add(sys.stderr, level="WARNING")
    if args.rss_child:
        _rss_child(args.rss_child, args.size_mib, args.tensors, str(args.dir))
        return 0
    if args.save_child:
        _save_child(args.save_child, args.size_mib, args.tensors, str(args.dir), args.repeat)
        return 0

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="distfn-bench-", dir=args.dir))
    try:
        config = {
            "size_mib": args.size_mib, "tensors": args.tensors, "rounds": args.rounds, "repeat": args.repeat,
            "dir": str(workdir),
            "filesystem": _filesystem(workdir), "safetensors": safetensors.__version__,
        }
        c.log(f"checkpoint: {args.size_mib} MiB in {args.tensors} tensors, {args.rounds} rounds, {workdir}")
        first, repeated = bench_save(config, workdir, args.rounds, args.repeat)
        state = make_state(args.size_mib, args.tensors)
        load = bench_load(state, workdir, args.rounds)
        del state
        many = bench_many(workdir, args.rounds)
        rss = {} if args.no_rss else bench_rss(args.size_mib, args.tensors, workdir)
        c.log(f"checkpoint curves: {sizes} MiB, {args.curve_rounds} rounds")
        curve = bench_curve(sizes, args.tensors, workdir, args.curve_rounds)
        config.update(sizes=sizes, curve_rounds=args.curve_rounds)
        result = build_result(first, repeated, load, rss, config, curve, many)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    c.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
