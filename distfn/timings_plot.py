"""The per-rank timings over the run as a picture (``ctx.timings(plot="timings.svg")``) and as tracker metrics.

Rank 0 keeps a `History` of the windows every rank has reported (`distfn.timings`): each rank's mean data wait,
compute and comm per step over each window, and the straggler the rule named there. It stays small however long
the run: past `MAX_POINTS` windows, neighbouring points are merged two by two (their means weighted by steps), so
a run of a million steps is drawn as 64 to 128 points over its whole length.

`svg` draws it by hand (no plotting library: a core dependency is not added for a picture): every rank's mean
step split into data / compute / comm as one bar (the straggler's label in red), then data, compute and comm
over the steps: the band the other ranks span, their median, and the straggler's own line, so the rank the job
waited for stands out at a glance. `write` writes it to a ``.svg`` file, or a ``.png`` through matplotlib when
that is installed (``pip install matplotlib``; the ``bench`` and ``docs`` extras have it).

The numbers and names come from the ranks (host names) and may be anything: every value that is not a finite,
non-negative number is left out of the scales and the lines, text is escaped and stripped of what XML 1.0 cannot
hold, and the picture's size is bounded (at most `MAX_BARS` bars and `MAX_POINTS` points a line, whatever the
number of ranks or steps).

`metrics` turns one window's table into the flat ``{name: value}`` the trackers receive (``timings/rank3/data_ms``
...), logged by the run at the user's latest step (`distfn.tracking.session.Session.log_beside`).

Imports: `stragglers` (the table's types), `errors`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from html import escape
from pathlib import Path
from typing import BinaryIO, Final

import attrs

from .errors import ConfigError
from .stragglers import TimingTable

#: The most points a `History` (and a line of the picture) holds: beyond, neighbours are merged two by two.
MAX_POINTS: Final = 128
#: The most ranks drawn as bars: with more, the busiest ones (the straggler always among them).
MAX_BARS: Final = 32
#: The longest host name drawn (characters); a longer one is cut.
MAX_NAME: Final = 40
PARTS: Final = ("data", "compute", "comm")
COLORS: Final = {"data": "#1c7ed6", "compute": "#e8590c", "comm": "#adb5bd"}
STRAGGLER_COLOR: Final = "#c92a2a"

#: One rank in one point: (rank, host, data, compute, comm), seconds per step (means over the point's steps).
RankPoint = tuple[int, str, float, float, float]


@attrs.frozen
class Point:
    """Every rank's means over a stretch of steps (one window, or neighbouring windows merged).

    Attributes:
        start: the first step it covers (0-based, counted per rank).
        steps: how many steps it covers.
        ranks: one entry per rank that reported, by rank.
        straggler: ``(rank, cause)`` the rule named over these steps, else ``None``.
    """

    start: int
    steps: int
    ranks: tuple[RankPoint, ...]
    straggler: tuple[int, str] | None = None


def point_of(table: TimingTable) -> Point:
    """A window's table as a `Point` (window ``k`` of ``n`` steps starts at step ``k * n``)."""
    start = (table.window or 0) * table.steps
    ranks = tuple((r.rank, r.host, r.data.mean, r.compute.mean, r.comm.mean) for r in table.ranks)
    found = table.straggler
    return Point(start, table.steps, ranks, None if found is None else (found.rank, found.cause))


def _weighted(a: float, wa: int, b: float, wb: int) -> float:
    """The mean of ``a`` and ``b`` weighted by their steps (equal weights where a count is no usable number)."""
    x, y = _value(wa) or 0.0, _value(wb) or 0.0
    return (a * x + b * y) / (x + y) if x + y > 0 else (a + b) / 2


def merge(a: Point, b: Point) -> Point:
    """Two neighbouring points as one: each rank's means weighted by steps (a rank in one only keeps its own);
    the straggler is the later one's, or the earlier one's when the later has none."""
    mine = {r[0]: r for r in a.ranks}
    theirs = {r[0]: r for r in b.ranks}
    ranks = []
    for rank in sorted(mine.keys() | theirs.keys()):
        x, y = mine.get(rank), theirs.get(rank)
        if x is None or y is None:
            ranks.append(x or y)
            continue
        ranks.append((rank, x[1], _weighted(x[2], a.steps, y[2], b.steps), _weighted(x[3], a.steps, y[3], b.steps),
                      _weighted(x[4], a.steps, y[4], b.steps)))
    return Point(a.start, a.steps + b.steps, tuple(r for r in ranks if r is not None), b.straggler or a.straggler)


