"""The per-rank timings as a picture and as tracker metrics (issue 44, item 1): rank 0's bounded history of the
windows, the hand-drawn SVG (the straggler named and drawn in red; well-formed and bounded whatever the numbers and
host names: Hypothesis), the PNG through matplotlib, ``ctx.timings(plot=...)``'s path check, and the windows handed
to the trackers at the user's latest step. The real 2-rank job that draws one and tracks them is in
tests/test_timings.py (``test_a_rank_with_a_slow_dataset_is_named_for_data``)."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import math
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from distfn import timings_plot
from distfn.errors import ConfigError
from distfn.stragglers import Part, RankTimes, TimingTable, find_straggler
from distfn.timings import HostClock, Timings
from distfn.timings_plot import History, Point, merge, metrics, svg, write
from distfn.tracking.session import Session

SVG = "{http://www.w3.org/2000/svg}"
MS = 0.001


def _row(rank: int, data: float, compute: float, comm: float, host: str = "vm") -> RankTimes:
    step = data + compute + comm
    return RankTimes(rank, host, 50, Part(data, data, data), Part(compute, compute, compute),
                     Part(comm, comm, comm), Part(step, step, step))


def _table(window: int, world: int = 4, slow: int | None = 3, steps: int = 50) -> TimingTable:
    rows = [_row(r, (40 if r == slow else 1) * MS, 5 * MS, (2 if r == slow else 41) * MS) for r in range(world)]
    return TimingTable(tuple(rows), steps=steps, window=window, straggler=find_straggler(rows))


def _texts(text: str) -> list[str]:
    return ["".join(t.itertext()) for t in ET.fromstring(text).iter(f"{SVG}text")]


def test_the_history_stays_bounded_and_covers_the_whole_run() -> None:
    history = History()
    for w in range(1000):
        history.add(_table(w, world=2, slow=1 if w >= 500 else None))
    points = history.points
    assert timings_plot.MAX_POINTS // 2 <= len(points) <= timings_plot.MAX_POINTS
    assert points[0].start == 0 and points[-1].start + points[-1].steps == 1000 * 50
    assert sum(p.steps for p in points) == 1000 * 50  # every step still counted, once
    assert all(a.start + a.steps == b.start for a, b in itertools.pairwise(points))
    merged = merge(Point(0, 10, ((0, "a", 1.0, 0.0, 0.0),)), Point(10, 30, ((0, "a", 3.0, 0.0, 0.0),)))
    assert merged.ranks[0][2] == pytest.approx(2.5)  # weighted by steps


def test_the_picture_names_the_straggler_and_draws_it_in_red() -> None:
    history = History()
    for w in range(20):
        history.add(_table(w))
    text = svg(history.points)
    texts = _texts(text)
    assert "steps 0–1000, 4 rank(s); straggler: rank 3 (vm), data" in texts
    root = ET.fromstring(text)
    red = [t for t in root.iter(f"{SVG}text") if t.get("fill") == timings_plot.STRAGGLER_COLOR]
    assert ["".join(t.itertext()) for t in red] == ["rank 3 (vm)"]
    lines = [p for p in root.iter(f"{SVG}polyline") if p.get("stroke") == timings_plot.STRAGGLER_COLOR]
    assert len(lines) == 3 and all(len(p.get("points", "").split()) == 20 for p in lines)  # data, compute, comm
    assert root.get("width") == "690"  # shown at its own size in the docs' 1280 px layout


def test_no_straggler_is_said_so_and_nothing_is_red() -> None:
    text = svg([timings_plot.point_of(_table(w, slow=None)) for w in range(5)])
    assert any(t.endswith("; no straggler named") for t in _texts(text))
    red = [e for e in ET.fromstring(text).iter() if timings_plot.STRAGGLER_COLOR in (e.get("fill"), e.get("stroke"))]
    assert len(red) == 1  # the legend's swatch only


def test_many_ranks_show_the_busiest_with_the_straggler_among_them() -> None:
    text = svg([timings_plot.point_of(_table(w, world=512, slow=300)) for w in range(3)])
    bars = [t for t in _texts(text) if t.startswith("rank ")]
    assert len(bars) == timings_plot.MAX_BARS and "rank 300 (vm)" in bars
    assert "the 32 busiest of 512 ranks" in _texts(text)


def test_metrics_for_the_trackers() -> None:
    found = metrics(_table(0, world=2, slow=1))
    assert found["timings/rank1/data_ms"] == pytest.approx(40) and found["timings/rank0/comm_ms"] == pytest.approx(41)
    assert found["timings/rank0/step_ms"] == pytest.approx(47) and found["timings/straggler_rank"] == 1.0
    assert metrics(_table(0, world=2, slow=None))["timings/straggler_rank"] == -1.0


def test_write_checks_the_suffix_and_replaces_the_file_whole(tmp_path: Path) -> None:
    points = [timings_plot.point_of(_table(0))]
    with pytest.raises(ConfigError, match=r"\.svg \(no dependency\) or a \.png"):
        write(points, tmp_path / "timings.jpg")
    with pytest.raises(ConfigError, match="plot is a file path"):
        timings_plot.check(42)  # type: ignore[arg-type]
    target = tmp_path / "t.SVG"
    target.write_text("old")
    assert write(points, target) == target and ET.parse(target).getroot().tag == f"{SVG}svg"
    assert [p.name for p in tmp_path.iterdir()] == ["t.SVG"]  # no temporary file left


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the PNG needs matplotlib")
def test_a_png_through_matplotlib(tmp_path: Path) -> None:
    path = write([timings_plot.point_of(_table(w)) for w in range(4)], tmp_path / "t.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") >= 600  # width in pixels
    # hostile numbers and names, 512 ranks: drawn all the same (the 32 busiest ranks' lines, not 512)
    ranks = tuple((r, "h<&>\x00", math.nan if r == 5 else 0.001 * r, math.inf if r == 7 else 0.01, -1.0)
                  for r in range(512))
    path = write([Point(50 * i, 50, ranks, (300, "data")) for i in range(20)], tmp_path / "hostile.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_windows_reach_the_history_and_the_trackers_at_the_users_step(tmp_path: Path) -> None:
    run = Timings(enabled=True, window=4)
    session = Session([], cfg={}, env={})
    calls: list[dict[str, float]] = []
    session.log_beside = calls.append  # type: ignore[method-assign]
    run.on_table = lambda table: session.log_beside(metrics(table))
    recorder = run.start(0, 1, None, HostClock())
    for _ in range(13):
        recorder.boundary()
    assert run.history is not None and [p.start for p in run.history.points] == [0, 4, 8]
    assert len(calls) == 3 and set(calls[0]) >= {"timings/rank0/data_ms", "timings/straggler_rank"}
    assert run.plot(tmp_path / "t.svg") == tmp_path / "t.svg"
    with pytest.raises(ConfigError):
        Timings(enabled=True).plot(tmp_path / "t.txt")  # checked even where nothing is drawn (other ranks)
    assert Timings(enabled=True).plot(tmp_path / "u.svg") is None and not (tmp_path / "u.svg").exists()

    def broken(table: TimingTable) -> None:
        raise RuntimeError("tracker down")

    run.on_table = broken
    for _ in range(4):
        recorder.boundary()  # never raises into the step; the hand-over is switched off
    assert run.on_table is None and len(run.history.points) == 4


def _drawn(tmp_path: Path) -> Timings:
    run = Timings(enabled=True, window=2)
    recorder = run.start(0, 1, None, HostClock())
    for _ in range(5):
        recorder.boundary()
    return run


def test_a_plot_that_cannot_be_written_is_a_warning_never_an_exception(tmp_path: Path,
                                                                        warnings_seen: list[str]) -> None:
    """Only rank 0 writes: an exception there alone would leave the other ranks at their next collective."""
    run = _drawn(tmp_path)
    (tmp_path / "dir.svg").mkdir()
    blocked = tmp_path / "file"
    blocked.write_text("a file where a folder should be")
    for path in (tmp_path / "dir.svg", blocked / "x.svg", tmp_path / ("a" * 300 + ".svg")):
        assert run.plot(path) is None
        assert run.plot(path) is None  # said once per path and error, not at every call
    assert len(warnings_seen) == 3 and all("could not be written" in w for w in warnings_seen)
    assert (tmp_path / "dir.svg").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["dir.svg", "file"]

    def drawing_fails(*args: object, **kwargs: object) -> str:
        raise ValueError("a drawing bug")

    original = timings_plot.svg
    timings_plot.svg = drawing_fails  # type: ignore[assignment]
    try:
        assert run.plot(tmp_path / "t.svg") is None and not (tmp_path / "t.svg").exists()
    finally:
        timings_plot.svg = original
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # no half-written picture left


def test_what_the_path_alone_tells_fails_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank without history (every rank but 0, or rank 0 before its first window) raises what rank 0 would."""
    other = Timings(enabled=True)
    for bad, said in ((b"t.svg", "plot is a file path"), ("t\x00.svg", "no NUL"), ("t.SVG.txt", r"\.svg"),
                      (tmp_path, r"\.svg"), ("~no-such-user-44/t.svg", "home directory")):
        with pytest.raises(ConfigError, match=said):
            other.plot(bad)  # type: ignore[arg-type]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # a bare venv: no matplotlib
                        lambda name, *a, **k: None if name == "matplotlib" else real(name, *a, **k))
    with pytest.raises(ConfigError, match=r"a \.png needs matplotlib \(pip install matplotlib\)"):
        other.plot(tmp_path / "t.png")  # no window yet: raised all the same, on every rank alike
    assert other.plot(tmp_path / "t.svg") is None


