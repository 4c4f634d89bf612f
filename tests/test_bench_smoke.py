"""Smoke test of the checkpoint benchmark: it runs end to end on a tiny size and writes a complete report.

No timing is asserted here (timings on shared CI machines mean nothing); the real numbers come from running
``python bench/bench_checkpoint.py`` (1 GiB) by hand.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_checkpoint_bench_smoke(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_checkpoint.py"), "--size-mib", "2", "--tensors", "4",
         "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "targets:" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report["save"]) >= {"distfn.save", "torch.save", "save_file", "dd", "dd+fdatasync"}
    assert set(report["load"]) == {"distfn.load", "load_file", "torch.load(weights_only)"}
    assert set(report["rss"]) == {"distfn.save", "torch.save", "save_file"}
    for r in report["save"].values():
        assert len(r["times_s"]) == 1 and r["median_s"] > 0
    for r in report["load"].values():
        assert r["with_touch_median_s"] >= 0
    assert all(math.isfinite(r["extra_mib"]) for r in report["rss"].values())
    assert set(report["summary"]["targets"]) == {"save_vs_dd_fdatasync", "peak_extra_rss_mib", "load_vs_load_file"}
    # The benchmark cleans up after itself.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
