"""The docs' pictures, drawn from distfn's own code so they cannot drift: ``python docs/pictures.py`` writes them.

- ``assets/how-a-call-runs.svg`` (docs/concepts.md, docs/architecture.md): decorator → plan → launcher → worker →
  ctx. The launcher boxes are `distfn.plan.KINDS`, in their order; the environment's detectors are
  `distfn.topology.DETECTORS`, in the order ``auto`` tries them; every module named is checked to exist.
- ``assets/checkpoint-layout.svg`` (docs/checkpoints.md): one file, a sharded directory with its index, an object
  store's commit object, and ``keep=`` rotation. The file names come from `distfn.checkpoint.names` (``INDEX``,
  ``SUFFIX``, ``STEP_FILE``), `distfn.checkpoint.sharded.spec` (``shard_file``, ``PARTIAL``),
  `distfn.checkpoint.remote` (``COMMIT_SUFFIX``, ``_DATA``), `distfn.checkpoint.storage` (``TMP_MARK``) and
  `distfn.checkpoint.format` (the header's keys).
- ``assets/mesh.svg`` (docs/mesh.md): which rank holds what on a 2 x 2 x 2 mesh, from `distfn.mesh.Layout`.

- ``assets/timings.svg`` (docs/loop.md): what ``ctx.timings(plot=...)`` draws, by `distfn.timings_plot.svg` itself,
  from the points a real run's rank 0 kept (``assets/timings-run.json``; ``python docs/pictures.py --timings-run``
  runs that 4-rank job again, about a minute on 2 cores, and rewrites it).

Plain SVG written by hand (no plotting library: the docs extra installs none). tests/test_docs.py regenerates
both and compares them byte for byte with the committed files, so a renamed constant, a new launcher kind or a
moved module fails the test until this script is run again (and, for a new kind, given its caption).
"""

from __future__ import annotations

import importlib.util
import sys
from html import escape
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"

INK = "#1b1b1b"  # text: dark on the light background, in the site's light and dark schemes alike
MUTED = "#5f5f5f"
LINE = "#bf360c"  # the site's deep orange, darker (arrows, borders)
FILL = "#fff3e0"
FILL2 = "#f5f5f5"
BG = "#ffffff"
SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"


