"""The per-rank timing table (`ctx.timings()`), the straggler rule, and their text: pure values and functions.

`distfn.timings` measures each rank's steps and brings the numbers to rank 0; this module only reads them. It
summarises a rank's steps (`summarise`), decides whether one rank is slower than the others and why
(`find_straggler`), keeps a verdict until it is *persistent* (`Detector`) and formats the table. Nothing here
touches torch, a clock or a store, so the rule is tested with made-up numbers.

Why the rule looks at "busy" time (data wait + compute) and not at the step time: in synchronous data-parallel
training every rank's step takes as long as the slowest one's, because the others wait for it in the gradient
all-reduce. The slow rank is the one that arrives last at the collective, so it waits least there; its busy time
is the largest. The cause is the part (data wait or compute) in which it exceeds the other ranks' median most.

Why the verdict must be persistent, relative and above an absolute floor: on a shared machine a rank is
sometimes descheduled for a few milliseconds. Per-window *medians* ignore the odd slow step, the rule compares
with the other ranks' median (a uniformly slow machine is no straggler), a difference under `FLOOR_S` (or under
`FLOOR_STEP_SHARE` of the step) is noise, and a rank is only named after `PERSIST_WINDOWS` windows in a row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final, Literal

import attrs

Cause = Literal["data", "compute"]

#: A rank is a straggler when its busy time (data + compute per step) exceeds the others' median by this fraction,
RELATIVE: Final = 0.15
#: ... and by at least this many seconds per step (below it, a loaded machine's noise),
FLOOR_S: Final = 0.005
#: ... and by at least this share of the median step time,
FLOOR_STEP_SHARE: Final = 0.05
#: ... in this many consecutive windows.
PERSIST_WINDOWS: Final = 3

#: What a cause means and where to look, for the warning line.
CAUSES: Final[dict[str, tuple[str, str]]] = {
    "data": ("data wait", "the input pipeline on that rank (a slow disk or network share, too few DataLoader "
                          "workers, a shard that decodes slower)"),
    "compute": ("compute", "forward/backward/optimizer on that rank (a slower or throttled device, a noisy "
                           "neighbour, or more work in its batches)"),
}


@attrs.frozen
class Part:
    """One part of a rank's step (seconds per step) over a window or the whole run.

    Attributes:
        mean: the mean over the steps.
        p90: the 90th percentile (``None`` for the whole run: only each window keeps its steps).
        median: the median (what the straggler rule compares; ``None`` for the whole run).
    """

    mean: float
    p90: float | None = None
    median: float | None = None

    @property
    def typical(self) -> float:
        """The median where known, else the mean: what the rule compares."""
        return self.mean if self.median is None else self.median


@attrs.frozen
class RankTimes:
    """One rank's row of the table.

    Attributes:
        rank: the global rank.
        host: its node's host name.
        steps: the steps measured.
        data: time waiting for the next batch in ``ctx.dataloader``'s iterator.
        compute: the rest of the step: forward, backward, optimizer, the user's own code.
        comm: time blocked at the end of backward until the gradient all-reduce finished (waiting for the other
            ranks, then the transfer).
        step: the whole step (from one forward of the wrapped model to the next).
    """

    rank: int
    host: str
    steps: int
    data: Part
    compute: Part
    comm: Part
    step: Part

    def share(self, part: Literal["data", "compute", "comm"]) -> float:
        """The mean share of the step time that ``part`` took (0..1; 0 when no step was measured)."""
        total = self.step.mean
        return getattr(self, part).mean / total if total > 0 else 0.0

    @property
    def busy(self) -> float:
        """Typical data wait + compute per step: the time this rank kept the others waiting, or could have."""
        return self.data.typical + self.compute.typical


@attrs.frozen
class Straggler:
    """The rank the others wait for, and why.

    Attributes:
        rank: its global rank.
        host: its node.
        cause: ``"data"`` (its input pipeline) or ``"compute"`` (its forward/backward/optimizer).
        value: its typical time in that part, seconds per step.
        median: the other ranks' median of that part.
    """

    rank: int
    host: str
    cause: Cause
    value: float
    median: float

    @property
    def message(self) -> str:
        """``rank 1 (node7) is the straggler: data wait 210 ms/step vs 12 ms median — the input pipeline ...``"""
        what, where = CAUSES[self.cause]
        return (f"rank {self.rank} ({self.host}) is the straggler: {what} {ms(self.value)} ms/step vs "
                f"{ms(self.median)} ms median — {where}")


@attrs.frozen
class TimingTable:
    """What ``ctx.timings()`` returns on rank 0: every rank's row over one window (or the whole run).

    Attributes:
        ranks: one row per rank that reported, by rank.
        steps: the steps the window covers (per rank), or the whole run's.
        window: the window's number (0, 1, ...), ``None`` for the whole run.
        straggler: the slowest rank and its cause when the rule names one over these numbers, else ``None``.
    """

    ranks: tuple[RankTimes, ...]
    steps: int
    window: int | None = None
    straggler: Straggler | None = None

    def format(self) -> str:
        """The table as text: ms per step (mean/p90 for a window, mean for the whole run) and each part's share
        of the step, one line per rank, then the straggler verdict."""
        span = "whole run" if self.window is None else f"window {self.window}"
        what = "mean" if self.window is None else "mean/p90"
        header = ["rank", "host", "step ms", "data ms", "share", "compute ms", "share", "comm ms", "share"]
        body = []
        for row in self.ranks:
            cells = [str(row.rank), row.host, _cell(row.step)]
            for part in ("data", "compute", "comm"):
                cells += [_cell(getattr(row, part)), f"{100 * row.share(part):.0f}%"]
            body.append(cells)
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = [f"timings per rank ({span}, {self.steps} steps; ms per step as {what}, share of the step):"]
        for cells in [header, *body]:
            lines.append("  " + "  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(cells, widths, strict=True))))
        lines.append(f"  {self.straggler.message}" if self.straggler else "  no straggler")
        return "\n".join(lines)


def ms(seconds: float) -> str:
    """Milliseconds, with one decimal under 10 ms."""
    value = seconds * 1000
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _cell(part: Part) -> str:
    return ms(part.mean) if part.p90 is None else f"{ms(part.mean)}/{ms(part.p90)}"


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def summarise(samples: Sequence[tuple[float, float, float, float]], *, rank: int, host: str) -> RankTimes:
    """A rank's row over ``samples``: (data, compute, comm, step) seconds, one tuple per step (at least one)."""
    import statistics  # deferred: ~2.5 ms after torch at every job's start (python -X importtime); used per window

    columns = list(zip(*samples, strict=True))
    parts = [Part(statistics.fmean(c), _p90(c), statistics.median(c)) for c in columns]
    return RankTimes(rank, host, len(samples), *parts)


