"""Smoke test of ``bench/``: every benchmark runs once with tiny sizes so it cannot rot.

Nothing here asserts a timing (timings belong to ``python bench/run.py``); it asserts that each variant ran
to its correct result and that the harness produced its tables, JSON and chart.
Other benchmark owners: append one function per benchmark below.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _run_tiny(tmp_path: Path, only: str) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--tiny", "--only", only, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "## Summary" in proc.stdout
    # a variant that raised left no sample and a "FAILED" progress line: name it here, with its error
    failed = [line for line in (proc.stdout + proc.stderr).splitlines() if ": FAILED " in line]
    assert not failed, "\n".join(failed)
    (result,) = tmp_path.glob("bench-*-tiny.json")
    return {b["benchmark"]: b for b in json.loads(result.read_text())["benchmarks"]}


def _run_module_tiny(tmp_path: Path, name: str, *extra: str) -> dict:
    """``bench/bench_<name>.py --tiny [extra] --json``: its exit status checked, its JSON returned."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH / f"bench_{name}.py"), "--tiny", *extra, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == name
    return result


@pytest.mark.slow
def test_launch_import_step_benchmarks_run_once(tmp_path: Path) -> None:
    results = _run_tiny(tmp_path, "launch,import,step")
    assert set(results) == {"launch", "import", "step"}

    launch = results["launch"]["tables"][0]
    rows = {r["variant"]: r for r in launch["rows"]}
    # every variant printed its correct all_reduce result (checked by the harness) and so left one sample
    for variant in ("import torch", "distfn", "raw fork", "raw spawn", "torchrun"):
        assert len(rows[variant]["samples"]) == 1, variant
    assert rows["raw fork"]["ratio"] == 1.0 and rows["distfn"]["ratio"] > 0
    assert launch["targets"][0]["variant"] == "distfn" and launch["targets"][0]["met"] in (True, False)
    tables = {t["title"].split(":")[0]: t for t in results["launch"]["tables"]}
    torchrun = tables["In place under torchrun"]  # distfn's script in place vs the plain one, both under torchrun
    assert torchrun["baseline"] == "torchrun" and len(torchrun["rows"]) == 2
    assert all(len(r["samples"]) == 1 for r in torchrun["rows"])
    assert torchrun["targets"] == [{**torchrun["targets"][0], "variant": "distfn under torchrun", "max_ratio": 1.02}]
    if importlib.util.find_spec("ipykernel") and importlib.util.find_spec("jupyter_client"):
        # the notebook flow through a real kernel: each call cell timed, each against raw fork's call in a kernel
        nb = tables["Notebook flow through a Jupyter kernel"]
        rows = {r["variant"]: r for r in nb["rows"]}
        assert len(rows["distfn, first call 2 s after decoration"]["samples"]) == 1
        assert len(rows["distfn, later call"]["samples"]) == 2
        assert rows["raw fork in a kernel, first call (floor)"]["ratio"] == 1.0
        assert len(rows["distfn keep_alive, later call"]["samples"]) == 2  # on the ranks of the first (issue 46)
        assert [t["max_ratio"] for t in nb["targets"]] == [1.3, 1.1, 0.2]
        assert all(t["met"] in (True, False) for t in nb["targets"])

    imp = results["import"]
    assert len(imp["tables"][0]["rows"][0]["samples"]) == 1
    assert any(part["module"].startswith("distfn") for part in imp["breakdown"])

    step = results["step"]
    assert step["identical_weights"] is True  # distfn and hand-written DDP end with bit-identical weights
    assert all(len(r["samples"]) == 1 for r in step["tables"][0]["rows"])
    capture = step["tables"][1]  # issue 43: capture on vs off inside each run, and the capture's own time
    assert [r["variant"] for r in capture["rows"]] == ["capture on", "capture off",
                                                       "the capture itself (timed in the same runs)"]
    assert all(len(r["samples"]) == 1 for r in capture["rows"]) and capture["targets"][0]["met"] in (True, False)
    assert 0 < capture["capture_share"] < 1 and capture["paired_ratio"] > 0
    page = (tmp_path / "tiny-benchmarks.md").read_text()  # the docs' results page, as a full run writes it
    assert page.startswith("All figures below come from one run of `python bench/run.py` at commit `")
    assert page.count('<table class="bench-bars">') >= 3  # one bar chart per question
    assert "<b>distfn</b>" in page and "background:#d9480f" in page


