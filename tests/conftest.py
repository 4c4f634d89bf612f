"""Shared helpers: run a script in a fresh Python process (the way users run distfn) with a timeout; and the
quick selection.

``python -m pytest -m quick`` (the README's quick-start test command, and CI's bare-install pass) runs every test
that is neither ``slow`` nor ``cluster``, plus the slow tests marked ``quick`` on purpose (the examples: what a
user runs first). ``pytest_collection_modifyitems`` below adds the ``quick`` marker to the rest of that
selection. A test that takes more than `SLOW_S` seconds on an idle 2-core machine is marked ``slow``; the run's
summary names every test outside ``slow`` that took more than `REPORT_SLOW_S` (twice as much: a loaded machine
is that much slower), so one that grew slow gets its marker.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import pytest
from loguru import logger

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"

#: A test slower than this (seconds, on an idle 2-core machine) is marked ``slow``: out of the quick selection.
SLOW_S = 5.0
#: The summary names the tests outside ``slow`` whose call took longer than this.
REPORT_SLOW_S = 2 * SLOW_S
_unmarked_slow: list[tuple[str, float]] = []

#: CI's two passes (.ci/run): the bare pass writes the node ids of the tests that passed to the file named by
#: ``DISTFN_TESTS_PASSED_TO``; the full pass, given that file as ``DISTFN_TESTS_PASSED_IN``, leaves those out
#: (they passed already, on the smaller install) and runs everything else: the slow and cluster tests and every
#: quick test that skipped there for a missing extra. The files below are run whole in both passes: a test there
#: takes another branch when an extra is installed (a notebook row, a TensorBoard check, a snippet's tool).
PASSED_TO: Final = os.environ.get("DISTFN_TESTS_PASSED_TO")
PASSED_IN: Final = os.environ.get("DISTFN_TESTS_PASSED_IN")
RUN_IN_BOTH: Final = frozenset({"test_bench_smoke.py", "test_docs.py", "test_examples.py", "test_progress.py",
                                "test_ray.py", "test_remote.py", "test_tracking.py"})
_failed_phase: set[str] = set()
_left_out: list[int] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the quick selection: every test neither ``slow`` nor ``cluster`` (a slow one marked ``quick`` stays);
    under ``DISTFN_TESTS_PASSED_IN`` (CI's full pass) leave out what CI's bare pass already passed."""
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("cluster") is None:
            item.add_marker(pytest.mark.quick)
    if PASSED_IN:
        passed = set(Path(PASSED_IN).read_text().split("\n"))
        done = [item for item in items if item.nodeid in passed and Path(item.path).name not in RUN_IN_BOTH]
        if done:
            config.hook.pytest_deselected(items=done)
            keep = set(map(id, done))
            items[:] = [item for item in items if id(item) not in keep]
            _left_out.append(len(done))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > REPORT_SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.duration))
    if PASSED_TO:
        if report.outcome != "passed" or getattr(report, "wasxfail", None) is not None:
            _failed_phase.add(report.nodeid)  # a failed or skipped phase (an xfail too): not "passed"
        elif report.when == "teardown" and report.nodeid not in _failed_phase:
            with open(PASSED_TO, "a", encoding="utf-8") as out:
                out.write(report.nodeid + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _left_out:
        terminalreporter.write_line(f"{_left_out[0]} tests deselected: they passed in CI's bare pass ({PASSED_IN})")
    if _unmarked_slow:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        terminalreporter.section(f"tests over {REPORT_SLOW_S:g} s not marked slow (load average {load:.1f} on "
                                 f"{os.cpu_count()} CPUs)")
        terminalreporter.write_line(f"One that takes over {SLOW_S:g} s on an idle machine too gets "
                                    "@pytest.mark.slow (the quick selection is for the fast tests); on a busy "
                                    "machine every test is slower.")
        for nodeid, seconds in sorted(_unmarked_slow, key=lambda row: -row[1]):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any launcher variables (a test may itself run under Slurm or torchrun)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "GROUP_RANK", "DISTFN_NPROCS")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_"))}
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with a clean launcher environment; fails the test (not hangs) past ``timeout``."""
    return subprocess.run([sys.executable, *args], env=env or clean_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def requires(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip a test unless ``module`` is importable, with a reason naming the extra that installs it.

    CI also runs the suite in a venv with no extras (``.ci/run``): there these tests skip, every other one runs.
    """
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"needs {module}, from the '{extra}' extra: pip install -e '.[{extra}]'")


@pytest.fixture
def run_script():
    return run_python


@pytest.fixture
def warnings_seen():
    """The messages of distfn's WARNING (and worse) log lines during the test, in order."""
    seen: list[str] = []
    handle = logger.add(lambda m: seen.append(str(m)), level="WARNING", format="{message}")
    logger.enable("distfn")  # a library is quiet outside a job unless asked
    yield seen
    logger.disable("distfn")
    logger.remove(handle)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built once per session with ``mkdocs build --strict`` (any warning fails it): the
    file checks of tests/test_docs.py and the browser check of tests/test_docs_browser.py read the same build."""
    import shutil

    if any(shutil.which(m) is None and importlib.util.find_spec(m) is None for m in ("mkdocs", "mkdocstrings")):
        pytest.skip("needs mkdocs and mkdocstrings, from the 'docs' extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
