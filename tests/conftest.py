"""Shared helpers: run a script in a fresh Python process (the way users run distfn) with a timeout."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


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
