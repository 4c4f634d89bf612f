"""Per-rank timings (issue 30): the straggler rule on made-up numbers, the step recorder on a fake CUDA clock
(read lazily, never synchronised inside the loop), the autograd bracket around DDP's end-of-backward wait, the
warning through ``ctx.progress``, and 2-3 rank gloo jobs (tests/scripts/timings_job.py): a rank whose dataset
sleeps is named for "data", one that busy-loops in forward for "compute", identical ranks for nothing."""

from __future__ import annotations

import csv
import io
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from distfn import stragglers, timings
from distfn.errors import ConfigError
from distfn.progress import Progress
from distfn.stragglers import Detector, Part, RankTimes, find_straggler, summarise
from distfn.timings import CudaClock, HostClock, Recorder, Timings

from conftest import clean_env, run_python

JOB = str(Path(__file__).resolve().parent / "scripts" / "timings_job.py")
MS = 0.001


def _row(rank: int, data: float, compute: float, comm: float, host: str = "node") -> RankTimes:
    step = data + compute + comm
    return RankTimes(rank, host, 50, Part(data, data, data), Part(compute, compute, compute),
                     Part(comm, comm, comm), Part(step, step, step))


# -- the rule --------------------------------------------------------------------------------------------------
def test_a_rank_slow_in_data_is_named_with_its_cause() -> None:
    rows = [_row(0, 1 * MS, 20 * MS, 200 * MS), _row(1, 2 * MS, 21 * MS, 199 * MS),
            _row(2, 1 * MS, 20 * MS, 201 * MS), _row(3, 210 * MS, 20 * MS, 1 * MS, host="node7")]
    found = find_straggler(rows)
    assert found is not None and (found.rank, found.cause, found.host) == (3, "data", "node7")
    assert found.message.startswith("rank 3 (node7) is the straggler: data wait 210 ms/step vs 1.0 ms median — "
                                    "the input pipeline on that rank")


def test_a_rank_slow_in_compute_is_named_for_compute() -> None:
    found = find_straggler([_row(0, 1 * MS, 20 * MS, 60 * MS), _row(1, 1 * MS, 80 * MS, 1 * MS)])
    assert found is not None and (found.rank, found.cause) == (1, "compute")
    assert "compute 80 ms/step vs 20 ms median" in found.message


@pytest.mark.parametrize("rows", [
    # identical ranks, with a loaded machine's jitter
    [_row(0, 1 * MS, 20 * MS, 3 * MS), _row(1, 1.2 * MS, 21 * MS, 2 * MS), _row(2, 0.9 * MS, 20.5 * MS, 2.5 * MS)],
    # 50 % slower but by 1 ms: under the absolute floor
    [_row(0, 0.1 * MS, 2 * MS, 1 * MS), _row(1, 0.1 * MS, 3 * MS, 0.1 * MS)],
    # 4 ms slower on a 400 ms step: under 15 % and under the share of the step
    [_row(0, 1 * MS, 300 * MS, 100 * MS), _row(1, 1 * MS, 304 * MS, 96 * MS)],
    # the busiest rank also waits longest at the all-reduce: a noisy reading, not the rank the others wait for
    [_row(0, 1 * MS, 20 * MS, 2 * MS), _row(1, 1 * MS, 40 * MS, 30 * MS), _row(2, 1 * MS, 20 * MS, 3 * MS)],
    [_row(0, 1 * MS, 20 * MS, 2 * MS)],  # one rank: nobody to compare with
])
def test_no_straggler_within_noise(rows: list[RankTimes]) -> None:
    assert find_straggler(rows) is None


def test_the_warning_needs_persistence_and_comes_once() -> None:
    slow = find_straggler([_row(0, 1 * MS, 20 * MS, 60 * MS), _row(1, 60 * MS, 20 * MS, 1 * MS)])
    detector = Detector(windows=3)
    seen = [detector.observe(v) for v in [slow, slow, None, slow, slow, slow, slow, slow]]
    assert [s is not None for s in seen] == [False, False, False, False, False, True, False, False]