class Svg:
    """A few primitives over a list of SVG elements (coordinates in the viewBox's units, pixels at 100 %)."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width, self.height = width, height
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" font-family="{SANS}" font-size="14" fill="{INK}">',
            f"<title>{escape(title)}</title>",
            '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{LINE}"/></marker></defs>',
            f'<rect width="{width}" height="{height}" fill="{BG}"/>',
        ]

    def box(self, x: float, y: float, w: float, h: float, *, fill: str = FILL, dashed: bool = False,
            stroke: str = LINE) -> None:
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        self.parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="1.5"{dash}/>')

    def text(self, x: float, y: float, s: str, *, size: int = 14, bold: bool = False, mono: bool = False,
             color: str = INK, anchor: str = "start", strike: bool = False) -> None:
        attrs = [f'x="{x}"', f'y="{y}"']
        if size != 14:
            attrs.append(f'font-size="{size}"')
        if bold:
            attrs.append('font-weight="bold"')
        if mono:
            attrs.append(f'font-family="{MONO}"')
        if color != INK:
            attrs.append(f'fill="{color}"')
        if anchor != "start":
            attrs.append(f'text-anchor="{anchor}"')
        if strike:
            attrs.append('text-decoration="line-through"')
        self.parts.append(f"<text {' '.join(attrs)}>{escape(s)}</text>")

    def arrow(self, x1: float, y1: float, x2: float, y2: float, *, dashed: bool = False) -> None:
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        self.parts.append(f'<path d="M{x1},{y1} L{x2},{y2}" stroke="{LINE}" stroke-width="1.6" fill="none" '
                          f'marker-end="url(#a)"{dash}/>')

    def done(self) -> str:
        return "\n".join([*self.parts, "</svg>"]) + "\n"


def _module(name: str) -> str:
    """``name``, after checking that distfn has that module (a moved module fails the regeneration)."""
    if importlib.util.find_spec(name) is None:
        raise SystemExit(f"docs/pictures.py names {name}, which does not exist: update the picture")
    return name


# What each way of running shows: (when, what runs, the module). Keyed by distfn.plan.KINDS: a new kind has no
# caption here and stops the regeneration until it gets one.
_KIND_CAPTIONS: dict[str, tuple[str, str, str]] = {
    "nested": ("inside a running rank:", "refused, NestedLaunchError", "distfn.errors"),
    "ray": ('launcher="ray":', "one Ray actor per rank", "distfn.launch.ray"),
    "pernode": ("one task per node:", "it starts the node's ranks", "distfn.launch.pernode"),
    "in-place": ("torchrun / srun / mpirun:", "this process is one rank", "distfn.worker"),
    "one-process": ("single / dp, or one rank:", "run here, alone", "distfn.worker"),
    "spawn": ("python script.py:", "start nprocs local workers", "distfn.launch.local"),
}
# The commands each detector recognises (distfn.topology.DETECTORS' names).
_DETECTOR_COMMANDS = {"torchrun": "torchrun", "mpi": "mpirun", "slurm": "srun / sbatch"}

# The width of the pictures: the content column of the site at a 1280 px wide window (both sidebars shown) measured
# 689 px in headless Chromium (tests/test_docs.py screenshots it), so these two, drawn at 760, are shown at 91 %,
# their 12 px text at 11 px; the timings picture (distfn.timings_plot) is drawn at 690, shown at its own size.
WIDTH = 760


def call_picture() -> str:
    """How a call runs: decorator → plan → launcher (one of `distfn.plan.KINDS`) → worker → ctx."""
    from distfn import topology
    from distfn.plan import KINDS

    if set(_KIND_CAPTIONS) != set(KINDS):
        raise SystemExit(f"distfn.plan.KINDS is {KINDS}; docs/pictures.py captions {tuple(_KIND_CAPTIONS)}")
    detectors = [d.name for d in topology.DETECTORS]
    if not set(detectors) <= set(_DETECTOR_COMMANDS):
        raise SystemExit(f"distfn.topology.DETECTORS is {detectors}: give docs/pictures.py their commands")

    s = Svg(WIDTH, 690, "How a call of a @distributed function runs")
    s.text(20, 30, "How a call runs", size=19, bold=True)
    x0, w, h = 20, 470, 50
    cx = x0 + w / 2

    def spine(y: float, head: str, sub: str, mod: str | None, *, arrow: bool = True) -> float:
        s.box(x0, y, w, h)
        s.text(cx, y + 21, head, bold=True, mono=True, anchor="middle")
        s.text(cx, y + 39, sub if mod is None or mod in sub else f"{sub} ({_module(mod)})", size=12,
               color=MUTED, anchor="middle")
        if arrow:
            s.arrow(cx, y + h, cx, y + h + 20)
        return y + h + 20

    y = spine(46, "train(cfg)", "your call of the decorated function", None)
    y = spine(y, "@distributed(...)", "options checked at decoration", "distfn.decorator")
    plan_y = y
    y = spine(y, "plan_call(...) → CallPlan", "pure; distfn env prints it", "distfn.plan", arrow=False)

    # The environment, read by the plan: the detectors in the order auto tries them.
    ex, ew = x0 + w + 30, WIDTH - 20 - (x0 + w + 30)
    ey = plan_y - 44
    s.box(ex, ey, ew, 112, fill=FILL2, stroke=MUTED)
    s.text(ex + 12, ey + 22, "the environment decides", bold=True)
    s.text(ex + 12, ey + 42, "auto tries, first match wins:", size=12, color=MUTED)
    s.text(ex + 12, ey + 62, " → ".join(detectors), mono=True, size=13)
    s.text(ex + 12, ey + 80, ", ".join(_DETECTOR_COMMANDS[d] for d in detectors), size=12, color=MUTED)
    s.text(ex + 12, ey + 99, _module("distfn.topology") + ".DETECTORS", size=11, mono=True, color=MUTED)
    s.arrow(ex, plan_y + h / 2, x0 + w + 4, plan_y + h / 2, dashed=True)

    # The launchers: CallPlan.kind, one box per kind in KINDS' order, run by distfn.execute.
    ky = y + 10
    s.arrow(cx, y - 20, cx, ky + 2)
    cols, bh, gap = 3, 74, 12
    bw = (WIDTH - 2 * x0 - 24 - (cols - 1) * gap) / cols
    rows = -(-len(KINDS) // cols)
    kh = 40 + rows * bh + (rows - 1) * gap + 14
    s.box(x0, ky, WIDTH - 2 * x0, kh, fill=BG, stroke=MUTED)
    s.text(x0 + 12, ky + 24, f"{_module('distfn.execute')}.call(plan) runs CallPlan.kind, one of:", size=13)
    for i, kind in enumerate(KINDS):
        when, what, mod = _KIND_CAPTIONS[kind]
        bx = x0 + 12 + (i % cols) * (bw + gap)
        by = ky + 40 + (i // cols) * (bh + gap)
        nested = kind == "nested"
        s.box(bx, by, bw, bh, fill=FILL2 if nested else FILL, dashed=nested)
        s.text(bx + 10, by + 20, kind, bold=True, mono=True)
        s.text(bx + 10, by + 38, when, size=12)
        s.text(bx + 10, by + 54, what, size=12)
        s.text(bx + 10, by + 68, _module(mod), size=11, mono=True, color=MUTED)

    # Every rank runs the worker, which builds the context and calls the function.
    y = ky + kh
    s.arrow(cx, y, cx, y + 20)
    y = spine(y + 20, "worker.run (every rank)", "device, seed, process group", "distfn.worker")
    y = spine(y, "fn(cfg, ctx)", "your code; ctx is distfn.context.Context", "distfn.context", arrow=False)
    s.text(x0, y + 8, f"Each rank reports back ({_module('distfn.launch.protocol')}): its value, or a failure",
           size=12, color=MUTED)
    s.text(x0, y + 24, "raised in the caller as WorkerError (rank 0's value is train(cfg)'s result).", size=12,
           color=MUTED)
    return s.done()


def checkpoint_picture() -> str:
    """What a checkpoint is on disk and in a bucket: one file, a sharded directory, the commit object, ``keep=``."""
    from distfn.checkpoint import format as fmt
    from distfn.checkpoint.names import INDEX, STEP_FILE, SUFFIX
    from distfn.checkpoint.remote import _DATA as DATA  # private, read only for its name
    from distfn.checkpoint.remote import COMMIT_SUFFIX
    from distfn.checkpoint.sharded.spec import PARTIAL, shard_file
    from distfn.checkpoint.storage import TMP_MARK

    s = Svg(WIDTH, 700, "What a distfn checkpoint is on disk and in a bucket")
    s.text(20, 30, "What a checkpoint is, on disk and in a bucket", size=19, bold=True)
    pw, gap, ph = 354, 12, 312
    xs = (20, 20 + pw + gap)
    ys = (46, 46 + ph + gap)

    def panel(x: float, y: float, title: str, rule: str) -> None:
        s.box(x, y, pw, ph, fill=BG, stroke=MUTED)
        s.text(x + 12, y + 24, title, bold=True, size=15)
        s.text(x + 12, y + 43, rule, size=12, color=MUTED)

    def entry(x: float, y: float, lines: tuple[str, ...], note: str = "", *, hidden: bool = False,
              strike: bool = False) -> float:
        bh = 10 + 16 * len(lines) + (16 if note else 0)
        s.box(x + 12, y, pw - 24, bh, fill=FILL2 if hidden or strike else FILL, dashed=hidden or strike)
        # 12 px monospace is 7.2 px a character: a name too long for the box at 12 px is drawn at 11 px
        size = 12 if max(len(line) for line in lines) * 7.2 <= pw - 40 else 11
        for i, line in enumerate(lines):
            s.text(x + 20, y + 18 + 16 * i, line, mono=True, size=size, color=MUTED if hidden or strike else INK,
                   strike=strike)
        if note:
            s.text(x + 20, y + 18 + 16 * len(lines), note, size=11, color=MUTED)
        return y + bh + 8

    one = f"ckpt-1200{SUFFIX}"
    # One file.
    x, y = xs[0], ys[0]
    panel(x, y, "One file", f"a path ending in {SUFFIX} (any mode)")
    s.text(x + 12, y + 68, "runs/exp1/", mono=True, size=13, bold=True)
    y2 = entry(x, y + 78, (one,), "safetensors: a JSON header, then the tensors")
    s.text(x + 20, y2 + 14, "the header's __metadata__ holds:", size=12)
    for i, key in enumerate((fmt.KEY_FORMAT, fmt.KEY_TREE, fmt.KEY_ALIASES, fmt.KEY_METADATA)):
        s.text(x + 32, y2 + 31 + 16 * i, key, mono=True, size=12)
    y2 += 31 + 16 * 4
    s.text(x + 20, y2 + 4, "tensors by key path: model.fc.weight, ...", size=12)
    s.text(x + 12, y + 252, "while writing (hidden, never a checkpoint):", size=12)
    entry(x, y + 260, (f".{one}", f".<host>.<pid>.<random>{TMP_MARK}"), hidden=True)

    # A sharded directory.
    x, y = xs[1], ys[0]
    panel(x, y, "Sharded directory", 'mode="fsdp" and no suffix, or sharded=True')
    s.text(x + 12, y + 68, "runs/exp1/ckpt-1200/", mono=True, size=13, bold=True)
    y2 = entry(x, y + 78, (INDEX,), "the index: weight map, distfn.tree, shapes")
    y2 = entry(x, y2, (shard_file(0),), "what rank 0 owns")
    entry(x, y2, (shard_file(1),), "what rank 1 owns (one file per rank)")
    s.text(x + 12, y + 252, "while writing (hidden, never a checkpoint):", size=12)
    entry(x, y + 260, (".ckpt-1200", f".<host>.<pid>.<random>{PARTIAL}"), hidden=True)

    # An object store.
    x, y = xs[0], ys[1]
    panel(x, y, "In a bucket", "an s3:// (or other fsspec) URL instead of a path")
    s.text(x + 12, y + 68, "s3://bucket/runs/exp1/", mono=True, size=13, bold=True)
    y2 = entry(x, y + 78, (one,), "the object (or a sharded directory's objects)")
    y2 = entry(x, y2, (f".{one}{COMMIT_SUFFIX}",), "the commit object: the upload's size and ETag")
    s.text(x + 12, y2 + 10, "No rename in a bucket: an object exists for latest,", size=12)
    s.text(x + 12, y2 + 26, "load, resume and keep= only with its commit object.", size=12)
    s.text(x + 12, y + 252, "a re-save uploads beside it, then switches:", size=12)
    entry(x, y + 260, (f".{one}", f".<host>.<pid>.<random>{DATA}"), hidden=True)

    # keep= rotation, with the step numbers read off the names by STEP_FILE as distfn reads them.
    x, y = xs[1], ys[1]
    panel(x, y, "keep=3 rotation", "the newest 3 of a step-numbered name stay")
    s.text(x + 12, y + 68, f'ctx.save(st, f"ckpt-{{step}}{SUFFIX}", keep=3)', mono=True, size=11)
    names = [f"ckpt-{step}{SUFFIX}" for step in (900, 1000, 1100, 1200)]
    steps = []
    for name in names:
        m = STEP_FILE.match(name)
        if m is None:  # the picture's names must be ones distfn numbers
            raise SystemExit(f"{name} does not match distfn.checkpoint.names.STEP_FILE")
        steps.append(int(m.group("step")))
    kept = sorted(steps)[-3:]
    y2 = y + 80
    for name, step in zip(names, steps, strict=True):
        gone = step not in kept
        y2 = entry(x, y2, (name,), f"step {step}: " + (f"deleted by the save of step {max(steps)}" if gone else "kept"),
                   strike=gone)
    s.text(x + 12, y2 + 8, "distfn.latest(dir) and ctx.resume(state, dir) pick", size=12)
    s.text(x + 12, y2 + 24, "the newest complete one (directories alike).", size=12)
    return s.done()


TIMINGS_RUN = ASSETS / "timings-run.json"
TIMINGS_TITLE = "Where each rank's step time goes: rank 3's input slows at step 60"


def timings_picture() -> str:
    """``ctx.timings(plot=...)``'s picture of the recorded run (`TIMINGS_RUN`), drawn by distfn's own code."""
    import json

    from distfn.timings_plot import Point, svg

    recorded = json.loads(TIMINGS_RUN.read_text(encoding="utf-8"))["points"]
    points = [Point(p["start"], p["steps"], tuple(tuple(r) for r in p["ranks"]),
                    None if p["straggler"] is None else tuple(p["straggler"])) for p in recorded]
    return svg(points, title=TIMINGS_TITLE)


class _SlowFrom:
    """The recorded run's dataset: on the slow rank, 20 ms an item from the 61st item on (a disk slowing down)."""

    def __init__(self, slow: bool) -> None:
        self.slow, self.calls = slow, 0

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> tuple[object, object]:
        import time

        import torch

        self.calls += 1
        if self.slow and self.calls > 60:
            time.sleep(0.02)
        return torch.full((64,), float(i % 7)), torch.ones(4)


