"""Stop signals in this process (distfn.preemption): the one handler install/restore helper, which functions
count as polling ``should_stop``, and the flag a stop signal sets."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from distfn import ConfigError, Terminated, distributed, preemption
from distfn.options import Options, with_env


def test_set_handlers_returns_what_restore_handlers_gives_back() -> None:
    seen: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append(signum)

    before = signal.getsignal(signal.SIGUSR2)
    previous = preemption.set_handlers({signal.SIGUSR2: handler})
    try:
        assert previous == {signal.SIGUSR2: before}
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]
    finally:
        preemption.restore_handlers(previous)
    assert signal.getsignal(signal.SIGUSR2) is before
    preemption.restore_handlers(None)  # nothing installed: nothing to give back


def test_set_handlers_outside_the_main_thread_installs_nothing() -> None:
    result: list[dict[int, Any]] = []
    before = signal.getsignal(signal.SIGUSR2)
    thread = threading.Thread(target=lambda: result.append(preemption.set_handlers({signal.SIGUSR2: print})))
    thread.start()
    thread.join()
    assert result == [{}] and signal.getsignal(signal.SIGUSR2) is before


def test_a_handler_set_from_c_comes_back_as_the_default() -> None:
    previous = preemption.set_handlers({signal.SIGUSR2: signal.SIG_IGN})
    try:
        preemption.restore_handlers({signal.SIGUSR2: None})  # what signal.signal returns for a C handler
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        preemption.restore_handlers(previous)


def test_polls_finds_should_stop_in_nested_code() -> None:
    def loop(cfg, ctx):
        def step() -> bool:
            return ctx.should_stop
        return step()

    def plain(cfg, ctx):
        return ctx.rank

    assert preemption.polls(loop) and not preemption.polls(plain)


def test_sigterm_raises_unless_the_function_polls() -> None:
    stop, previous = preemption.install(opt_in=False)
    try:
        with pytest.raises(Terminated, match=r"poll ctx\.should_stop"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop()  # no process group: this process's own flag
    finally:
        preemption.restore_handlers(previous)
    stop, previous = preemption.install(opt_in=True)
    try:
        assert not stop.should_stop()  # a fresh install starts with no signal
        os.kill(os.getpid(), signal.SIGTERM)  # polls: only the flag
        assert stop.should_stop()
    finally:
        preemption.restore_handlers(previous)


# -- requeue=True: a Slurm job stopped by a stop signal goes back in the queue (issue 13 item 3) ---------------
class FakeRun:
    """Stands in for subprocess.run: records the command, answers with ``returncode``."""

    def __init__(self, returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[list[str]] = []
        self.returncode, self.stderr = returncode, stderr

    def __call__(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


def test_requeue_asks_scontrol_for_this_job_or_array_task() -> None:
    run = FakeRun()
    assert preemption.requeue({"SLURM_JOB_ID": "77"}, run=run)
    assert preemption.requeue({"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"},
                              run=run)
    assert run.calls == [["scontrol", "requeue", "77"], ["scontrol", "requeue", "77_3"]]


def test_requeue_outside_slurm_or_refused_only_warns() -> None:
    assert not preemption.requeue({}, run=FakeRun())
    assert not preemption.requeue({"SLURM_JOB_ID": "77"}, run=FakeRun(1, "Requested operation is disabled"))


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `scontrol` on PATH that appends its arguments to a file."""
    calls = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return calls


def test_a_job_stopped_by_a_signal_is_requeued_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)

    @distributed(mode="single", requeue=True)
    def stops(cfg, ctx):
        os.kill(os.getpid(), signal.SIGUSR2)  # what #SBATCH --signal=USR2@T sends
        return ctx.should_stop  # the loop saves its checkpoint here and returns

    assert stops() is True
    assert calls.read_text() == "requeue 4242\n"


def test_no_requeue_after_a_normal_end_a_failure_or_without_the_option(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)

    @distributed(mode="single", requeue=True)
    def finishes(cfg, ctx):
        return ctx.should_stop

    @distributed(mode="single", requeue=True)
    def fails(cfg, ctx):
        os.kill(os.getpid(), signal.SIGUSR2)
        if ctx.should_stop:
            raise ValueError("failed while stopping")

    @distributed(mode="single")
    def not_asked(cfg, ctx):
        os.kill(os.getpid(), signal.SIGUSR2)
        return ctx.should_stop

    assert finishes() is False
    with pytest.raises(ValueError, match="failed while stopping"):
        fails()
    assert not_asked() is True
    assert not calls.exists()


def test_distfn_requeue_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = Options()
    assert with_env(opts, {"DISTFN_REQUEUE": "1"}).requeue is True
    assert with_env(Options(requeue=True), {"DISTFN_REQUEUE": "off"}).requeue is False
    with pytest.raises(ConfigError, match="DISTFN_REQUEUE='maybe'"):
        with_env(opts, {"DISTFN_REQUEUE": "maybe"})
    with pytest.raises(ConfigError, match="requeue must be True or False"):
        Options(requeue="yes")
