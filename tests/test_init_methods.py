"""init_method='tcp://...' and 'file://...' (the seeds' TCP and shared-file-system rendezvous), under
self-spawn and under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SCRIPTS, free_port, run_python

JOB = str(SCRIPTS / "init_job.py")


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_self_spawn_with_explicit_init_method(tmp_path: Path, kind: str) -> None:
    init = f"tcp://127.0.0.1:{free_port()}" if kind == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    done = run_python([JOB, str(tmp_path), init], timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "result-caller.json").read_text())
    assert result["rank"] == 0 and result["world"] == 2 and result["launcher"] == "spawn"
    assert result["sum"] == 3 and len(set(result["gathered"])) == 2  # two distinct processes met


def test_torchrun_with_a_shared_file_init_method(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    done = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", JOB, str(tmp_path), init],
                      timeout=120)
    assert done.returncode == 0, done.stderr
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1] and {r["launcher"] for r in results} == {"torchrun"}
    assert {r["sum"] for r in results} == {3} and results[0]["gathered"] == results[1]["gathered"]