def test_run_py_summary_and_discovery() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import run  # bench/run.py
    finally:
        sys.path.remove(str(BENCH))
    names = run.discover()
    assert names[:3] == ["launch", "import", "step"]
    table = run._common.table("t", "s", {"a": [1.0, 3.0, 2.0], "b": [4.0]}, baseline="a",
                              targets=[{"variant": "b", "max_ratio": 1.5}])
    assert [r["median"] for r in table["rows"]] == [2.0, 4.0]
    assert table["rows"][1]["ratio"] == 2.0 and table["targets"][0]["met"] is False
    text = run.summary([{"benchmark": "x", "tables": [table]}, {"benchmark": "y", "tables": [], "error": "boom"}])
    assert "| x | b | 4.000 s | 2.000× | ≤ 1.5× a: MISSED |" in text and "**boom**" in text


@pytest.mark.slow
def test_checkpoint_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_checkpoint.py --tiny end to end: every save/load/RSS variant ran once, targets evaluated."""
    result = _run_module_tiny(tmp_path, "checkpoint", "--dir", str(tmp_path))
    save, versus_save_file, repeated, load_touch, load_call, model, rss, save_curve, load_curve = result["tables"]
    rows = {r["variant"]: r for r in save["rows"]}  # first saves, each variant in its own fresh process
    assert set(rows) == {"distfn.save", "save_file+fsync", "torch.save+fsync", "dd+fdatasync"}
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in rows.values())
    assert rows["dd+fdatasync"]["ratio"] == 1.0
    assert save["targets"][0]["variant"] == "distfn.save" and save["targets"][0]["met"] in (True, False)
    assert versus_save_file["baseline"] == "save_file+fsync" and versus_save_file["targets"][0]["met"] in (True, False)
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in repeated["rows"])
    assert {r["variant"] for r in load_touch["rows"]} == {"distfn.load", "load_file", "torch.load(weights_only)"}
    assert all(len(r["samples"]) == 21 for r in load_touch["rows"] + load_call["rows"])
    # a model's file: many small tensors, distfn.load against load_file, its per-tensor cost in the notes
    assert {r["variant"] for r in model["rows"]} == {"distfn.load", "load_file"} and model["baseline"] == "load_file"
    assert model["targets"][0]["variant"] == "distfn.load" and model["targets"][0]["met"] in (True, False)
    assert all(r["median"] > 0 and "µs per tensor" in r["note"] for r in model["rows"])
    assert {r["variant"] for r in rss["rows"]} == {"distfn.save", "torch.save", "save_file"}
    assert rss["targets"][0]["met"] in (True, False)
    # the curves: every variant at every --tiny size, each size's ratio against its own floor, a target per size
    assert [r["variant"] for r in save_curve["rows"]] == [f"{v}, {n} MiB" for n in (1, 2)
                                                          for v in ("distfn.save", "save_file+fsync", "dd+fdatasync")]
    assert [r["variant"] for r in load_curve["rows"]] == [f"{v}, {n} MiB" for n in (1, 2)
                                                          for v in ("distfn.load", "load_file")]
    for curve, floor in ((save_curve, "dd+fdatasync"), (load_curve, "load_file")):
        assert all(r["ratio"] == 1.0 for r in curve["rows"] if r["variant"].startswith(floor))
        assert len(curve["targets"]) == 2 and all(t["met"] in (True, False) for t in curve["targets"])
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # the benchmark cleaned up after itself


def test_accumulation_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_accumulation.py --tiny: both loops ran, no_sync all-reduces k times less, same update."""
    result = _run_module_tiny(tmp_path, "accumulation")
    assert result["same_update"] is True
    times, calls, mbytes = result["tables"]
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in times["rows"])
    per_step = {r["variant"]: r["median"] for r in calls["rows"]}
    assert per_step["ctx.accumulate (no_sync)"] * 4 == per_step["all-reduce every micro-batch"] >= 4
    assert calls["targets"][0]["met"] is True and mbytes["rows"][1]["ratio"] == 0.25


