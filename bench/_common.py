"""Shared plumbing of the ``bench/`` scripts: the command-line convention, interleaved rounds, medians and
ratios, tables, JSON.

The convention every ``bench/bench_*.py`` follows (so ``bench/run.py`` can drive it):

* ``main(argv: list[str] | None = None) -> int`` and ``if __name__ == "__main__": sys.exit(main())``;
* ``--json PATH`` writes the result there, ``--tiny`` runs once with tiny sizes (the smoke test),
  ``--rounds N`` sets how many interleaved rounds to run;
* the JSON is ``{"benchmark": name, "tables": [table, ...], "notes": [...]}`` where a table is
  ``{"title", "unit", "baseline", "rows": [{"variant", "median", "samples", "ratio", ...}], "targets": [...]}``
  (see :func:`table`). ``ratio`` is ``median / baseline median``; lower is faster.

Timings are medians over rounds in which every variant runs once, in a rotated order, so that a noisy
neighbour or a thermal drift hits all variants alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


def parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--json``, ``--tiny``, ``--rounds``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON to this path")
    p.add_argument("--tiny", action="store_true", help="one round, tiny sizes (the smoke test)")
    p.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    return p


def interleave(variants: Mapping[str, Callable[[], float]], rounds: int,
               progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run every variant once per round, rotating the order each round; return the samples per variant.

    A variant returns one sample (seconds, or whatever unit its table uses) or raises; a failing variant is
    reported in ``progress`` and leaves no sample for that round.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            try:
                value = variants[name]()
            except Exception as exc:  # noqa: BLE001 - one broken variant must not end the whole run
                if progress:
                    progress(f"  round {r + 1}/{rounds} {name}: FAILED {type(exc).__name__}: {exc}")
                continue
            samples[name].append(value)
            if progress:
                progress(f"  round {r + 1}/{rounds} {name}: {value:.4g}")
    return samples


def table(title: str, unit: str, samples: Mapping[str, Sequence[float]], baseline: str | None,
          targets: Sequence[Mapping[str, Any]] = (), notes: Mapping[str, str] | None = None,
          floors: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A result table: median per variant and its ratio to ``baseline``'s median.

    ``targets`` are ``{"variant": name, "max_ratio": x}`` or ``{"variant": name, "max_value": x}``; each gets
    ``"median"``/``"ratio"`` and ``"met"`` filled in (``None`` when the variant has no samples).
    ``floors`` gives a variant its own baseline (a scaling curve: ``{"distfn, 4 workers": "raw fork, 4 workers"}``):
    its ratio, and a ``max_ratio`` target on it, are then against that row's median, and each floor row's ratio
    is 1; the caller names the floors for the page in the table's ``"baseline"``.
    """
    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    base = medians.get(baseline) if baseline else None
    floors = floors or {}
    rows = []
    for name, values in samples.items():
        med = medians.get(name)
        if name in floors:
            floor = medians.get(floors[name])
            ratio = (med / floor) if med is not None and floor else None
        elif name in floors.values():
            ratio = 1.0 if med else None
        else:
            ratio = (med / base) if med is not None and base else None
        rows.append({
            "variant": name,
            "median": med,
            "min": min(values) if values else None,
            "samples": list(values),
            "ratio": ratio,
            "note": (notes or {}).get(name, ""),
        })
    by_name = {row["variant"]: row for row in rows}
    checked = []
    for target in targets:
        t = dict(target)
        row = by_name.get(t["variant"], {})
        if "max_ratio" in t:
            value = row.get("ratio")
            t["ratio"] = value
            t["met"] = None if value is None else value <= t["max_ratio"]
        else:
            value = row.get("median")
            t["median"] = value
            t["met"] = None if value is None else value <= t["max_value"]
        checked.append(t)
    return {"title": title, "unit": unit, "baseline": baseline, "rows": rows, "targets": checked}


def curve_table(title: str, points: Mapping[str, Mapping[str, Sequence[float]]], variants: Sequence[str], floor: str,
                limits: Mapping[str, float], nbytes: Mapping[str, float], note: str) -> dict[str, Any]:
    """One table for a scaling curve (seconds): a row per variant and point (``"64 MiB"``, ``"2 ranks"``), its
    ratio to ``floor``'s median *at the same point*, the bandwidth ``nbytes[point] / median`` in the note, and one
    target per point for each variant in ``limits`` (``variant -> max ratio``)."""
    samples = {f"{name}, {point}": points[point][name] for point in points for name in variants}
    floors = {f"{name}, {point}": f"{floor}, {point}" for point in points for name in variants if name != floor}
    targets = [{"variant": f"{name}, {point}", "max_ratio": limits[name]}
               for point in points for name in variants if name in limits]
    tab = table(title, "s", samples, baseline=None, targets=targets, floors=floors)
    for row in tab["rows"]:
        name = row["variant"].rsplit(", ", 1)[0]
        point = row["variant"].rsplit(", ", 1)[1]
        row["note"] = f"{nbytes[point] / row['median'] / 1e9:.2f} GB/s" + ("; the floor" if name == floor else "")
    tab["baseline"] = f"{floor} at the same point"
    tab["note"] = note
    return tab


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s" and value < 1:
        return f"{value * 1000:.1f} ms"
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:.4g} {unit}".rstrip()