def halve(points: Sequence[Point]) -> list[Point]:
    """``points`` with each pair of neighbours merged (an odd last one kept)."""
    out = [merge(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    return out + ([points[-1]] if len(points) % 2 else [])


@attrs.define
class History:
    """Rank 0's record of the run's windows, bounded (see the module docstring).

    Attributes:
        points: the windows (or merged stretches), oldest first; at most `MAX_POINTS`.
        limit: the most points kept.
        added: windows recorded so far (`distfn.timings.Timings.plot` redraws only when it grew).
    """

    points: list[Point] = attrs.field(factory=list)
    limit: int = MAX_POINTS
    added: int = 0  # windows recorded so far: a picture drawn at this count needs no redraw

    def add(self, table: TimingTable) -> None:
        """Record one window's table (its ``window`` set)."""
        self.points.append(point_of(table))
        self.added += 1
        if len(self.points) > self.limit:
            self.points = halve(self.points)


#: Each rank's metric names, made once: a window's row at 512 ranks holds 2,049 of them, and the same strings are
#: shared by every row a tracker keeps while it cannot send (halves a buffered row's memory).
_NAMES: dict[int, tuple[str, ...]] = {}
MAX_NAMED: Final = 100_000


def _names(rank: int) -> tuple[str, ...]:
    found = _NAMES.get(rank)
    if found is None:
        found = tuple(f"timings/rank{rank}/{part}_ms" for part in (*PARTS, "step"))
        if len(_NAMES) < MAX_NAMED:  # the ranks' own numbers: a corrupted row's rank does not grow it for ever
            _NAMES[rank] = found
    return found


def metrics(table: TimingTable) -> dict[str, float]:
    """One window's numbers as tracker metrics: ``timings/rank<r>/{data,compute,comm,step}_ms`` (means over the
    window, ms per step) for every rank, and ``timings/straggler_rank`` (the rank the rule names, -1 for none)."""
    out: dict[str, float] = {}
    for row in table.ranks:
        for name, part in zip(_names(row.rank), (row.data, row.compute, row.comm, row.step), strict=True):
            out[name] = 1000.0 * part.mean
    out["timings/straggler_rank"] = float(table.straggler.rank) if table.straggler is not None else -1.0
    return out


# -- the picture --------------------------------------------------------------------------------------------------
#: The largest number drawn (seconds per step, or a step count): beyond it, no measurement (left out).
LARGEST: Final = 1e15


def _value(x: object) -> float | None:
    """``x`` as a number when it is finite, non-negative and at most `LARGEST`, else ``None`` (left out)."""
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) and 0 <= v <= LARGEST else None


def _text(s: object, limit: int = MAX_NAME) -> str:
    """``s`` as XML text: characters XML 1.0 cannot hold dropped, cut to ``limit``, escaped."""
    raw = str(s)
    kept = "".join(c for c in raw if c in "\t\n\r" or " " <= c <= "\ud7ff" or "\ue000" <= c <= "\ufffd"
                   or "\U00010000" <= c <= "\U0010ffff")
    kept = " ".join(kept.split())
    if len(kept) > limit:
        kept = kept[: limit - 1] + "…"
    return escape(kept, quote=True)


def _ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e7 else f"{x:.1f}".rstrip("0").rstrip(".")


def _mid(p: Point, share: float = 0.5) -> float | None:
    """The step ``share`` of the way through ``p`` (the middle: where its point is drawn), ``None`` when it is no
    finite number."""
    try:
        return _value(p.start + p.steps * share)
    except (TypeError, OverflowError):
        return None


@attrs.frozen
class _Summary:
    """What the picture shows, computed once from the points."""

    points: tuple[Point, ...]
    means: dict[int, tuple[str, float, float, float]]  # rank -> (host, data, compute, comm) over the run
    marked: int | None  # the rank drawn in red: the straggler named most often
    cause: str | None


def _summary(points: Sequence[Point]) -> _Summary:
    pts = list(points)
    while len(pts) > MAX_POINTS:
        pts = halve(pts)
    sums: dict[int, list[float]] = {}
    hosts: dict[int, str] = {}
    for p in points:
        w = max(1, p.steps) if _value(p.steps) else 1
        for rank, host, *parts in p.ranks:
            acc = sums.setdefault(rank, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            hosts.setdefault(rank, host)
            for i, v in enumerate(parts):
                value = _value(v)
                if value is not None:
                    acc[i] += value * w
                    acc[3 + i] += w
    means = {r: (hosts[r], *(a[i] / a[3 + i] if a[3 + i] else 0.0 for i in range(3))) for r, a in sums.items()}
    named = [p.straggler for p in points if p.straggler is not None and p.straggler[0] in means]
    marked = cause = None
    if named:
        (marked, cause), _ = max(((k, named.count(k)) for k in dict.fromkeys(named)), key=lambda kv: kv[1])
    return _Summary(tuple(pts), means, marked, cause)  # type: ignore[arg-type]


_GREY = "#495057"
_WIDTH: Final = 690  # the docs' content column at a 1280 px window (Chromium): shown at its own size
_X0: Final = 20


def _head(s: _Summary, title: str, add: Callable[[str], None]) -> int:
    """The title, what the picture covers and the straggler verdict, the legend; returns the next line's y."""
    y = 30
    add(f'<text x="{_X0}" y="{y}" font-size="18" font-weight="bold">{_text(title, 120)}</text>')
    ends = [x for x in (_mid(p, 1.0) for p in s.points) if x is not None]
    span = f"steps 0–{_num(max(ends))}" if ends else "no steps"
    if s.marked is not None:
        verdict = f"straggler: rank {s.marked} ({_text(s.means[s.marked][0])}), {_text(s.cause or '')}"
    else:
        verdict = "no straggler named"
    y += 22
    add(f'<text x="{_X0}" y="{y}" font-size="13" fill="{_GREY}">{span}, {len(s.means)} rank(s); {verdict}</text>')
    y += 22
    lx = _X0
    for part in PARTS:
        add(f'<rect x="{lx}" y="{y - 11}" width="12" height="12" fill="{COLORS[part]}"/>')
        add(f'<text x="{lx + 17}" y="{y}" font-size="12">{part}</text>')
        lx += 90
    add(f'<rect x="{lx}" y="{y - 6}" width="18" height="3" fill="{STRAGGLER_COLOR}"/>')
    add(f'<text x="{lx + 24}" y="{y}" font-size="12">straggler</text>')
    return y + 26


def _shown(s: _Summary) -> tuple[list[int], str]:
    """The ranks drawn one by one: all, or the `MAX_BARS` busiest (the straggler among them), and a note saying so."""
    shown = sorted(s.means)
    if len(shown) <= MAX_BARS:
        return shown, ""
    busiest = sorted(shown, key=lambda r: -(s.means[r][1] + s.means[r][2]))[:MAX_BARS]
    if s.marked is not None and s.marked not in busiest:
        busiest[-1] = s.marked
    return sorted(busiest), f"the {MAX_BARS} busiest of {len(shown)} ranks"


def _bars(s: _Summary, y: int, add: Callable[[str], None]) -> int:
    """Each rank's mean step as one bar split into data / compute / comm (at most `MAX_BARS`)."""
    label_w = 190
    add(f'<text x="{_X0}" y="{y}" font-size="14" font-weight="bold">Mean step per rank (ms)</text>')
    shown, note = _shown(s)
    top = max((sum(s.means[r][1:]) for r in shown), default=0.0) or 1.0
    bar_w = _WIDTH - _X0 - label_w - 60
    y += 8
    for rank in shown:
        host, *vals = s.means[rank]
        color = f' fill="{STRAGGLER_COLOR}" font-weight="bold"' if rank == s.marked else ""
        add(f'<text x="{_X0}" y="{y + 11}" font-size="12"{color}>rank {rank} ({_text(host, 24)})</text>')
        bx = float(_X0 + label_w)
        for part, v in zip(PARTS, vals, strict=True):
            w = v / top * bar_w
            if w > 0:
                add(f'<rect x="{bx:.1f}" y="{y}" width="{w:.1f}" height="13" fill="{COLORS[part]}"/>')
            bx += w
        add(f'<text x="{bx + 5:.1f}" y="{y + 11}" font-size="11" fill="{_GREY}">{_ms(sum(vals))}</text>')
        y += 17
    if note:
        add(f'<text x="{_X0}" y="{y + 10}" font-size="11" fill="{_GREY}">{note}</text>')
        y += 14
    return y + 16


@attrs.frozen
class _Axes:
    """The steps' axis shared by the three panels."""

    xs: tuple[float | None, ...]  # each point's middle step
    lo: float
    hi: float
    left: float = _X0 + 50
    width: float = _WIDTH - _X0 - 70
    height: float = 92

    def x(self, v: float) -> float:
        if self.hi <= self.lo:
            return self.left + self.width / 2
        return self.left + self.width * (v - self.lo) / (self.hi - self.lo)


def _panel(s: _Summary, k: int, axes: _Axes, y: int, add: Callable[[str], None]) -> int:
    """Part ``k`` (data, compute, comm) over the steps: the other ranks' band and median, the straggler's line."""
    part, ph, px = PARTS[k], axes.height, axes.left
    rows: list[tuple[float, list[float], float | None, bool]] = []  # (x, the others, the straggler, named here)
    for x, p in zip(axes.xs, s.points, strict=True):
        if x is None:
            continue
        found = {r[0]: _value(r[2 + k]) for r in p.ranks}
        others = [v for r, v in found.items() if r != s.marked and v is not None]
        rows.append((x, others, found.get(s.marked) if s.marked is not None else None, p.straggler is not None))
    peak = max([v for _, o, m, _ in rows for v in [*o, *([m] if m is not None else [])]], default=0.0) or 1e-3
    y += 18
    add(f'<text x="{_X0}" y="{y}" font-size="12" font-weight="bold">{part}</text>')
    y += 4
    add(f'<rect x="{px}" y="{y}" width="{axes.width}" height="{ph}" fill="#f8f9fa" stroke="#dee2e6"/>')
    add(f'<text x="{px - 4}" y="{y + 10}" font-size="10" text-anchor="end" fill="{_GREY}">{_ms(peak)}</text>')
    add(f'<text x="{px - 4}" y="{y + ph}" font-size="10" text-anchor="end" fill="{_GREY}">0</text>')

    def at(x: float, v: float) -> str:
        return f"{axes.x(x):.1f},{y + ph - ph * min(v, peak) / peak:.1f}"

    band = [(x, o) for x, o, _, _ in rows if o]
    if band:
        outline = [at(x, max(o)) for x, o in band] + [at(x, min(o)) for x, o in reversed(band)]
        add(f'<polygon points="{" ".join(outline)}" fill="{COLORS[part]}" fill-opacity="0.25" stroke="none"/>')
        median = " ".join(at(x, statistics.median(o)) for x, o in band)
        add(f'<polyline points="{median}" fill="none" stroke="{COLORS[part]}" stroke-width="1.5"/>')
    line = [at(x, m) for x, _, m, _ in rows if m is not None]
    if line:
        add(f'<polyline points="{" ".join(line)}" fill="none" stroke="{STRAGGLER_COLOR}" stroke-width="2"/>')
    for x, _, _, named in rows:  # where the rule named a straggler
        if named:
            add(f'<rect x="{axes.x(x) - 1:.1f}" y="{y + ph + 1}" width="2" height="4" fill="{STRAGGLER_COLOR}"/>')
    return int(y + ph)


def svg(points: Sequence[Point], *, title: str = "Where each rank's step time goes") -> str:
    """The picture of ``points`` (a `History`'s) as SVG text: bars per rank, then data / compute / comm over steps."""
    s = _summary(points)
    body: list[str] = []
    y = _bars(s, _head(s, title, body.append), body.append)
    body.append(f'<text x="{_X0}" y="{y}" font-size="14" font-weight="bold">Over the steps (ms per step): the other '
                "ranks' range and median, the straggler in red</text>")
    xs = tuple(_mid(p) for p in s.points)
    starts = [x for x in (_mid(p, 0.0) for p in s.points) if x is not None]
    ends = [x for x in (_mid(p, 1.0) for p in s.points) if x is not None]
    axes = _Axes(xs, min(starts, default=0.0), max(ends, default=1.0))
    y += 10
    for k in range(len(PARTS)):
        y = _panel(s, k, axes, y, body.append)
    y += 18
    px, pw = axes.left, axes.width
    body.append(f'<text x="{px}" y="{y}" font-size="10" fill="{_GREY}">step {_num(axes.lo)}</text>')
    body.append(f'<text x="{px + pw}" y="{y}" font-size="10" text-anchor="end" fill="{_GREY}">step '
                f"{_num(axes.hi)}</text>")
    body.append(f'<text x="{px + pw / 2}" y="{y}" font-size="10" text-anchor="middle" fill="{_GREY}">red ticks: '
                "windows in which the rule named a straggler</text>")
    height = y + 14
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" '
            f'height="{height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" fill="#1b1b1b">'
            f"<title>{_text(title, 120)}</title>"
            f'<rect width="{_WIDTH}" height="{height}" fill="#ffffff"/>')
    return "\n".join([head, *body, "</svg>"]) + "\n"



def png(points: Sequence[Point], path: Path | BinaryIO, *, title: str = "Where each rank's step time goes") -> None:
    """The same picture through matplotlib (``pip install matplotlib``), as a PNG at ``path`` (or into a file)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib import pyplot as plt
    except ImportError:
        raise ConfigError(f"ctx.timings(plot={str(getattr(path, 'name', path))!r}): a .png needs matplotlib (pip "
                          "install matplotlib); a .svg path needs nothing") from None
    s = _summary(points)
    ranks, _ = _shown(s)
    fig, axes = plt.subplots(4, 1, figsize=(7.6, 2 + 0.25 * len(ranks) + 4.5),
                             gridspec_kw={"height_ratios": [max(1.0, 0.25 * len(ranks)), 1, 1, 1]})
    try:
        left = [0.0] * len(ranks)
        for k, part in enumerate(PARTS):
            vals = [1000 * float(s.means[r][1 + k]) for r in ranks]
            axes[0].barh([str(r) for r in ranks], vals, left=left, color=COLORS[part], label=part)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        axes[0].set_xlabel("mean ms per step")
        axes[0].set_ylabel("rank")
        axes[0].legend(loc="lower right", fontsize=8)
        axes[0].set_title(title if s.marked is None else f"{title}: straggler rank {s.marked} ({s.cause})", fontsize=10)
        xs = [_mid(p) for p in s.points]
        for k, part in enumerate(PARTS):
            ax = axes[1 + k]
            for rank in ranks:  # the busiest ranks (the straggler among them), as the bars
                ys = [next((_value(r[2 + k]) for r in p.ranks if r[0] == rank), None) for p in s.points]
                pairs = [(x, 1000 * v) for x, v in zip(xs, ys, strict=True) if v is not None and x is not None]
                if pairs:
                    red = rank == s.marked
                    ax.plot(*zip(*pairs, strict=True), color=STRAGGLER_COLOR if red else COLORS[part],
                            linewidth=2 if red else 0.8, alpha=1 if red else 0.6)
            ax.set_ylabel(f"{part} ms")
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:  # a figure left open stays in pyplot's list for the life of the process
        plt.close(fig)


def check(path: str | os.PathLike[str]) -> Path:
    """``path`` as a `Path` (``~`` expanded) when it names a ``.svg`` file, or a ``.png`` one with matplotlib
    installed, else a `ConfigError` saying what to change. Every rank calls it at every ``ctx.timings(plot=...)``,
    so what can be known from the path alone fails on every rank at once, never on rank 0 alone (which would leave
    the others waiting at their next collective)."""
    try:
        raw = os.fspath(path)
    except TypeError:
        raw = None
    if not isinstance(raw, str):  # bytes too: a picture's name is text
        raise ConfigError(f"ctx.timings(plot={path!r}): plot is a file path (str or pathlib.Path)")
    if "\x00" in raw:
        raise ConfigError(f"ctx.timings(plot={raw!r}): a file path holds no NUL character")
    try:
        target = Path(raw).expanduser()
    except RuntimeError as exc:  # '~someone' for a user this machine does not have
        raise ConfigError(f"ctx.timings(plot={raw!r}): {exc}: write the home directory's path instead") from None
    suffix = target.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ConfigError(f"ctx.timings(plot={raw!r}): the picture is a .svg (no dependency) or a .png "
                          "(needs matplotlib); name the file so")
    if suffix == ".png" and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"ctx.timings(plot={raw!r}): a .png needs matplotlib (pip install matplotlib); a .svg "
                          "path needs nothing")
    return target


def write(points: Sequence[Point], path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write the picture of ``points`` to ``path``: SVG for ``.svg``, PNG (matplotlib) for ``.png``; any other
    suffix is a `ConfigError`. Missing parent folders are made. The file is written beside, under a name that is
    created afresh (a file, link or FIFO planted there is removed, never written through or opened), and renamed,
    so a reader never sees half of it. An `OSError` (a folder at the path, no room, no permission) is raised:
    `distfn.timings.Timings.plot` turns it into a warning."""
    target = check(path)
    suffix = target.suffix.lower()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    kwargs = {} if title is None else {"title": title}
    try:
        tmp.unlink(missing_ok=True)
        with tmp.open("xb") as f:  # O_EXCL: never through a link planted after the unlink
            if suffix == ".svg":
                f.write(svg(points, **kwargs).encode("utf-8"))
            else:
                png(points, f, **kwargs)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return target


def points_of(tables: Iterable[TimingTable]) -> list[Point]:
    """Tables (one per window) as points: for a picture of tables kept by hand."""
    return [point_of(t) for t in tables]