def test_odd_but_valid_paths_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _drawn(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert run.plot("~/runs/t.svg") == tmp_path / "home" / "runs" / "t.svg"  # ~ expanded, parents made
    assert run.plot(tmp_path / "new" / "deep" / "T.SVG") == tmp_path / "new" / "deep" / "T.SVG"
    real = tmp_path / "real.svg"
    real.write_text("kept")
    (tmp_path / "link.svg").symlink_to(real)
    assert run.plot(tmp_path / "link.svg") is not None
    assert real.read_text() == "kept" and not (tmp_path / "link.svg").is_symlink()  # the link replaced, not followed
    os.mkfifo(tmp_path / "fifo.svg")
    assert run.plot(tmp_path / "fifo.svg") is not None and (tmp_path / "fifo.svg").is_file()
    for path in (tmp_path / "home" / "runs" / "t.svg", tmp_path / "fifo.svg"):
        assert ET.parse(path).getroot().tag == f"{SVG}svg"


def test_a_plot_with_the_timings_switched_off_says_so_once(tmp_path: Path, warnings_seen: list[str]) -> None:
    off = Timings(enabled=False)
    assert off.plot(tmp_path / "t.svg") is None and off.plot(tmp_path / "t.svg") is None
    assert len(warnings_seen) == 1 and "DISTFN_TIMINGS=0 switches the timings off" in warnings_seen[0]
    assert not (tmp_path / "t.svg").exists()


def test_a_plot_asked_for_every_step_is_drawn_once_a_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 512 ranks a picture takes about 0.15 s to draw: asked for at every step it is drawn again only when a new
    window came in (or the file is gone), not at every call."""
    drawn: list[int] = []
    real = timings_plot.write
    monkeypatch.setattr(timings_plot, "write", lambda points, path: drawn.append(len(points)) or real(points, path))
    run = Timings(enabled=True, window=4)
    recorder = run.start(0, 1, None, HostClock())
    target = tmp_path / "t.svg"
    answers = []
    for _ in range(4 * 5 + 1):
        recorder.boundary()
        answers.append(run.plot(target))
    assert drawn == [1, 2, 3, 4, 5] and answers.count(target) == 4 * 4 + 1  # five windows, five pictures
    target.unlink()
    assert run.plot(target) == target and target.is_file() and drawn[-1] == 5  # gone: drawn again


def test_a_file_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    """The picture is written beside, then renamed: a link or FIFO already at that name (another user's, in a
    shared folder) is removed, never followed (which would overwrite its target) nor opened (a FIFO blocks)."""
    run = _drawn(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("victim")
    (tmp_path / f".a.svg.{os.getpid()}.tmp").symlink_to(victim)
    os.mkfifo(tmp_path / f".b.svg.{os.getpid()}.tmp")
    assert run.plot(tmp_path / "a.svg") == tmp_path / "a.svg" and run.plot(tmp_path / "b.svg") == tmp_path / "b.svg"
    assert victim.read_text() == "victim"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.svg", "b.svg", "victim"]


class _Backend:
    name, on_error, log_cfg = "fake", "buffer", False


def test_log_beside_waits_for_the_users_first_step_and_never_moves_it() -> None:
    session = Session([_Backend()], cfg={}, env={})  # type: ignore[list-item]
    session.log_beside({"timings/rank0/data_ms": 1.0})
    assert not session.started and session._queued == 0  # no run opened by distfn's own numbers
    session._start = lambda: setattr(session, "_thread", object())  # type: ignore[method-assign]
    session.log_metrics({"loss": 1.0}, step=7)
    session.log_beside({"timings/rank0/data_ms": 2.0})
    assert list(session._queue)[-1] == ("beside", (7, {"timings/rank0/data_ms": 2.0})) and session.high == 7
    session.log_metrics({"loss": 0.5})  # the user's next step follows, undisturbed
    assert session.high == 8


def test_no_timings_rows_pile_up_while_the_trackers_cannot_take_them() -> None:
    """A tracker down (``on_error="buffer"``) keeps the user's rows for later, not distfn's: at 512 ranks a timings
    row is 2,049 values and `MAX_PENDING` counts rows. Nor are they queued while the thread is stuck."""
    from distfn.tracking.session import BESIDE_BACKLOG

    class Down:
        name, on_error, log_cfg = "down", "buffer", False

        def open(self, run: object) -> object:
            raise ConnectionError("server unreachable")

    session = Session([Down()], cfg={}, env={}, flush_every=0.01)  # type: ignore[list-item]
    channel = session._channels[0]

    def wait(until: Callable[[], bool]) -> None:
        for _ in range(1000):
            if until():
                return
            time.sleep(0.01)

    session.log_metrics({"loss": 1.0}, step=1)
    wait(lambda: channel.failing)
    session.log_metrics({"loss": 1.0}, step=2)
    assert not session.beside_due
    session.log_beside({"timings/rank0/data_ms": 1.0})
    wait(lambda: not session._queue and len(channel.rows) >= 2)
    rows = list(channel.rows)
    assert [step for step, _ in rows] == [1, 2] and all("loss" in values for _, values in rows)  # the user's, kept
    stuck = Session([_Backend()], cfg={}, env={})  # type: ignore[list-item]
    stuck._start = lambda: setattr(stuck, "_thread", object())  # type: ignore[method-assign]
    for step in range(BESIDE_BACKLOG):
        stuck.log_metrics({"loss": 1.0}, step=step)
    assert not stuck.beside_due  # nothing drains the queue: no side row joins it
    session.close("FINISHED")


def test_one_timings_row_per_user_step_and_the_users_own_names_stay_the_users(tmp_path: Path,
                                                                             warnings_seen: list[str]) -> None:
    """A user who logs once an epoch (many windows per step) gets one timings row at that step, not a stack of
    values at one x; a name the user logs too under ``timings/`` is left to the user. Through the CSV backend."""
    from distfn.tracking import CSV

    session = Session([CSV(root=str(tmp_path))], cfg={}, env={"DISTFN_JOB_KEY": "k"}, flush_every=0.02)
    run = Timings(enabled=True, window=2)
    run.on_table = lambda table: session.log_beside(metrics(table))
    recorder = run.start(0, 1, None, HostClock())
    for epoch in range(3):
        session.log_metrics({"loss": 1.0 / (epoch + 1)}, step=epoch)
        if epoch == 2:
            session.log_metrics({"timings/rank0/data_ms": -5.0}, step=epoch)  # the user's own, same name
            session.flush(10)
        for _ in range(10):  # five windows within each epoch
            recorder.boundary()
    session.log_metrics({"loss": 0.1}, step=3)
    recorder.boundary()
    recorder.boundary()
    session.close("FINISHED")
    rows = list(csv.DictReader(next(tmp_path.glob("*/metrics.csv")).open()))
    mine = [(int(r["step"]), float(r["value"])) for r in rows if r["name"] == "timings/rank0/data_ms"]
    assert [s for s, _ in mine] == [0, 1, 2] and mine[2] == (2, -5.0)  # from then on, only the user's
    beside = [int(r["step"]) for r in rows if r["name"] == "timings/rank0/compute_ms"]
    assert beside == [0, 1, 2, 3]  # one per step, never stacked
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps)  # never backwards
    assert sum("leaves those names to you" in w for w in warnings_seen) == 1, warnings_seen
    assert run.history is not None and sum(p.steps for p in run.history.points) == 30  # every window


# -- hostile input: any numbers, any names, any sizes --------------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(-1.0), st.just(0.0),
                     st.floats(min_value=0, max_value=10))
_names = st.text(max_size=200)  # any code point: control characters, lone surrogates, <&>"'
_rank = st.tuples(st.integers(0, 10_000), _names, _numbers, _numbers, _numbers)
_points = st.lists(st.builds(Point, st.integers(0, 10**30), st.integers(0, 10**30),
                             st.lists(_rank, max_size=6).map(tuple),
                             st.none() | st.tuples(st.integers(0, 10_000), _names)), max_size=140)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=_points, title=_names)
def test_any_input_draws_well_formed_bounded_svg(points: list[Point], title: str) -> None:
    text = svg(points, title=title)
    root = ET.fromstring(text)  # well-formed XML, whatever the names held
    assert root.tag == f"{SVG}svg" and 0 < float(root.get("height", "0")) < 5000
    assert len(text.encode()) < 150_000
    for element in root.iter():
        for key in ("x", "y", "width", "height"):
            value = element.get(key)
            if value is not None:
                assert math.isfinite(float(value)), (element.tag, key, value)


@pytest.mark.parametrize(("world", "windows"), [(1, 0), (1, 1), (2, 700), (512, 3), (512, 130)])
def test_one_rank_to_512_and_many_windows_stay_bounded(world: int, windows: int) -> None:
    history = History()
    for w in range(windows):
        history.add(_table(w, world=world, slow=world - 1 if world > 1 else None))
    text = svg(history.points)
    ET.fromstring(text)
    assert len(text.encode()) < 150_000 and len(history.points) <= timings_plot.MAX_POINTS


@settings(max_examples=200, deadline=None)
@given(path=st.text(max_size=300) | st.binary(max_size=50) | st.integers() | st.none())
def test_property_any_plot_argument_is_a_path_or_a_config_error(path: object) -> None:
    """What the user passes as ``plot=`` is read on every rank: a `Path` or a `ConfigError`, nothing else."""
    try:
        found = timings_plot.check(path)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert "ctx.timings(plot=" in str(exc)
        return
    assert isinstance(found, Path) and found.suffix.lower() in (".svg", ".png") and "\x00" not in str(found)
