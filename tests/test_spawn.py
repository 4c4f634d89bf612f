"""The launch of a self-spawned job (distfn.spawn), seen from the caller: what comes back, and what may run
next to it."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import SCRIPTS, run_python


def test_two_threads_launch_at_once_without_a_false_nested_launch(tmp_path: Path) -> None:
    """Issue 16 item 3: the launcher marked its whole environment while a worker started, so a second thread's
    launch was refused as nested. The child is marked instead, and it is marked while spawn re-imports the
    script (where a decorated call at import time would be a nested launch)."""
    marks = tmp_path / "marks"
    done = run_python([str(SCRIPTS / "threads_job.py"), str(marks)], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {"a": "3", "b": "3"}, done.stderr[-3000:]
    assert marks.read_text().split() == ["True"] * 4  # 2 jobs x 2 workers, each marked during its import