@pytest.mark.slow
def test_fsdp_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_fsdp.py --tiny: the three variants ran, both FSDP variants trained identically, and each rank
    holds half of DDP's training state; the ctx.wrap memory table measured every way of building the model, and
    the meta-built model came out finite."""
    result = _run_module_tiny(tmp_path, "fsdp")
    assert result["identical_losses"] is True and result["meta_wrap_finite"] is True
    step, held, sync, wrap = result["tables"]
    wrap_rows = {r["variant"]: r for r in wrap["rows"]}
    assert set(wrap_rows) == {"shard (model / world size)", "distfn ctx.wrap, meta-built",
                              "hand-written FSDP2 recipe, meta-built", "distfn ctx.wrap, CPU-built",
                              "whole model (fp32 parameters)"}
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in wrap["rows"])
    assert wrap_rows["whole model (fp32 parameters)"]["ratio"] == pytest.approx(2.0, rel=1e-3)  # 2 ranks
    assert wrap["targets"][0]["variant"] == "distfn ctx.wrap, meta-built" and wrap["targets"][0]["met"] in (True, False)
    assert sync["rows"][0]["median"] > 0
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in step["rows"])
    assert step["targets"][0]["variant"] == "distfn fsdp" and step["targets"][0]["met"] in (True, False)
    ratios = {r["variant"]: r["ratio"] for r in held["rows"]}
    # half, but for Adam's scalar step counters, which every rank keeps whole
    assert ratios == {"hand-written fully_shard": pytest.approx(0.5, rel=1e-3),
                      "distfn fsdp": pytest.approx(0.5, rel=1e-3), "distfn ddp": 1.0}


@pytest.mark.slow
def test_sharded_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_sharded.py --tiny: every save variant ran on 1, 2 and 4 ranks, with its memory figure, the
    training loop ran its three ways, and the save-vs-ranks curve has a target per world size; each question has
    its target row."""
    result = _run_module_tiny(tmp_path, "sharded")
    titles = [t["title"] for t in result["tables"]]
    assert len(titles) == 12 and sum(" rank" in t for t in titles) == 12
    saves, memory = result["tables"][:3], result["tables"][6:9]
    for table in saves:
        assert [r["variant"] for r in table["rows"]] == ["distfn sharded", "distfn one file (gather)",
                                                          "DCP FileSystemWriter", "distfn async (blocked)"]
        assert all(r["median"] > 0 for r in table["rows"])
        assert table["targets"][0]["variant"] == "distfn sharded" and table["targets"][0]["met"] in (True, False)
    for table in memory[1:]:  # on 2 and 4 ranks (on one, its shard is the whole state)
        rows = {r["variant"]: r["median"] for r in table["rows"]}
        # the gather holds the whole state on rank 0: more than any rank's shard
        assert rows["distfn one file (gather)"] > rows["shard (state / world size)"]
    train = result["tables"][9]
    assert [r["variant"] for r in train["rows"]] == ["no saves", "async save every N", "blocking save every N"]
    assert train["targets"][0]["variant"] == "async save every N"
    costs = result["tables"][10]  # issue 46 item 4: the call's time and the background writer's CPU per save
    assert [r["variant"] for r in costs["rows"]] == ["async: ctx.save call (training blocked)",
                                                     "async: background writer thread CPU", "blocking: ctx.save call"]
    assert all(r["median"] > 0 for r in costs["rows"])
    curve = result["tables"][11]
    assert [r["variant"] for r in curve["rows"]] == [f"{v}, {w}" for w in ("1 rank", "2 ranks", "4 ranks")
                                                     for v in ("distfn sharded", "DCP FileSystemWriter")]
    assert [t["variant"] for t in curve["targets"]] == ["distfn sharded, 1 rank", "distfn sharded, 2 ranks",
                                                        "distfn sharded, 4 ranks"]


