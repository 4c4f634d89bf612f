"""A resumed 2-rank job continues bit-for-bit: every rank gets back its own RNG stream (ctx.save/load rng=True)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import SCRIPTS, run_python


@pytest.mark.slow
def test_per_rank_rng_resume_is_bit_for_bit(tmp_path: Path) -> None:
    for phase in ("full", "resume"):
        done = run_python([str(SCRIPTS / "resume_job.py"), str(tmp_path), phase])
        assert done.returncode == 0, done.stderr
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed["params"] == full["params"]  # exact, not approximate
    assert resumed["next_draw"] == full["next_draw"]  # each rank's generator is where it would have been
    assert full["next_draw"][0] != full["next_draw"][1]  # ... and the ranks' streams really differ
    with safe_open(str(tmp_path / "ckpt-5.safetensors"), "pt") as f:  # a stock safetensors file
        assert any(k.startswith("rng.") for k in f.keys())
