"""distfn.progress: the rank-0 bar and TensorBoard writer on 2 ranks; the no-op writer and a missing
TensorBoard in this process; off a terminal, log lines at a steady cadence (a fake clock drives it)."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch
from loguru import logger

from distfn import distributed, logs, progress
from distfn.progress import NullWriter, Progress, writer

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _progress_and_writer(ctx, log_dir: str) -> dict:
    buf = io.StringIO()
    bar = ctx.progress(range(5), desc="epoch 1", file=buf, disable=False, mininterval=0)
    for i in bar:
        bar.log(loss=torch.tensor(float(i)))
    quiet = ctx.progress(range(3), desc="quiet")  # stderr is not a terminal under pytest
    for _ in quiet:
        quiet.log(loss=1.5)
    for _ in ctx.progress(range(4), desc="batch", log_seconds=0):  # a line per step, as a slow loop gets
        pass
    out = {"bar_text": buf.getvalue(), "bar_visible": bar.visible, "bar_means": bar.means,
           "quiet_visible": quiet.visible, "len": len(bar)}
    try:
        w = ctx.writer(log_dir)
    except ImportError as exc:
        out["writer_error"] = str(exc)
        return out
    out["writer"] = type(w).__name__
    from torch.utils.tensorboard import SummaryWriter

    names = [n for n in dir(SummaryWriter) if not n.startswith("_") and callable(getattr(SummaryWriter, n))]
    out["writer_methods_missing"] = [n for n in names if not callable(getattr(w, n, None))]
    w.add_scalar("loss", 1.0, 0)
    w.add_scalars("pair", {"a": 1.0, "b": 2.0}, 0)
    w.flush()
    w.close()
    ctx.barrier()
    out["event_files"] = sorted(p.name.split(".")[0] for p in Path(log_dir).rglob("events.out.tfevents.*"))
    return out


@distributed(nprocs=2, seed=0)
def _progress_job(cfg, ctx):
    messages: list[str] = []
    sink = logger.add(messages.append, format="{message}",
                      filter=lambda r: r["message"].startswith(("quiet:", "batch:")))
    out = {"rank": ctx.rank}
    out.update(_progress_and_writer(ctx, cfg))
    logger.remove(sink)
    out["messages"] = messages
    return ctx.gather_object(out)


def test_progress_and_writer_on_two_ranks(tmp_path: Path) -> None:
    r0, r1 = _progress_job(str(tmp_path / "tb"))
    # Progress: a bar with the running mean on rank 0 only; silent off a terminal, with a summary line.
    assert "epoch 1" in r0["bar_text"] and "5/5" in r0["bar_text"] and "loss=2" in r0["bar_text"]
    assert r0["bar_visible"] and r0["bar_means"] == {"loss": 2.0} and r0["len"] == 5
    assert r1["bar_text"] == "" and not r1["bar_visible"] and r1["bar_means"] == {}
    assert not r0["quiet_visible"] and not r1["quiet_visible"]
    assert any("quiet: 3 iterations, mean loss=1.5" in m for m in r0["messages"])
    assert not any("quiet:" in m for m in r1["messages"])
    # Off a terminal the log lines come from rank 0 only: steps 1-3 (the 4th is the end line's), then the end.
    batch = [m.strip() for m in r0["messages"] if m.startswith("batch:")]
    assert [m.split(" (")[0] for m in batch] == ["batch: 1/4", "batch: 2/4", "batch: 3/4",
                                                 "batch: 4 iterations in 0:00"]
    assert r1["messages"] == []

    # Writer: a real SummaryWriter on rank 0, a no-op with the same methods on rank 1 (one event file).
    if HAS_TENSORBOARD:
        assert r0["writer"] == "SummaryWriter" and r1["writer"] == "NullWriter"
        assert r1["writer_methods_missing"] == []
        assert r0["event_files"] == r1["event_files"] == ["events"] * 3  # main + 2 add_scalars runs, rank 0's
    else:
        assert "distfn[tensorboard]" in r0["writer_error"] and "distfn[tensorboard]" in r1["writer_error"]


def test_null_writer_and_missing_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    if HAS_TENSORBOARD:
        assert isinstance(writer(False, "runs/x"), NullWriter)
    null = NullWriter("runs/x")
    assert null.add_scalar("a", 1.0) is None and null.add_anything_new() is None and null.get_logdir() == "runs/x"
    with null as same:
        same.flush()
    with pytest.raises(AttributeError):
        null.not_a_writer_method  # noqa: B018
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"distfn\[tensorboard\]"):
        writer(True, "runs/x")


def test_the_bar_needs_no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # tqdm is a declared dependency (issue 11): rank 0 always gets a real bar, and a broken install fails loudly
    # instead of silently drawing nothing.
    buf = io.StringIO()
    bar = Progress(range(2), enabled=True, desc="d", file=buf, disable=False, mininterval=0)
    assert list(bar) == [0, 1] and bar.visible and "2/2" in buf.getvalue()
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError):
        Progress(range(2), enabled=True)



class FakeTime:
    """Stands in for the ``time`` module inside distfn.progress: ``monotonic()`` moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _batch_log(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], iterable, step_s: float,
               **kwargs) -> list[str]:
    """Iterate a rank-0 Progress off a terminal, ``step_s`` fake seconds per step; return distfn's log lines."""
    clock = FakeTime()
    monkeypatch.setattr(progress, "time", clock)
    logs.setup(0, 2)  # distfn's sink on sys.stderr (capsys's), as in a rank of a batch job
    try:
        bar = Progress(iterable, enabled=True, desc="train", file=io.StringIO(), **kwargs)  # not a terminal
        assert not bar.visible
        for i in bar:
            clock.now += step_s
            bar.log(loss=torch.tensor(float(i)))
    finally:
        logs.teardown()
    return [line for line in capsys.readouterr().err.splitlines() if "| train: " in line]