def test_summary_of_samples_and_the_table_text() -> None:
    samples = [(0.001 * i, 0.02, 0.003, 0.024 + 0.001 * i) for i in range(1, 11)]
    row = summarise(samples, rank=0, host="node0")
    assert row.steps == 10 and row.data.p90 == pytest.approx(0.009) and row.data.median == pytest.approx(0.0055)
    assert row.share("compute") == pytest.approx(0.02 / row.step.mean)
    assert stragglers.from_payload(json.loads(json.dumps(stragglers.to_payload(row)))) == row
    table = stragglers.TimingTable((row, _row(1, 1 * MS, 20 * MS, 3 * MS)), steps=10, window=2)
    text = table.format()
    assert "window 2, 10 steps" in text and "no straggler" in text
    assert text.splitlines()[2].split()[:2] == ["0", "node0"] and text.splitlines()[2].split()[2].endswith("/33")


def test_bad_window_setting_is_a_clear_error() -> None:
    assert timings.window_from_env({}) == timings.WINDOW
    assert timings.window_from_env({"DISTFN_TIMINGS_WINDOW": "20"}) == 20
    with pytest.raises(ConfigError, match="DISTFN_TIMINGS_WINDOW='ten'"):
        timings.window_from_env({"DISTFN_TIMINGS_WINDOW": "ten"})
    assert not timings.enabled_by_env({"DISTFN_TIMINGS": "0"}) and timings.enabled_by_env({})


# -- the recorder on a fake CUDA clock: lazy reads, no synchronise in the loop -----------------------------------
class FakeEvent:
    """A CUDA event stand-in on one stream: ``record`` stamps a fake GPU time; the GPU has passed the first
    ``FakeEvent.passed`` events recorded (``query``); ``synchronize`` waits until it passes this one."""

    gpu_time = 0.0
    passed = 0
    synchronized = 0
    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.index = -1

    def record(self) -> None:
        self.at, self.index = FakeEvent.gpu_time, FakeEvent.recorded
        FakeEvent.recorded += 1

    def query(self) -> bool:
        return self.index < FakeEvent.passed

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1
        FakeEvent.passed = max(FakeEvent.passed, self.index + 1)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an event the GPU has not passed (raises on CUDA)"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def test_cuda_marks_are_read_lazily_without_a_synchronise() -> None:
    FakeEvent.gpu_time, FakeEvent.passed, FakeEvent.synchronized, FakeEvent.recorded = 0.0, 0, 0, 0
    windows: list[list[tuple[float, float, float, float]]] = []
    rec = Recorder(CudaClock(event=FakeEvent), window=2, on_window=windows.append)
    for _ in range(4):  # 4 steps of 100 ms GPU time, 30 of them waiting for the all-reduce
        rec.boundary()
        FakeEvent.gpu_time += 0.07
        rec.comm_begin()
        FakeEvent.gpu_time += 0.03
        rec.comm_end()
    rec.boundary()
    assert rec.steps == 0 and FakeEvent.synchronized == 0  # the GPU is "behind": nothing read, nothing waited for
    FakeEvent.passed = 4  # the GPU passes the first step (start, compute done, comm done, end)
    rec.boundary()
    assert rec.steps == 1  # the second step's end event is not passed yet
    FakeEvent.passed = 7
    rec.boundary()
    assert rec.steps == 2 and len(windows) == 1 and FakeEvent.synchronized == 0
    for sample in windows[0]:
        assert sample == pytest.approx((0.0, 0.07, 0.03, 0.1))  # (data, compute, comm, step)
    rec.drain(block=True)  # the end-of-run summary may wait
    assert rec.steps == 6 and FakeEvent.synchronized > 0


