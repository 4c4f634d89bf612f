"""The same benchmarks on two checkouts of distfn, interleaved: is this tree slower than another commit?

    git worktree add /tmp/base 8ff8d90
    python bench/compare.py --base /tmp/base                       # launch, import, step; 3 rounds
    python bench/compare.py --base /tmp/base --only launch --rounds 5 --args launch=--no-scaling

Both trees run *this* tree's benchmark scripts (so the harness is identical and only distfn differs); each is
selected with ``PYTHONPATH`` (the scripts' workers inherit it). A round runs every benchmark once per tree,
the trees in a rotated order, one interleaved round inside each run (``--rounds 1``), so a noisy neighbour or
a thermal drift hits both trees alike. The result is one table per benchmark table and variant pair: the
median of each tree and ``head / base`` (lower is faster), printed and written to
``bench/results/compare-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

DEFAULT = ("launch", "import", "step")


def _run(name: str, tree: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    """One ``bench_<name>.py --rounds 1`` with ``tree``'s distfn first on the path; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)}
        cmd = [sys.executable, str(c.BENCH_DIR / f"bench_{name}.py"), "--rounds", "1", "--json", str(out), *extra]
        subprocess.run(cmd, env=env, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--head", type=Path, default=c.REPO, help="this checkout (default: the one holding bench/)")
    p.add_argument("--only", default=",".join(DEFAULT), help="benchmarks, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                   help="extra arguments for one benchmark, e.g. launch=--no-scaling (repeatable)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    extra: dict[str, list[str]] = defaultdict(list)
    for item in args.args:
        name, _, rest = item.partition("=")
        extra[name] += rest.split()
    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    # samples[(benchmark, table title, variant)][tree] -> values over rounds
    samples: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    units: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in args.only.split(","):
            for label in order:
                c.log(f"round {r + 1}/{args.rounds}: {name} @ {label}")
                result = _run(name, trees[label], extra[name], args.timeout)
                for tab in result.get("tables", []):
                    units[(name, tab["title"])] = tab["unit"]
                    for row in tab["rows"]:
                        samples[(name, tab["title"], row["variant"])][label] += row["samples"]
    tables = []
    by_table: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)
    for (name, title, variant), per_tree in samples.items():
        for label in trees:
            by_table[(name, title)][f"{variant} @ {label}"] = per_tree[label]
    for (name, title), rows in by_table.items():
        tab = c.table(f"{name}: {title} (head / base)", units[(name, title)], rows, baseline=None)
        medians = {row["variant"]: row["median"] for row in tab["rows"]}
        for row in tab["rows"]:
            variant, _, label = row["variant"].rpartition(" @ ")
            base = medians.get(f"{variant} @ base")
            if label == "head" and base and row["median"] is not None:
                row["ratio"] = row["median"] / base
        tables.append(tab)
        print(c.format_table(tab), "\n")
    payload = {"benchmark": "compare", "trees": {k: str(v) for k, v in trees.items()}, "tables": tables,
               "machine": c.machine()}
    out = args.json or c.BENCH_DIR / "results" / f"compare-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    c.log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