def _timings_job(cfg: dict[str, str], ctx: object) -> object:
    import attrs
    import torch
    from torch import nn

    model = ctx.wrap(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ctx.dataloader(_SlowFrom(ctx.rank == 3), batch_size=1)  # type: ignore[attr-defined]
    for i, (x, y) in enumerate(loader):
        ctx.backward(nn.functional.mse_loss(model(x), y))  # type: ignore[attr-defined]
        ctx.step(opt)  # type: ignore[attr-defined]
        if i + 1 >= 200:
            break
    ctx.timings()  # type: ignore[attr-defined]
    history = ctx.run.timings.history  # type: ignore[attr-defined]
    return None if history is None else [attrs.asdict(p, recurse=False) for p in history.points]


def timings_run() -> None:
    """Run the recorded job again (4 gloo ranks, 10-step windows) and rewrite `TIMINGS_RUN` from its points."""
    import json
    import os

    from distfn import distributed

    os.environ["DISTFN_TIMINGS_WINDOW"] = "10"
    points = distributed(mode="ddp", nprocs=4, backend="gloo", seed=0)(_timings_job)({})
    what = ("the points rank 0 kept (distfn.timings_plot.History) in the run of `python docs/pictures.py "
            "--timings-run`: 4 gloo ranks on a 2-core VM, 200 steps, 10-step windows, rank 3's dataset sleeping "
            "20 ms an item from its 61st item on; rounded to the microsecond")
    rows = [json.dumps({**p, "ranks": [[r[0], r[1], *(round(v, 6) for v in r[2:])] for r in p["ranks"]]},
                       separators=(",", ":")) for p in points]
    TIMINGS_RUN.write_text('{"what":' + json.dumps(what) + ',"points":[\n' + ",\n".join(rows) + "\n]}\n",
                           encoding="utf-8")


def mesh_picture() -> str:
    """Which rank holds what on ``mesh={"dp_replicate": 2, "dp_shard": 2, "tp": 2}`` over 8 ranks (2 nodes of 4): the
    coordinates, the batch and the rows of a column-split weight, all read from `distfn.mesh.Layout`."""
    from distfn.mesh import DP_DIMS, MeshSpec

    spec = MeshSpec.parse({"dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert spec is not None
    layout = spec.resolve(8, num_nodes=2, local_world_size=4)
    rows = 8  # fc1.weight's rows: ColwiseParallel splits them over tp, FSDP then each tp half over dp_shard
    # one node a row, 690 px wide: the docs' content column at 1280 px (tests/test_docs.py renders it)
    svg = Svg(690, 560, "mesh={'dp_replicate': 2, 'dp_shard': 2, 'tp': 2} on 8 ranks: which rank holds what")
    svg.text(20, 26, "@distributed(mode=\"fsdp\", mesh={\"dp_replicate\": 2, \"dp_shard\": 2, \"tp\": 2})", mono=True,
             size=12)
    svg.text(20, 44, "on 2 nodes of 4 ranks", size=12, color=MUTED)
    tp, shard = layout.size("tp"), layout.size("dp_shard")
    for node in range(layout.size("dp_replicate")):
        y0 = 58 + node * 212
        svg.box(20, y0, 650, 200, fill=FILL2)
        svg.text(32, y0 + 22, f"node {node}  =  dp_replicate {node}: a whole replica", bold=True, size=13)
        for rank in range(layout.world_size):
            where = layout.coords(rank)
            if where["dp_replicate"] != node:
                continue
            col = where["dp_shard"] * tp + where["tp"]
            x, y = 32 + col * 159, y0 + 36
            svg.box(x, y, 150, 152)
            svg.text(x + 8, y + 20, f"rank {rank}", bold=True)
            svg.text(x + 8, y + 40, f"dp_shard {where['dp_shard']}", size=12, mono=True)
            svg.text(x + 8, y + 56, f"tp {where['tp']}", size=12, mono=True)
            svg.text(x + 8, y + 80, f"batch {layout.dp_rank(rank)}", size=13)
            per_tp = rows // tp
            first = where["tp"] * per_tp + where["dp_shard"] * (per_tp // shard)
            svg.text(x + 8, y + 104, "fc1.weight", size=12, mono=True, color=MUTED)
            svg.text(x + 8, y + 120, f"rows {first}-{first + per_tp // shard - 1}", size=12, mono=True)
            svg.text(x + 8, y + 142, "tp pair: same batch" if where["tp"] == 0 else "", size=11, color=MUTED)
    dp_groups = layout.groups(DP_DIMS)
    svg.text(20, 496, f"tp groups {layout.groups(('tp',))}: one batch per group, a layer's columns split in it",
             size=12)
    svg.text(20, 514, f"dp groups {dp_groups}: the batches; gradients averaged over them", size=12)
    svg.text(20, 532, "FSDP all-gathers within a node (dp_shard), replicas all-reduce across nodes (dp_replicate);",
             size=12)
    svg.text(20, 550, "a checkpoint stores each row once", size=12)
    return svg.done()


PICTURES = {"how-a-call-runs.svg": call_picture, "checkpoint-layout.svg": checkpoint_picture,
            "timings.svg": timings_picture, "mesh.svg": mesh_picture}


def render() -> dict[str, str]:
    """Every picture's file name (under docs/assets/) and its SVG text."""
    return {name: draw() for name, draw in PICTURES.items()}


def main() -> None:
    for name, text in render().items():
        (ASSETS / name).write_text(text, encoding="utf-8", newline="\n")
        sys.stderr.write(f"wrote docs/assets/{name} ({len(text.encode())} bytes)\n")


if __name__ == "__main__":
    if "--timings-run" in sys.argv[1:]:
        timings_run()
    main()
