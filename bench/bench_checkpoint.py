"""Benchmark distfn checkpoints against torch.save, safetensors and the raw disk (dd), in one run.

What is measured (float32 tensors, ``--size-mib`` in total, split into ``--tensors`` tensors):

* **save**: ``distfn.checkpoint.save`` (durable: fsync of file and directory included) against
  ``torch.save`` and ``safetensors.torch.save_file`` (as they are, and followed by an fsync for a fair
  durable comparison) and ``dd`` copying the same bytes (from a page-cached copy of the checkpoint) with and
  without ``conv=fdatasync``; plus ``dd`` from ``/dev/zero`` as the plain disk floor. Methods are interleaved
  over ``--rounds`` rounds (rotating the order each round) after an ``os.sync()``; medians are reported.
* **peak extra RSS** during each save, measured in a child process: ``VmHWM`` after the save minus
  ``VmRSS`` before it (the high-water mark is reset through ``/proc/self/clear_refs``; where that is not
  allowed, RSS is sampled every millisecond instead).
* **load** (page cache warm): ``distfn.checkpoint.load`` against ``safetensors.torch.load_file`` and
  ``torch.load(weights_only=True)``, both as returned (memory-mapped loaders are lazy) and including a touch
  of every page of every tensor, which is what using the tensors costs.

Targets from the checkpoint issue: save <= 1.3x ``dd`` + fdatasync of the same bytes, peak extra RSS <=
largest tensor + 64 MiB, load (with touch) at least as fast as ``load_file`` (a 5 % noise margin applies).

Usage::

    python bench/bench_checkpoint.py                      # 1 GiB, 5 rounds
    python bench/bench_checkpoint.py --size-mib 4 --rounds 1 --json /tmp/out.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
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

import safetensors  # noqa: E402
import torch  # noqa: E402
from loguru import logger  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from distfn import checkpoint  # noqa: E402

MIB = 1 << 20


def make_state(size_mib: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors holding ``size_mib`` MiB in total (random bytes, so nothing compresses)."""
    total = size_mib * MIB // 4
    g = torch.Generator().manual_seed(seed)
    sizes = [total // tensors] * tensors
    sizes[-1] += total - sum(sizes)
    return {f"layer{i}.weight": torch.rand(n, generator=g) for i, n in enumerate(sizes)}


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dd(source: str, target: str, nbytes: int, sync: bool) -> None:
    cmd = ["dd", f"if={source}", f"of={target}", "bs=64M", f"count={nbytes}", "iflag=count_bytes"]
    if sync:
        cmd.append("conv=fdatasync")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def save_methods(state: dict[str, torch.Tensor], reference: str, nbytes: int) -> dict[str, Callable[[str], Any]]:
    """Every way to write the state (or its bytes) that is compared; each takes the target path."""

    def torch_save_fsync(p: str) -> None:
        torch.save(state, p)
        _fsync_path(p)

    def save_file_fsync(p: str) -> None:
        save_file(state, p)
        _fsync_path(p)

    return {
        "distfn.save": lambda p: checkpoint.save(state, p),
        "torch.save": lambda p: torch.save(state, p),
        "torch.save+fsync": torch_save_fsync,
        "save_file": lambda p: save_file(state, p),
        "save_file+fsync": save_file_fsync,
        "dd": lambda p: _dd(reference, p, nbytes, sync=False),
        "dd+fdatasync": lambda p: _dd(reference, p, nbytes, sync=True),
        "dd-zero+fdatasync": lambda p: _dd("/dev/zero", p, nbytes, sync=True),
    }


def _touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one element of every page of every tensor: what first use of a lazily mapped tensor costs."""
    for t in tensors.values():
        flat = t.reshape(-1)
        step = max(1, 4096 // t.element_size())
        flat[::step].sum()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_save(state: dict[str, torch.Tensor], workdir: pathlib.Path, rounds: int) -> dict[str, dict[str, Any]]:
    reference = workdir / "reference.safetensors"
    checkpoint.save(state, reference)
    nbytes = reference.stat().st_size
    methods = save_methods(state, str(reference), nbytes)
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: no method always goes first
        for name in order:
            target = workdir / f"out-{name}.bin"
            os.sync()
            start = time.perf_counter()
            methods[name](str(target))
            times[name].append(time.perf_counter() - start)
            target.unlink()
    result = {}
    for name, ts in times.items():
        med = _median(ts)
        result[name] = {"times_s": ts, "median_s": med, "gib_per_s": nbytes / (1 << 30) / med}
    return result


def bench_load(state: dict[str, torch.Tensor], workdir: pathlib.Path, rounds: int) -> dict[str, dict[str, Any]]:
    st_path = workdir / "load.safetensors"
    pt_path = workdir / "load.pt"
    checkpoint.save(state, st_path)
    torch.save(state, pt_path)
    os.sync()
    for p in (st_path, pt_path):  # warm the page cache: every loader reads from memory
        with open(p, "rb") as f:
            while f.read(64 * MIB):
                pass
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
    touched: dict[str, list[float]] = {n: [] for n in methods}
    names = list(methods)
    for r in range(max(rounds, 3)):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            loaded = methods[name]()
            mid = time.perf_counter()
            _touch(loaded)
            end = time.perf_counter()
            del loaded
            lazy[name].append(mid - start)
            touched[name].append(end - start)
    return {
        n: {"times_s": lazy[n], "median_s": _median(lazy[n]), "with_touch_times_s": touched[n],
            "with_touch_median_s": _median(touched[n])}
        for n in methods
    }


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


def summarize(save: dict, load: dict, rss: dict, size_mib: int, tensors: int) -> dict[str, Any]:
    dd = save["dd+fdatasync"]["median_s"]
    ours = save["distfn.save"]["median_s"]
    largest_mib = size_mib / tensors
    ratios = {f"distfn.save/{name}": ours / r["median_s"] for name, r in save.items() if name != "distfn.save"}
    load_ratio = load["distfn.load"]["with_touch_median_s"] / load["load_file"]["with_touch_median_s"]
    targets = {
        "save_vs_dd_fdatasync": {"ratio": ours / dd, "limit": 1.3, "met": ours / dd <= 1.3},
        "peak_extra_rss_mib": {"value": rss["distfn.save"]["extra_mib"] if rss else float("nan"),
                               "limit": largest_mib + 64,
                               "met": bool(rss) and rss["distfn.save"]["extra_mib"] <= largest_mib + 64},
        "load_vs_load_file": {"ratio": load_ratio, "limit": 1.0, "noise_margin": 0.05, "met": load_ratio <= 1.05},
    }
    return {"ratios": ratios, "load_ratio_with_touch": load_ratio, "targets": targets}


def print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"\ndistfn checkpoint benchmark: {cfg['size_mib']} MiB float32 in {cfg['tensors']} tensors, "
          f"{cfg['rounds']} rounds, dir {cfg['dir']} ({cfg['filesystem']})")
    dd = report["save"]["dd+fdatasync"]["median_s"]
    print(f"\n{'save':<22}{'median s':>10}{'GiB/s':>8}{'x dd+fdatasync':>16}   all runs (s)")
    for name, r in report["save"].items():
        runs = " ".join(f"{t:.2f}" for t in r["times_s"])
        print(f"{name:<22}{r['median_s']:>10.3f}{r['gib_per_s']:>8.2f}{r['median_s'] / dd:>16.2f}   {runs}")
    print(f"\n{'peak extra RSS':<22}{'MiB':>10}")
    for name, r in report["rss"].items():
        print(f"{name:<22}{r['extra_mib']:>10.1f}")
    lf = report["load"]["load_file"]["with_touch_median_s"]
    print(f"\n{'load (warm cache)':<26}{'call s':>9}{'+touch s':>10}{'x load_file':>13}")
    for name, r in report["load"].items():
        print(f"{name:<26}{r['median_s']:>9.3f}{r['with_touch_median_s']:>10.3f}"
              f"{r['with_touch_median_s'] / lf:>13.2f}")
    print("\ntargets:")
    for name, t in report["summary"]["targets"].items():
        value = t.get("ratio", t.get("value"))
        print(f"  {name:<24} {value:8.3f}  (limit {t['limit']:.3g})  {'MET' if t['met'] else 'NOT MET'}")


def _filesystem(path: pathlib.Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[-1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="total float32 data (default 1024)")
    parser.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per method (default 5)")
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the report here")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logger.remove()  # distfn logs each save at DEBUG; keep the table readable
    logger.add(sys.stderr, level="WARNING")
    if args.size_mib < 1 or args.tensors < 1 or args.rounds < 1:
        parser.error("--size-mib, --tensors and --rounds must be >= 1")
    if args.rss_child:
        _rss_child(args.rss_child, args.size_mib, args.tensors, str(args.dir))
        return 0

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="distfn-bench-", dir=args.dir))
    try:
        state = make_state(args.size_mib, args.tensors)
        save = bench_save(state, workdir, args.rounds)
        load = bench_load(state, workdir, args.rounds)
        del state
        rss = {} if args.no_rss else bench_rss(args.size_mib, args.tensors, workdir)
        report: dict[str, Any] = {
            "config": {
                "size_mib": args.size_mib, "tensors": args.tensors, "rounds": args.rounds, "dir": str(workdir),
                "filesystem": _filesystem(workdir), "torch": torch.__version__,
                "safetensors": safetensors.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "save": save,
            "load": load,
            "rss": rss,
        }
        report["summary"] = summarize(save, load, rss, args.size_mib, args.tensors)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