def test_import_and_decoration_stay_light() -> None:
    """What keeps `bench_import` / `bench_launch` fast, as a behaviour: importing distfn and decorating a DDP
    function load none of the heavy or optional modules (torch._dynamo alone costs 1-2 s here)."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "from distfn import distributed\n"
        "@distributed(mode='ddp', nprocs=2, seed=0)\n"
        "def train(cfg, ctx): pass\n"
        "heavy = ('torch._dynamo', 'torch._inductor', 'torch.distributed.fsdp', 'tqdm', "
        "'tensorboard', 'torch.utils.tensorboard', 'mpi4py', 'matplotlib', 'sklearn', 'safetensors')\n"
        "print(sorted(m for m in heavy if m in sys.modules and m not in before))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"imported at decoration time: {proc.stdout.strip()}"


def test_gpu_check_script_fits_in_eight_minutes() -> None:
    """bench/gpu_check.sh, the prepared command for the first GPU machine: valid bash; on one GPU every step's time
    limit (plus the 10 s grace of `timeout --kill-after`) and the guards around them add up to less than 8 minutes
    (the world-1 benchmarks run only with 2 or more GPUs)."""
    import re

    script = BENCH / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    lines = [line.strip() for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
    steps = {line.split()[1]: int(line.split()[2]) for line in lines if line.startswith("step ")}
    one_gpu = {name: limit for name, limit in steps.items() if name not in ("bench-step", "gpu-launch", "gpu-mesh")}
    guards = [int(n) for line in lines if not line.startswith("step ") for n in re.findall(r"timeout (\d+)", line)]
    assert set(one_gpu) == {"gpu-tests", "distfn-test-gpu", "gpu-hang", "gpu-save"}
    assert sum(one_gpu.values()) + 10 * len(one_gpu) + sum(guards) < 8 * 60
    text = script.read_text()
    assert "tests/test_gpu.py" in text and "distfn test --gpu" in text and "bench_step.py --gpu" in text
    # issue 32: launch on GPUs, the save from GPU memory and the async blocked time; issue 42: the NCCL hang on one
    # GPU; summary.json last
    assert "bench_gpu.py --gpu --only launch" in text and "bench_gpu.py --gpu --only save" in text
    assert "bench_gpu.py --gpu --only hang" in text and 'if [ "$gpus" -ge 2 ]' in text
    assert "python bench/bench_gpu.py --summary \"$out\"" in text.rstrip().splitlines()[-3]


@pytest.mark.slow
def test_tracking_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_tracking.py --tiny: both loops ran on a tracked job, and the call was timed on both ranks."""
    result = _run_module_tiny(tmp_path, "tracking")
    steps, calls, thread = result["tables"]
    assert {r["variant"] for r in steps["rows"]} == {"no logging", "ctx.log_metrics every step"}
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in steps["rows"])
    assert steps["targets"][0]["max_ratio"] == 1.01 and steps["targets"][0]["met"] in (True, False)
    assert all(r["median"] > 0 for r in calls["rows"]) and len(calls["rows"]) == 2
    # the tracking thread's CPU time per logged step, read from /proc on rank 0 (Linux)
    (row,) = thread["rows"]
    assert row["variant"] == "distfn-tracking thread" and row["median"] > 0