def test_off_a_terminal_rank_0_logs_every_10_percent(monkeypatch, capsys) -> None:
    lines = _batch_log(monkeypatch, capsys, range(100), step_s=1.0)
    # distfn's format, a line every 10 % (10 s apart here, more than the 5 s gap), the last step in the end line.
    assert len(lines) == 10, lines
    assert all(" | INFO    | rank 0/2 | train: " in line for line in lines)
    assert lines[0].endswith("train: 10/100 (10%) in 0:10, 1 it/s, ETA 1:30, mean loss=4.5")
    assert lines[8].endswith("train: 90/100 (90%) in 1:30, 1 it/s, ETA 0:10, mean loss=44.5")
    assert lines[9].endswith("train: 100 iterations, mean loss=49.5 in 1:40 (1 it/s)")


def test_off_a_terminal_a_slow_loop_logs_every_minute(monkeypatch, capsys) -> None:
    lines = _batch_log(monkeypatch, capsys, range(10_000), step_s=2.0)  # 10 % would be 33 minutes
    assert len(lines) == 10_000 * 2 // 60 + 1, lines[:3]
    assert lines[0].endswith("train: 30/10000 (0%) in 1:00, 2 s/it, ETA 5:32:20, mean loss=14.5")
    assert lines[1].endswith("train: 60/10000 (1%) in 2:00, 2 s/it, ETA 5:31:20, mean loss=29.5")


def test_off_a_terminal_the_gap_keeps_a_fast_loop_quiet_and_no_length_means_time_only(monkeypatch, capsys) -> None:
    # 100 steps of 0.1 s: 10 % comes every second, but lines stay 5 s apart (MIN_GAP_S): one at step 50.
    lines = _batch_log(monkeypatch, capsys, range(100), step_s=0.1)
    assert [line.split("| train: ")[1] for line in lines] == [
        "50/100 (50%) in 0:05, 10 it/s, ETA 0:05, mean loss=24.5", "100 iterations, mean loss=49.5 in 0:10 (10 it/s)"]
    # A generator has no length: no percentage, no ETA, a line every log_seconds.
    lines = _batch_log(monkeypatch, capsys, (i for i in range(25)), step_s=1.0, log_seconds=10)
    assert [line.split("| train: ")[1] for line in lines] == [
        "10 steps in 0:10, 1 it/s, mean loss=4.5", "20 steps in 0:20, 1 it/s, mean loss=9.5",
        "25 iterations, mean loss=12 in 0:25 (1 it/s)"]


def test_a_terminal_keeps_its_bar_and_no_log_lines(monkeypatch, capsys) -> None:
    clock = FakeTime()
    monkeypatch.setattr(progress, "time", clock)
    buf = io.StringIO()
    logs.setup(0, 2)
    try:
        bar = Progress(range(50), enabled=True, desc="train", file=buf, disable=False, mininterval=0)
        for _ in bar:
            clock.now += 60.0
    finally:
        logs.teardown()
    assert "50/50" in buf.getvalue() and "| train: " not in capsys.readouterr().err


def test_bad_cadence_is_refused_naming_the_defaults() -> None:
    with pytest.raises(ValueError, match=r"log_percent > 0 .* defaults are 10 and 60"):
        Progress(range(2), enabled=True, log_percent=0)


def test_a_second_pass_counts_its_own_steps(monkeypatch, capsys) -> None:
    clock = FakeTime()
    monkeypatch.setattr(progress, "time", clock)
    logs.setup(0, 2)
    try:
        bar = Progress(range(3), enabled=True, desc="train", file=io.StringIO())
        for _ in range(2):  # e.g. one Progress over an evaluation loader, iterated every epoch
            for _ in bar:
                clock.now += 1.0
    finally:
        logs.teardown()
    ends = [line.split("| train: ")[1] for line in capsys.readouterr().err.splitlines() if "| train: " in line]
    assert ends == ["3 iterations in 0:03 (1 it/s)"] * 2