def test_waits_in_a_step_without_a_forward_stay_bounded_and_counted() -> None:
    """An evaluation loop of collectives after training opens no new step: its waits fold into seconds instead of
    piling up a pair (two CUDA events on a GPU) per collective, and the step still counts every one of them."""
    marks = iter(range(10**6))

    class Ticks(HostClock):
        def mark(self) -> Any:
            return float(next(marks))

    windows: list[list[tuple[float, float, float, float]]] = []
    rec = Recorder(Ticks(), window=1, on_window=windows.append)
    rec.boundary()  # mark 0
    for _ in range(10_000):  # each wait lasts one tick: marks 1..20000
        rec.comm_begin()
        rec.comm_end()
        assert len(rec._comms) <= timings.FOLD_AT
    rec.boundary()  # mark 20001
    assert rec.steps == 1
    assert windows[0][0] == (0.0, 10_001.0, 10_000.0, 20_001.0)  # (data, compute, comm, step)

    # On a GPU that is behind, the waits it has not passed are kept (never read early), then counted.
    FakeEvent.gpu_time, FakeEvent.passed, FakeEvent.synchronized, FakeEvent.recorded = 0.0, 0, 0, 0
    windows.clear()
    rec = Recorder(CudaClock(event=FakeEvent), window=1, on_window=windows.append)
    rec.boundary()
    for _ in range(200):
        rec.comm_begin()
        FakeEvent.gpu_time += 0.002
        rec.comm_end()
    assert len(rec._comms) == 201  # all 200 unread (kept) + the folded pair of nothing yet
    rec.boundary()  # closes the step; its end is not passed yet
    assert rec.steps == 0
    FakeEvent.passed = FakeEvent.recorded
    rec.boundary()
    assert rec.steps == 1 and FakeEvent.synchronized == 0
    assert windows[0][0] == pytest.approx((0.0, 0.0, 0.4, 0.4))


def test_the_clock_follows_the_device() -> None:
    assert isinstance(timings.clock_for(torch.device("cpu")), HostClock)
    assert isinstance(timings.clock_for(torch.device("cuda", 0)), CudaClock)  # constructing needs no GPU


# -- the hooks, in one process -----------------------------------------------------------------------------------
class _FinalizeLikeDDP(nn.Module):
    """Queues an end-of-backward callback that blocks 30 ms when its last gradient is ready, as DDP's reducer
    does for the all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        engine = torch.autograd.Variable._execution_engine
        self.lin.weight.register_hook(lambda g: engine.queue_callback(lambda: time.sleep(0.03)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_the_autograd_bracket_times_the_end_of_backward_wait() -> None:
    run = Timings(enabled=True, window=3)
    model = _FinalizeLikeDDP()
    run.watch(model, torch.device("cpu"), bracket=True)  # in a world of one it is left out by default
    batches = run.timed_batches(_slow_batches(0.02))
    for _ in range(4):
        x = next(batches)
        model(x).sum().backward()
        with torch.no_grad():
            model(x)  # an evaluation forward is no step
    table = run.latest
    assert table is not None and table.window == 0 and len(table.ranks) == 1 and table.steps == 3
    row = table.ranks[0]
    assert 0.025 <= row.comm.median <= 0.1  # type: ignore[operator]
    assert 0.018 <= row.data.median <= 0.1  # type: ignore[operator]
    assert row.step.mean >= row.comm.mean + row.data.mean


def _slow_batches(sleep: float):  # type: ignore[no-untyped-def]
    while True:
        time.sleep(sleep)
        yield torch.randn(4, 8)


class _Ctx:
    """What a ``Context`` collective does: its wait inside the run's one hook (`distfn.run.Run.collective`)."""

    def __init__(self, run: Timings) -> None:
        from distfn.run import Run

        self.run = Run(timings=run)

    def all_reduce(self, seconds: float) -> float:
        with self.run.collective("all_reduce"):
            time.sleep(seconds)  # waiting for the other ranks
        return seconds


def test_a_ctx_collective_counts_as_comm_of_its_step() -> None:
    run = Timings(enabled=True, window=2)
    rec = run.start(0, 1, None, HostClock())
    ctx = _Ctx(run)
    assert ctx.all_reduce(0.02) == 0.02  # before the first step: no step's comm
    for _ in range(3):
        rec.boundary()
        ctx.all_reduce(0.03)
    assert run.latest is not None
    comm = run.latest.ranks[0].comm
    assert 0.025 <= comm.mean <= 0.1 and comm.mean <= run.latest.ranks[0].step.mean