def totals_row(sums: Sequence[float], steps: int, *, rank: int, host: str) -> RankTimes:
    """A rank's whole-run row from its summed (data, compute, comm, step) seconds over ``steps`` steps."""
    parts = [Part(total / steps if steps else 0.0) for total in sums]
    return RankTimes(rank, host, steps, *parts)


def find_straggler(rows: Sequence[RankTimes], groups: Sequence[Sequence[int]] = ()) -> Straggler | None:
    """The rank whose busy time exceeds the others' median beyond the thresholds above, with its cause.

    When the comm part was measured, the slow rank must also wait no longer than the others' median there: the
    rank that arrives last at the all-reduce waits least, so a rank that is busy *and* waits is not what holds
    the others up (it is a noisy reading).

    ``groups``: the tensor-parallel groups of a ``mesh=`` with a ``tp`` dimension. The ranks of one group wait for
    each other inside every forward (their collectives count as compute), so a slow rank makes its whole group
    look slow: it is compared with the ranks *outside* its group only, and a job that is one group has no
    straggler (a tensor-parallel group is not a straggler of itself).
    """
    import statistics  # see `summarise`

    if len(rows) < 2:
        return None
    slow = max(rows, key=lambda r: r.busy)
    peers = next((set(g) for g in groups if slow.rank in g), {slow.rank})
    others = [r for r in rows if r.rank not in peers]
    if not others:
        return None
    busy = statistics.median(r.busy for r in others)
    step = statistics.median(r.step.typical for r in rows)
    excess = slow.busy - busy
    if excess <= RELATIVE * busy or excess <= max(FLOOR_S, FLOOR_STEP_SHARE * step):
        return None
    comm = statistics.median(r.comm.typical for r in others)
    if any(r.comm.mean > 0 for r in rows) and slow.comm.typical > comm:
        return None
    data = statistics.median(r.data.typical for r in others)
    compute = statistics.median(r.compute.typical for r in others)
    if slow.data.typical - data >= slow.compute.typical - compute:
        return Straggler(slow.rank, slow.host, "data", slow.data.typical, data)
    return Straggler(slow.rank, slow.host, "compute", slow.compute.typical, compute)


@attrs.define
class Detector:
    """Turns per-window verdicts into one warning per persistent straggler.

    ``observe`` returns the straggler once the same rank has been named with the same cause in `PERSIST_WINDOWS`
    consecutive windows, and only the first time for that (rank, cause): a job whose rank 3 is slow all along
    gets one warning line, not one per window.
    """

    windows: int = PERSIST_WINDOWS
    _run: tuple[int, str] | None = None
    _count: int = 0
    _warned: set[tuple[int, str]] = attrs.field(factory=set)

    def observe(self, straggler: Straggler | None) -> Straggler | None:
        """Feed one window's verdict; returns the straggler to warn about now, or ``None``."""
        key = None if straggler is None else (straggler.rank, straggler.cause)
        self._count = self._count + 1 if key is not None and key == self._run else (1 if key else 0)
        self._run = key
        if straggler is None or key is None or self._count < self.windows or key in self._warned:
            return None
        self._warned.add(key)
        return straggler

    def warned(self, straggler: Straggler) -> bool:
        """Whether this straggler (its rank and cause) was warned about."""
        return (straggler.rank, straggler.cause) in self._warned


def to_payload(row: RankTimes) -> dict[str, Any]:
    """A row as plain JSON-able values (what a rank sends to rank 0)."""
    return attrs.asdict(row)


def from_payload(payload: dict[str, Any]) -> RankTimes:
    """The row `to_payload` made."""
    parts = {name: Part(**payload[name]) for name in ("data", "compute", "comm", "step")}
    return RankTimes(rank=int(payload["rank"]), host=str(payload["host"]), steps=int(payload["steps"]), **parts)