@pytest.mark.slow
def test_collectives_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_collectives.py --tiny: at 2 and 4 ranks every variant (distfn's collectives and the raw
    torch.distributed floors) ran and returned the right value on every rank; each question has its target."""
    result = _run_module_tiny(tmp_path, "collectives")
    assert result["correct"] is True
    tables = result["tables"]
    assert [t["world_size"] for t in tables] == [2] * 4 + [4] * 4
    for table in tables:
        assert all(len(r["samples"]) == 1 and r["median"] > 0 and r["cpu_median"] >= 0 for r in table["rows"])
        (target,) = table["targets"]
        assert target["variant"].startswith("ctx.") and target["max_ratio"] == 1.1 and target["met"] in (True, False)
        assert table["rows"][0]["variant"] == table["baseline"] and table["rows"][0]["ratio"] == 1.0
    assert {t["targets"][0]["variant"] for t in tables} == {
        "ctx.all_reduce(float)", "ctx.all_reduce(dict)", "ctx.gather_for_metrics(rows)", "ctx.gather_object(float)"}


@pytest.mark.slow
def test_restart_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_restart.py --tiny: one uninterrupted run and one run whose rank 1 dies and is restarted; the
    restarted run ends with the uninterrupted run's weights and both times were taken."""
    result = _run_module_tiny(tmp_path, "restart")
    assert result["identical_weights"] is True
    (table,) = result["tables"]
    assert table["workers"] == 2 and table["identical_weights"] is True
    rows = {r["variant"]: r for r in table["rows"]}
    assert set(rows) == {"fresh launch (call → first step)", "restart (death → restarted first step)"}
    assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in rows.values())
    assert table["targets"][0]["max_ratio"] == 1.5 and table["targets"][0]["met"] in (True, False)
    # the parts, from the launcher's trace (DISTFN_LAUNCH_TRACE) and the job's marks: every one was timed, and
    # the restart's parts add up to its total
    parts = {p["part"]: p for p in table["parts"]}
    assert all(p["fresh"] is not None or p["restart"] is not None for p in parts.values())
    assert parts["death → the launcher noticed it"]["restart"] >= 0
    assert parts["call → workers started"]["fresh"] > 0
    restart_parts = [p["restart"] for p in parts.values() if p["restart"] is not None]
    assert len(restart_parts) == 9
    assert sum(restart_parts) == pytest.approx(rows["restart (death → restarted first step)"]["median"], abs=1e-3)


@pytest.mark.slow
def test_gpu_bench_skips_without_cuda_and_its_rehearsal_runs_every_part(tmp_path: Path) -> None:
    """bench/bench_gpu.py: without CUDA it exits 0 with the "no CUDA: skipped" note and no table; --rehearse runs
    the launch, save and asynchronous-save code on the CPU (every variant once, the saved state read back intact);
    --summary lists every figure of the results beside the steps of gpu_check.sh."""
    import torch

    if torch.cuda.device_count() == 0:
        skipped = _run_module_tiny(tmp_path, "gpu", "--gpu")
        assert skipped["skipped"] is True and skipped["tables"] == [] and skipped["notes"] == ["no CUDA: skipped"]
    result = _run_module_tiny(tmp_path, "gpu", "--rehearse")
    assert result["skipped"] is False and result["rehearsal"] is True
    launch, saves, blocked = result["tables"]
    assert {r["variant"] for r in launch["rows"]} == {"raw fork", "distfn", "raw spawn"}
    assert {r["variant"] for r in saves["rows"]} == {"save_file+fsync", "distfn.checkpoint.save", "torch.save+fsync"}
    assert {r["variant"] for r in blocked["rows"]} == {"ctx.save (blocking)", "ctx.save(blocking=False), blocked"}
    for table in (launch, saves, blocked):
        assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in table["rows"])
        assert table["targets"][0]["met"] in (True, False)
    assert "state written and read back intact: True" in result["notes"]
    (tmp_path / "steps.txt").write_text("gpu-tests 0 12\ngpu-save 124 75\n")
    done = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--summary", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == [{"step": "gpu-tests", "exit": 0, "seconds": 12},
                                {"step": "gpu-save", "exit": 124, "seconds": 75}]
    assert summary["all_steps_passed"] is False
    rows = [f for f in summary["figures"] if "variant" in f]
    assert len(rows) == 8 and {f["variant"] for f in rows if f["target"]} == {
        "distfn", "distfn.checkpoint.save", "ctx.save(blocking=False), blocked"}


