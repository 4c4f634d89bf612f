"""Stop signals in this process (distfn.preemption): the one handler install/restore helper, which functions
count as polling ``should_stop``, and the flag a stop signal sets."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from distfn import Terminated, preemption


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
    previous = preemption.install(opt_in=False)
    try:
        with pytest.raises(Terminated, match=r"poll ctx\.should_stop"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.should_stop()  # no process group: this process's own flag
    finally:
        preemption.restore_handlers(previous)
    previous = preemption.install(opt_in=True)
    try:
        assert not preemption.should_stop()  # a fresh install starts with no signal
        os.kill(os.getpid(), signal.SIGTERM)  # polls: only the flag
        assert preemption.should_stop()
    finally:
        preemption.restore_handlers(previous)