def test_in_a_world_of_one_only_the_step_boundary_is_hooked() -> None:
    run = Timings(enabled=True, window=3)
    model = nn.Linear(2, 2)
    run.watch(model, torch.device("cpu"))
    assert len(model._forward_pre_hooks) == 1 and not model._forward_hooks


def test_switched_off_nothing_is_installed() -> None:
    run = Timings(enabled=False)
    model = nn.Linear(2, 2)
    run.watch(model, torch.device("cpu"))
    assert not model._forward_pre_hooks and run.whole_run() is None
    assert list(run.timed_batches(iter([1, 2]))) == [1, 2]


def test_progress_shows_the_warning_through_the_bar_and_restores_the_log() -> None:
    run = Timings(enabled=True)
    buf = io.StringIO()
    bar = Progress(range(3), enabled=True, file=buf, disable=False, mininterval=0, timings=run)
    for i in bar:
        if i == 1:
            run.display("rank 1 (node7) is the straggler: data wait ...")
    assert "WARNING: rank 1 (node7) is the straggler" in buf.getvalue()
    assert run.display is timings._display  # after the loop, warnings go to the log again


# -- real jobs (gloo, 2-3 ranks) -----------------------------------------------------------------------------------
def _job(scenario: str, nprocs: int, steps: int, window: int = 10, out: Path | None = None) \
        -> tuple[dict[str, Any], str]:
    done = run_python([JOB, scenario, str(nprocs), str(steps), *([str(out)] if out else [])],
                      env=clean_env(DISTFN_TIMINGS_WINDOW=str(window)), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), done.stderr


def _shares(row: dict[str, Any]) -> dict[str, float]:
    return {p: row[p]["mean"] / row["step"]["mean"] for p in ("data", "compute", "comm")}