@pytest.mark.slow
def test_soak_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_soak.py --tiny: a few launches and a restart in one process and across two more; every growth
    and leftover figure taken (and zero)."""
    result = _run_module_tiny(tmp_path, "soak")
    growth, times, across = result["tables"]
    assert {r["variant"] for r in growth["rows"]} >= {"open descriptors", "Python threads", "listening TCP sockets",
                                                      "/dev/shm entries (unused, new)", "TMPDIR entries", "RSS (MiB)"}
    assert all(t["met"] for t in growth["targets"] + across["targets"]), growth["targets"] + across["targets"]
    assert [len(r["samples"]) for r in times["rows"]] == [3, 1]


def test_the_results_page_and_its_charts_are_drawn_from_the_committed_json(tmp_path: Path) -> None:
    """Issue 44 item 1: docs/assets/benchmarks.md and its two charts come from docs/assets/benchmarks.json (what a
    whole run publishes, ``--redraw`` redraws): the page is exactly what the JSON gives, each chart redraws the same
    every time and shows what the committed one shows (every ratio target; each scaling table with its floor)."""
    import xml.etree.ElementTree as ET

    pytest.importorskip("matplotlib", reason="the charts need matplotlib (the bench and docs extras)")
    sys.path.insert(0, str(BENCH))
    try:
        import run  # bench/run.py

        import charts  # bench/charts.py
    finally:
        sys.path.remove(str(BENCH))
    published = json.loads(run.PUBLISHED.read_text(encoding="utf-8"))
    results, machine = published["benchmarks"], published["machine"]
    drawn = charts.draw(results, machine, tmp_path)
    assert drawn == list(charts.NAMES)
    page = (run.ASSETS / "benchmarks.md").read_text()
    assert page == run.markdown(results, machine, drawn), "docs/assets/benchmarks.md is stale: bench/run.py --redraw"
    again = tmp_path / "again"
    charts.draw(results, machine, again)

    def texts(path: Path) -> list[str]:
        return ["".join(t.itertext()).strip() for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")]

    for name in drawn:
        assert (tmp_path / name).read_bytes() == (again / name).read_bytes(), f"{name} is not deterministic"
        assert texts(tmp_path / name) == texts(run.ASSETS / name), f"docs/assets/{name} is stale: --redraw"
    ratios = texts(tmp_path / "bench-ratios.svg")
    targets = charts.ratio_targets(results)
    assert len(targets) == sum("max_ratio" in t for r in results for tab in r["tables"] for t in tab["targets"])
    assert all(f"{ratio:.2f}×" in ratios for _, ratio, _, _ in targets)
    scaling = texts(tmp_path / "bench-scaling.svg")
    assert {"floor: raw fork", "floor: dd+fdatasync", "floor: load_file", "floor: DCP FileSystemWriter"} <= set(scaling)


@pytest.mark.slow
def test_mesh_bench_smoke(tmp_path: Path) -> None:
    """bench/bench_mesh.py --tiny (issue 45): the HSDP and TP steps against hand-written torch, the sharded save of
    2 x 2 state against DCP, and the reshard load against a same-mesh load, each with its samples and targets."""
    result = _run_module_tiny(tmp_path, "mesh")
    hsdp, tp, save, load = result["tables"]
    for table in (hsdp, tp, save, load):
        assert all(len(r["samples"]) == 1 and r["median"] > 0 for r in table["rows"])
    assert [t["variant"] for t in (*hsdp["targets"], *tp["targets"], *save["targets"])] == [
        "distfn ctx.wrap (HSDP)", "distfn ctx.wrap(parallelize=plan)", "distfn sharded save"]
    assert {r["variant"] for r in load["rows"]} == {"same-mesh load (TP 2 x DP 2)",
                                                    "reshard load (HSDP 2x2 -> TP 2 x DP 2)"}


# -- --redraw of a damaged docs/assets/benchmarks.json: a clear error naming the field, never matplotlib's traceback
def _bench_modules() -> tuple[object, object]:
    sys.path.insert(0, str(BENCH))
    try:
        import run  # bench/run.py

        import charts  # bench/charts.py
    finally:
        sys.path.remove(str(BENCH))
    return run, charts


def _one(**row: object) -> dict[str, object]:
    base = {"variant": "distfn, 2 ranks", "median": 1.0, "min": None, "samples": [1.0], "runs": 1, "ratio": 1.0,
            "note": ""}
    target = {"variant": "distfn, 2 ranks", "max_ratio": 1.1, "ratio": 1.0, "met": True}
    return {"machine": {}, "benchmarks": [{"benchmark": "b", "notes": [], "tables": [
        {"title": "t", "unit": "s", "baseline": None, "rows": [{**base, **row}], "targets": [target]}]}]}


@pytest.mark.parametrize(("text", "said"), [
    ("{", "Expecting"), ("[]", "the file is"), ('{"machine": {}}', "benchmarks is null"),
    (json.dumps(_one(median="1.0")), r"benchmarks\[0\]\.tables\[0\]\.rows\[0\]\.median is \"1\.0\", not an integer"),
    (json.dumps(_one(median=float("nan"))), r"median is NaN, not a finite number"),
    (json.dumps(_one(median=1e300)), r"median is 1e\+300, not a finite number within"),
    (json.dumps(_one(median=-1.0)), r"median is -1\.0, not a time"),
    (json.dumps(_one(variant=None)), r"rows\[0\]\.variant is null, not a text"),
    (json.dumps(_one(samples=[0.0] * 10**6)), r"samples holds 1,000,000 items"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    (json.dumps({"machine": {}, "benchmarks": [_one()["benchmarks"][0]] * 2100}), "4,200 rows and targets in all"),
])
def test_a_damaged_results_json_is_a_clear_error_naming_the_field(tmp_path: Path, text: str, said: str) -> None:
    run, _ = _bench_modules()
    path = tmp_path / "benchmarks.json"
    path.write_text(text)
    with pytest.raises(run.BadResults, match=said):  # type: ignore[attr-defined]
        run.load_published(path)  # type: ignore[attr-defined]


def test_redraw_of_a_damaged_file_exits_with_the_message_and_writes_nothing(tmp_path: Path) -> None:
    """The command a user runs: exit status 2, one line naming the file's fault, no traceback, the page untouched."""
    copy = tmp_path / "bench"
    subprocess.run(["cp", "-r", str(BENCH), str(copy)], check=True)
    assets = tmp_path / "docs" / "assets"
    assets.mkdir(parents=True)
    (assets / "benchmarks.json").write_text(json.dumps(_one(ratio="fast")))
    (assets / "benchmarks.md").write_text("page")
    done = subprocess.run([sys.executable, str(copy / "run.py"), "--redraw"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "rows[0].ratio is \"fast\", not an integer or a number or null" in done.stderr
    assert (assets / "benchmarks.md").read_text() == "page"


def test_add_replaces_the_named_sections_alone_and_the_page_says_which_run_measured_them() -> None:
    """``bench/run.py --only mesh --add``: the mesh section (or a benchmark the whole run lacked, last) comes from
    this run, stamped with its commit and load; every other section and the page's top line stay the whole run's."""
    run, _ = _bench_modules()
    published = _one()
    published["machine"] = {"commit": "aaa1111", "when": "then", "cpus": 2}
    old_mesh = {**published["benchmarks"][0], "benchmark": "mesh"}  # type: ignore[index]
    published["benchmarks"].append(old_mesh)  # type: ignore[attr-defined]
    fresh = [{**old_mesh, "notes": ["measured again"]}, {**old_mesh, "benchmark": "newer"}]
    combined = run.added(published, fresh, {"commit": "bbb2222", "when": "now", "load": "3.1 2.0 1.5",  # type: ignore[attr-defined]
                                            "load_end": "4.0 3.0 2.0", "cpus": 2})
    run.check_results(combined)  # type: ignore[attr-defined]
    assert [r["benchmark"] for r in combined["benchmarks"]] == ["b", "mesh", "newer"]
    assert "run" not in combined["benchmarks"][0] and combined["benchmarks"][1]["notes"] == ["measured again"]
    page = run.markdown(combined["benchmarks"], combined["machine"], [])  # type: ignore[attr-defined]
    assert page.startswith("All figures below come from one run of `python bench/run.py` at commit `aaa1111`")
    assert "Except the section(s) **mesh**, **newer**: each comes from a later run" in page
    assert ("### mesh\n\n*A separate run of this benchmark alone* (`python bench/run.py --only mesh --add`) at commit "
            "`bbb2222`, now; load average 3.1 2.0 1.5 when it started, 4.0 3.0 2.0 when it ended.") in page
    assert page.count("*A separate run") == 2
    again = run.added(published, fresh[:1], {"commit": "ccc"}, "python bench/run.py --only mesh --add --rounds 21")  # type: ignore[attr-defined]
    assert "(`python bench/run.py --only mesh --add --rounds 21`) at commit `ccc`" in run.markdown(  # type: ignore[attr-defined]
        again["benchmarks"], again["machine"], [])
    bad = {**combined, "benchmarks": [{**combined["benchmarks"][1], "run": {"commit": 7}}]}
    with pytest.raises(run.BadResults, match=r"benchmarks\[0\]\.run\.commit is 7, not a text"):  # type: ignore[attr-defined]
        run.check_results(bad)  # type: ignore[attr-defined]
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--add"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--add publishes the benchmarks named by --only" in done.stderr


def test_markup_and_dollars_in_the_results_are_text_on_the_page_and_in_the_charts(tmp_path: Path) -> None:
    """``import <PRELOAD>`` in a note was read by the browser as a tag (the word vanished from the page); an unpaired
    ``$`` in a variant was matplotlib mathtext (a ValueError from inside matplotlib)."""
    pytest.importorskip("matplotlib", reason="the charts need matplotlib (the bench and docs extras)")
    run, charts = _bench_modules()
    combined = _one(note="python -c 'import <PRELOAD>' | more")
    table = combined["benchmarks"][0]["tables"][0]  # type: ignore[index]
    table["rows"] += [{**table["rows"][0], "variant": "peer $x, 2 ranks"},  # type: ignore[index]
                      {**table["rows"][0], "variant": "distfn, 4 ranks", "median": 2.0},
                      {**table["rows"][0], "variant": "peer $x, 4 ranks", "median": 3.0}]
    table["targets"][0]["variant"] = "<script>alert(1)</script> $a"  # type: ignore[index]
    run.check_results(combined)  # type: ignore[attr-defined]
    page = run.markdown(combined["benchmarks"], {}, [])  # type: ignore[attr-defined,index]
    assert "<PRELOAD>" not in page and "&lt;PRELOAD&gt;" in page and "<script>" not in page
    assert "import &lt;PRELOAD&gt;' &#124; more" in page  # no cell ended by the "|"
    assert charts.draw(combined["benchmarks"], {}, tmp_path) == list(charts.NAMES)  # type: ignore[attr-defined]
    assert "peer $x" in (tmp_path / "bench-scaling.svg").read_text()


hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=30)
_keys = ("variant", "median", "min", "samples", "runs", "ratio", "note")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damage=st.dictionaries(st.sampled_from(_keys), _json, max_size=3), whole=_json)
def test_property_any_damage_is_refused_or_drawn(tmp_path_factory: pytest.TempPathFactory, damage: dict,
                                                   whole: object) -> None:
    """Whatever a damaged file holds: `BadResults`, or a page (and, with matplotlib, charts) drawn without error."""
    run, charts = _bench_modules()
    for combined in (_one(**damage), whole):
        try:
            run.check_results(combined)  # type: ignore[attr-defined]
        except run.BadResults:  # type: ignore[attr-defined]
            continue
        run.markdown(combined["benchmarks"], combined["machine"], [])  # type: ignore[attr-defined,index]
        if importlib.util.find_spec("matplotlib"):
            charts.draw(combined["benchmarks"], combined["machine"],  # type: ignore[attr-defined,index]
                        tmp_path_factory.mktemp("charts"))