def format_table(tab: Mapping[str, Any]) -> str:
    """A Markdown table of one result table (also readable in a terminal)."""
    versus = f" vs {tab['baseline']}" if tab.get("baseline") else ""
    lines = [f"**{tab['title']}**", "",
             f"| variant | median | ratio{versus} | min | runs | note |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in tab["rows"]:
        ratio = f"{row['ratio']:.3f}×" if row.get("ratio") is not None else "-"
        lines.append(f"| {row['variant']} | {_fmt(row['median'], tab['unit'])} | {ratio} | "
                     f"{_fmt(row.get('min'), tab['unit'])} | {len(row['samples'])} | {row.get('note', '')} |")
    for t in tab.get("targets", []):
        goal, got, verdict = describe_target(t, tab)
        lines.append(f"\ntarget {t['variant']} {goal}: {got} ({verdict})")
    return "\n".join(lines)


def describe_target(target: Mapping[str, Any], tab: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(goal, measured, verdict)`` of one target of ``tab``, e.g. ``("≤ 1.1× raw fork", "1.001×", "met")``."""
    if "max_ratio" in target:
        goal = f"≤ {target['max_ratio']}× {tab.get('baseline')}"
        got = f"{target['ratio']:.3f}×" if target.get("ratio") is not None else "no data"
    else:
        goal = f"≤ {_fmt(target['max_value'], tab['unit'])}"
        got = _fmt(target.get("median"), tab["unit"])
    return goal, got, {True: "met", False: "MISSED", None: "no data"}[target.get("met")]


def machine() -> dict[str, Any]:
    """Where the numbers were taken (stored with every result)."""
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        from importlib import metadata

        info["torch"] = metadata.version("torch")
    except Exception:  # noqa: BLE001
        info["torch"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
        # figures of code that no commit holds must not be credited to the commit
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "distfn", "bench"],
                                 cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        if info["commit"] and changed:
            info["commit"] += " + uncommitted changes to distfn/ or bench/"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def emit(result: dict[str, Any], json_path: Path | None) -> None:
    """Print every table of ``result`` and write it as JSON when asked."""
    result.setdefault("machine", machine())
    for tab in result["tables"]:
        print(format_table(tab), end="\n\n", flush=True)
    for note in result.get("notes", []):
        print(f"note: {note}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the tables."""
    print(message, file=sys.stderr, flush=True)


def timed_run(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
              expect: str | None = None, timeout: float = 300) -> float:
    """Wall time in seconds of running ``cmd`` to completion; raises if it fails or ``expect`` is not printed."""
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), env=dict(env) if env is not None else None, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or (expect is not None and expect not in proc.stdout):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: " + " | ".join(tail))
    return elapsed


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any launcher variables (so nothing is mistaken for a torchrun rank)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "MV2_", "DISTFN_"))}
    # Measure what an installed package costs: with its bytecode cached (pip compiles on install). A
    # development shell with PYTHONDONTWRITEBYTECODE=1 would otherwise recompile every distfn module on every
    # import (measured: most of `import distfn`'s time).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra)
    return env


def warm_bytecode(python: str = sys.executable, modules: Sequence[str] = ("torch", "distfn")) -> None:
    """Import ``modules`` once with bytecode writing on, so that timed runs find their ``.pyc`` files."""
    subprocess.run([python, "-c", "import " + ", ".join(modules)], env=clean_env(), capture_output=True,
                   timeout=600)


def fsync_path(path: str) -> None:
    """Make the file at ``path`` durable (what the "+fsync" save variants add to ``torch.save``/``save_file``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_port() -> int:
    """A currently free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Peak host memory of this process (Linux: /proc/self/status, VmHWM reset through /proc/self/clear_refs)


def proc_status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (or any ``kB`` field) of ``/proc/self/status``, in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def trim_heap() -> None:
    """Collect garbage and give free heap memory back to the system, so that an RSS holds live memory only."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> int | None:
    """Trim the heap and reset the peak RSS (``VmHWM``) to the current RSS; that baseline RSS in bytes, or
    ``None`` where Linux won't reset it (then report no memory figure rather than a wrong one)."""
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss = proc_status("VmRSS")
    except OSError:
        return None
    return None if proc_status("VmHWM") > rss + 4 * 2**20 else rss  # accepted, but the peak was not reset


def peak_extra(base: int | None) -> int | None:
    """The peak RSS since `reset_peak_rss` above its baseline ``base``, in bytes (``None`` without a baseline)."""
    return None if base is None else max(0, proc_status("VmHWM") - base)