@pytest.mark.slow  # 6-11 s: a 2-rank job of 70 steps of 50 ms
def test_a_rank_with_a_slow_dataset_is_named_for_data(tmp_path: Path) -> None:
    result, stderr = _job("data", 2, 70, out=tmp_path)
    warnings = [w for w in result["warnings"] if "straggler" in w]
    assert len(warnings) == 1 and warnings[0].startswith("rank 1 (") and "data wait" in warnings[0]
    rows = result["table"]["ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    assert _shares(rows[1])["data"] > 0.6 and _shares(rows[0])["comm"] > 0.6  # rank 0 waits for rank 1
    assert _shares(rows[0])["data"] < 0.1 and _shares(rows[1])["comm"] < 0.2
    assert result["others_none"] == [False, True]  # ctx.timings() is None off rank 0
    summary = stderr[stderr.index("timings per rank (whole run"):]
    assert "rank 1 (" in summary.splitlines()[-1] or "is the straggler: data wait" in summary
    # the same job's picture (ctx.timings(plot=...)): rank 1 named and drawn in red, well-formed
    picture = ET.parse(tmp_path / "timings.svg").getroot()
    texts = ["".join(t.itertext()) for t in picture.iter("{http://www.w3.org/2000/svg}text")]
    heads = ("steps 0–60, 2 rank(s); straggler: rank 1 (", "steps 0–70, 2 rank(s); straggler: rank 1 (")
    assert any(t.startswith(heads) and t.endswith(", data") for t in texts), texts[:3]  # window 6 may be pending
    assert any(t.startswith("rank 1 (") for t in texts) and any(t.startswith("rank 0 (") for t in texts)
    assert "the picture could not be written to" in stderr and (tmp_path / "blocked.svg").is_dir()  # and no hang
    if (tmp_path / "timings.png").exists():
        assert (tmp_path / "timings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ... and the trackers': each window's per-rank numbers at the user's step of that moment
    rows = list(csv.DictReader((next(tmp_path.glob("*/metrics.csv"))).open()))
    loss_steps = {int(r["step"]) for r in rows if r["name"] == "loss"}
    data = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "timings/rank1/data_ms"}
    fast = {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "timings/rank0/data_ms"}
    assert 3 <= len(data) <= 7 and set(data) <= loss_steps and set(data) == set(fast), sorted(data)
    assert all(data[s] > 30 > fast[s] for s in data)  # rank 1's dataset sleeps 50 ms an item
    assert any(r["name"] == "timings/straggler_rank" and float(r["value"]) == 1.0 for r in rows)


@pytest.mark.slow
def test_a_rank_that_computes_more_is_named_for_compute() -> None:
    result, _ = _job("compute", 2, 70)
    warnings = [w for w in result["warnings"] if "straggler" in w]
    assert len(warnings) == 1 and warnings[0].startswith("rank 1 (") and "compute" in warnings[0]
    rows = result["table"]["ranks"]
    assert _shares(rows[1])["compute"] > 0.6 and _shares(rows[0])["comm"] > 0.6


@pytest.mark.slow
def test_identical_ranks_get_no_warning_over_200_steps() -> None:
    result, stderr = _job("none", 3, 200)
    assert not [w for w in result["warnings"] if "straggler" in w], result["warnings"]
    assert result["table"]["straggler"] is None and len(result["table"]["ranks"]) == 3
    assert "no straggler" in stderr[stderr.index("timings per rank (whole run"):]


# -- a GPU (skipped here) --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_measure_a_real_step() -> None:
    run = Timings(enabled=True, window=5)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    run.watch(model, torch.device("cuda", 0), bracket=True)  # the autograd callbacks record events too
    x = torch.randn(256, 512, device="cuda")
    for _ in range(12):
        model(x).square().mean().backward()
    torch.cuda.synchronize()
    model(x)  # one more boundary: the finished steps are read now, without waiting
    table = run.latest
    assert table is not None and table.ranks[0].step.mean > 0 and table.ranks[0].compute.mean > 0


# -- the exchange through the store --------------------------------------------------------------------------------
class FakeStore:
    """The store calls the exchange makes; a blocking ``get`` of a missing key fails the test (it would hang)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.round_trips = 0

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.round_trips += 1
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self.round_trips += 1
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.round_trips += 1
        return [self.data[k] for k in keys]

    def get(self, key: str) -> bytes:
        assert key in self.data, f"a blocking get of {key!r}, which no rank wrote"
        return self.data[key]


def test_rank_0_reads_a_window_once_every_rank_wrote_it_and_the_store_stays_small() -> None:
    store = FakeStore()
    ranks = [Timings(enabled=True, window=4) for _ in range(2)]
    recorders = [t.start(rank, 2, store, HostClock()) for rank, t in enumerate(ranks)]
    for _ in range(5):  # rank 0 completes window 0 (4 steps) while rank 1 is a step behind
        recorders[0].boundary()
    for _ in range(4):
        recorders[1].boundary()
    assert ranks[0].latest is None and ranks[1].latest is None
    recorders[1].boundary()  # rank 1 writes window 0
    recorders[0].boundary()  # rank 0's next step reads it (not a whole window later)
    assert ranks[0].latest is not None and ranks[0].latest.window == 0
    assert [r.rank for r in ranks[0].latest.ranks] == [0, 1] and ranks[0].latest.steps == 4
    for _ in range(100):
        recorders[1].boundary()
        recorders[0].boundary()
    assert ranks[0].latest.window >= 23 and ranks[1].latest is None
    timing_keys = [k for k in store.data if "/w" in k]
    assert len(timing_keys) <= timings.SLOTS  # rank 1's ring of slots; rank 0 writes none
    # a few round trips per window, whatever its length: rank 1's set, rank 0's check (+ a retry) and multi_get
    assert store.round_trips <= 6 * (105 // 4)
    totals = ranks[1].whole_run()
    assert totals is None  # off rank 0: it sent its totals
    table = ranks[0].whole_run(wait=1.0)
    assert table is not None and table.window is None and [r.steps for r in table.ranks] == [106, 105]


@pytest.mark.slow  # imports torch._dynamo (seconds)
def test_a_compiled_wrapped_model_is_timed_without_dynamo_warnings() -> None:
    import warnings

    run = Timings(enabled=True, window=3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    run.watch(model, torch.device("cpu"), bracket=True)  # both hooks, as a DDP rank gets
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dynamo tracing into the hooks warns about time.perf_counter
        for _ in range(7):
            compiled(torch.randn(4, 8)).sum().backward()
    assert run.latest is not None and run.latest.window == 1


@pytest.mark.parametrize("persistent", [False, True])
def test_the_summary_names_only_a_straggler_the_job_waited_for(persistent: bool) -> None:
    store = FakeStore()
    ranks = [Timings(enabled=True, window=4) for _ in range(2)]
    recorders = [t.start(rank, 2, store, HostClock()) for rank, t in enumerate(ranks)]
    for step in range(41):
        for rec in recorders:
            rec.boundary()
        if persistent or step == 1:  # rank 1 waits for its data every step, or once for 0.3 s (a cold cache)
            wait = 0.01 if persistent else 0.3
            recorders[0].comm_begin()  # meanwhile rank 0 waits for rank 1 at the all-reduce
            time.sleep(wait)
            recorders[1].add_data(wait)
            recorders[0].comm_end()
    ranks[1].whole_run()
    table = ranks[0].whole_run(wait=1.0)
    assert table is not None and table.ranks[1].data.mean > 0.006 and table.ranks[0].comm.mean > 0.006
    assert (table.straggler is not None) == persistent
    if persistent:
        assert (table.straggler.rank, table.straggler.cause) == (1, "data")  # type: ignore[union-attr]


def test_a_failed_rank_does_not_keep_rank_0_waiting_for_its_totals() -> None:
    store = FakeStore()
    ranks = [Timings(enabled=True, window=4) for _ in range(2)]
    recorders = [t.start(rank, 2, store, HostClock()) for rank, t in enumerate(ranks)]
    for _ in range(6):
        for rec in recorders:
            rec.boundary()
    ranks[1].finish(failed=True)
    started = time.monotonic()
    table = ranks[0].whole_run(wait=30.0)
    assert time.monotonic() - started < 5.0
    assert table is not None and [r.rank for r in table.ranks] == [0]


def test_the_whole_run_counts_the_last_step_which_ends_with_its_loop(caplog: Any) -> None:
    """1,200 steps were counted 1,199: a step is closed by the next forward, and the last has none. It now ends
    where its loop ran out of batches (not at the function's end: the time after the loop is no step's), or,
    without a ctx.dataloader loop, when the whole-run totals are taken."""
    run = Timings(enabled=True, window=50)
    model = nn.Linear(4, 1)
    run.watch(model, torch.device("cpu"))
    started = time.perf_counter()
    for x in run.timed_batches(torch.ones(1200, 1, 4)):
        model(x).sum().backward()
    loop_s = time.perf_counter() - started  # measured, not assumed: a loaded machine may take a second for it
    time.sleep(0.5)  # an evaluation or a save after the loop
    table = run.whole_run()
    assert table is not None and table.steps == 1200 and table.ranks[0].steps == 1200
    # the 0.5 s after the loop is in no step: the steps add up to the loop's own time at most
    assert table.ranks[0].step.mean * 1200 <= loop_s + 0.1, (table.ranks[0].step.mean * 1200, loop_s)
    plain = Timings(enabled=True, window=50)
    recorder = plain.start(0, 1, None, HostClock())
    for _ in range(3):
        recorder.boundary()
    one = plain.whole_run()
    assert one is not None and one.steps == 3
    single = Timings(enabled=True, window=50)
    single.start(0, 1, None, HostClock()).boundary()  # a run of one step still gets its end-of-run table
    logs: list[str] = []
    from loguru import logger
    sink = logger.add(logs.append, format="{message}", filter="distfn")
    logger.enable("distfn")
    try:
        single.finish()
    finally:
        logger.remove(sink)
        logger.disable("distfn")
    assert any("rank" in line and "step ms" in line for line in logs), logs
