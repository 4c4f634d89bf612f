"""distfn.progress: the rank-0 bar and TensorBoard writer on 2 ranks; the no-op writer and a missing
TensorBoard in this process."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch
from loguru import logger

from distfn import distributed
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
    sink = logger.add(messages.append, format="{message}", filter=lambda r: "quiet:" in r["message"])
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

