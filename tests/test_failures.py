"""Failure records (distfn.failures): the root cause first, stacks cut to the user's code, the report of a rank
under torchrun in torch's own error-file format."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

import distfn
from distfn import Terminated, failures, worker
from distfn.launch import local

from conftest import run_python

HOST = socket.gethostname()


def test_torchrun_error_file_matches_torch_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    try:
        raise ValueError("boom")
    except ValueError as exc:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours))
        failures.report_in_place(3, exc)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(theirs))
        ErrorHandler().record_exception(exc)
    a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    assert a["message"]["message"] == b["message"]["message"] == "ValueError: boom"
    assert a["message"]["extraInfo"].keys() == b["message"]["extraInfo"].keys()
    # torchrun prints this text in its summary: the cause and the user's frame lead, distfn's frames are cut
    callstack = a["message"]["extraInfo"]["py_callstack"]
    assert callstack.startswith("rank 3 failed with ValueError: boom\nin test_torchrun_error_file_matches_torch_form")
    assert "raise ValueError" in callstack and "distfn/" not in callstack
    # an outside stop is no root cause: no error file
    ours.unlink()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours))
    failures.report_in_place(0, Terminated("received SIGTERM"))
    assert not ours.exists()


def test_main_stack_keeps_the_main_thread_above_distfn() -> None:
    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/home/u/train.py", line 7 in train\n'
        '  File "/x/distfn/worker.py", line 190 in run\n'
        '  File "/x/distfn/launch/local.py", line 441 in _entry\n'
    )
    # the launcher cuts at the frames of distfn's own start-up: the rank bootstrap and the spawn entry point
    text = failures.main_stack(dump, local.BOOTSTRAP)
    assert 'train.py", line 7 in train' in text and "worker.py" not in text and "threading" not in text
    assert "1 other thread(s) not shown" in text
    assert failures.innermost_user_frame(text) == "train (/home/u/train.py:7)"
    assert worker.run in local.BOOTSTRAP


def test_root_cause_ordering() -> None:
    def failure(rank: int, exc_type: str, message: str, t: float) -> failures.Failure:
        return failures.Failure(rank, HOST, 1, exc_type, message, time=t)

    peer = failure(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", 1.0)
    own = failure(1, "ValueError", "boom", 2.0)
    death = failure(2, "Signal", "SIGKILL", 3.0)
    assert failures.order_failures([peer, own, death]) == [death, own, peer]
    err = distfn.WorkerError([own, peer])
    assert str(err).startswith("rank 1 (pid 1 on") and "1 other rank(s) failed after it" in str(err)


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_failure_is_recorded_when_the_exception_cannot_be_printed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        raise _BadStr("lost")
    except _BadStr as exc:
        f = failures.Failure.from_exception(2, exc)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
        failures.report_in_place(2, exc)
    assert f.exc_type == "_BadStr" and f.message == "<str() of _BadStr raised RuntimeError: no text>"
    assert f.headline().endswith("failed with _BadStr: <str() of _BadStr raised RuntimeError: no text>")
    assert 'raise _BadStr("lost")' in f.traceback
    written = json.loads((tmp_path / "error.json").read_text())
    assert written["message"]["message"] == "_BadStr: <str() of _BadStr raised RuntimeError: no text>"


def _stack(line: int, *, extra: str = "") -> str:
    return (f"Current thread 0x00007f02 (most recent call first):\n{extra}"
            f'  File "/home/u/train.py", line {line} in train\n')


def test_nccl_watchdog_abort_gets_the_hang_report() -> None:
    """Issue 20 item 6: a rank aborted by NCCL's watchdog (SIGABRT, no Python error) after the timeout."""
    aborted = failures.Failure.from_exit(0, 10, -6, crash=_stack(20))  # blocked at .item() on line 20
    asked = []

    def stacks() -> dict[int, str]:
        asked.append(True)
        in_torch = '  File "/t/torch/distributed/c10d.py", line 1 in x\n'
        return {1: _stack(20), 2: _stack(12), 3: _stack(30, extra=in_torch)}

    got = failures.diagnose(aborted, timeout_s=20, elapsed_s=25, stacks=stacks)
    assert asked and "NCCL's watchdog" in got.diagnosis and "timed out after 20 s" in got.diagnosis
    # rank 1 waits where rank 0 was, rank 3 inside torch.distributed: both had arrived; rank 2 had not
    assert "Rank 2 had not reached a collective: rank 2 was in train (/home/u/train.py:12)." in got.diagnosis
    assert "rank 1 was" not in got.diagnosis and "rank 3 was" not in got.diagnosis
    assert "rank 1:" in got.stacks and "rank 2:" in got.stacks
    # an abort before the timeout is not a hang: no stacks asked, no hang report
    asked.clear()
    early = failures.diagnose(aborted, timeout_s=20, elapsed_s=5, stacks=stacks)
    assert not asked and early == aborted


def test_nccl_timeout_texts_are_recognised() -> None:
    text = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=20000) ran for 20034 milliseconds before timing out.")
    f = failures.Failure(0, HOST, 1, "DistBackendError", text)
    assert failures.hang_kind(f, timeout_s=20) == "timeout"
    assert failures.hang_kind(failures.Failure(0, HOST, 1, "ValueError", "boom"), timeout_s=20) is None


def _failure(message: str, frames: Sequence[str] = (), exc_type: str = "CheckpointError") -> failures.Failure:
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "{f}", line 3, in f\n    x()\n' for f in frames)
    return failures.Failure(0, HOST, 1, exc_type, message, traceback=tb + f"{exc_type}: {message}\n")


HINT = "Rank 1 had already returned from the function"


@pytest.mark.parametrize(
    ("failure", "hinted"),
    [
        # only rank 0 can have these, no collective involved: no hint (issue 31 item 3)
        (_failure("cannot create the directory '/t/afile'", ["/home/u/train.py", "/x/distfn/checkpoint/files.py"]),
         False),
        (_failure("return value['fn'] (a lambda defined at ...) cannot be pickled", ["/x/distfn/launch/shipping.py"],
                  exc_type="ConfigError"), False),
        # inside a collective: torch.distributed, DDP, distfn's collectives, a peer's loss, a timeout
        (_failure("boom", ["/home/u/train.py", "/v/torch/distributed/distributed_c10d.py"], "RuntimeError"), True),
        (_failure("boom", ["/home/u/train.py", "/v/torch/nn/parallel/distributed.py"], "RuntimeError"), True),
        (_failure("boom", ["/home/u/train.py", "/x/distfn/collectives.py"], "RuntimeError"), True),
        (_failure("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:123", [],
                  "DistBackendError"), True),
        (_failure("Socket Timeout", ["/home/u/train.py"], "DistStoreError"), True),
    ],
)
def test_returned_ranks_are_blamed_only_for_a_failure_inside_a_collective(failure: failures.Failure,
                                                                         hinted: bool) -> None:
    got = failures.diagnose(failure, timeout_s=60, returned=[1])
    assert (HINT in got.diagnosis) is hinted, got.diagnosis
    assert failures.in_collective(failure) is hinted or "Timeout" in failure.message


_RANK0_ONLY_JOB = """
import sys
from pathlib import Path
import distfn

@distributed(mode="ddp", nprocs=2, timeout=30)
def job(case, ctx):
    if case == "save" and ctx.is_main:
        Path("afile").write_text("")
        ctx.save({"step": 1}, "afile/m.safetensors")
    if case == "unpicklable" and ctx.is_main:
        return {"fn": lambda x: x}
    if case == "collective" and ctx.is_main:
        return ctx.all_reduce(1.0)
    return None

if __name__ == "__main__":
    for case in sys.argv[1:]:
        try:
            job(case)
        except distfn.WorkerError as exc:
            print(f"=== {case}: {exc}", flush=True)
""".replace("@distributed", "@distfn.distributed")


@pytest.mark.slow
def test_rank_0_only_failures_get_no_collective_hint_but_a_lone_collective_does(tmp_path: Path) -> None:
    """Issue 31 item 3, end to end: a `ctx.save` error and an unpicklable return value on rank 0 (rank 1 had
    returned) do not mention collectives; `if ctx.is_main: ctx.all_reduce(...)` still does."""
    (tmp_path / "job.py").write_text(_RANK0_ONLY_JOB)
    done = run_python([str(tmp_path / "job.py"), "save", "unpicklable", "collective"], cwd=tmp_path, timeout=300)
    reports = {part.split(":", 1)[0]: part for part in done.stdout.split("=== ")[1:]}
    assert set(reports) == {"save", "unpicklable", "collective"}, done.stdout + done.stderr[-3000:]
    assert "afile" in reports["save"] and HINT not in reports["save"]
    assert "cannot be pickled" in reports["unpicklable"] and HINT not in reports["unpicklable"]
    assert HINT in reports["collective"]


def test_a_hang_report_is_in_the_reporters_error_file_and_one_line_elsewhere(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: the rank that collected the report writes it into torchrun's error file (its py_callstack is what
    torchrun's summary prints); a rank that failed in the same hang is stamped a second later, its text one line."""
    def timed_out() -> RuntimeError:
        try:
            raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
        except RuntimeError as exc:
            return exc

    reporter, other = timed_out(), timed_out()
    failures.attach_report(reporter, "Rank 1 had not reached a collective: ...", "rank 1:\n  File \"t.py\"", reporter=0)
    failures.attach_report(other, "rank 0 reports this hang with every rank's stack", "", reporter=0)
    files = {}
    for rank, exc in ((0, reporter), (1, other)):
        files[rank] = tmp_path / f"error{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[rank]))
        failures.report_in_place(rank, exc)
    ours, theirs = (json.loads(files[r].read_text())["message"]["extraInfo"] for r in (0, 1))
    assert "Rank 1 had not reached a collective" in ours["py_callstack"] and "rank 1:" in ours["py_callstack"]
    assert "Rank 1 had not reached" not in theirs["py_callstack"]
    assert int(theirs["timestamp"]) >= int(ours["timestamp"]) + 1
    # a launcher orders the reporter first, whenever the other's failure arrived
    first, second = (failures.Failure.from_exception(r, e) for r, e in ((0, reporter), (1, other)))
    assert failures.order_failures([second, first])[0] is first and first.reporter == 0
    assert failures.diagnose(first, timeout_s=10) is first  # already diagnosed among the ranks


def test_under_torchrun_each_report_is_in_the_output_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44 item 2: a hang under torchrun printed its report three times (the rank's log, Python's traceback of
    the re-raised exception, torchrun's summary of the error file): now the log has the cause, the user's frame
    and the diagnosis, the error file the whole report, and the rank's excepthook one line."""
    from loguru import logger

    try:
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    except RuntimeError as caught:
        exc = caught
    failures.attach_report(exc, "Rank 1 had not reached a collective: ...", "rank 1:\n  File \"t.py\"", reporter=0)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    logged: list[str] = []
    sink = logger.add(logged.append, format="{message}")
    logger.enable("distfn")  # a library is quiet outside a job unless asked
    try:
        failures.report_in_place(0, exc)
    finally:
        logger.disable("distfn")
        logger.remove(sink)
    log = "".join(logged)
    assert log.startswith("rank 0 failed with RuntimeError: Timed out waiting 10000ms for recv operation to complete"
                          "\nin test_under_torchrun_each_report_is_in_the_output_once (")
    assert "Rank 1 had not reached a collective" in log and "torchrun's summary below" in log
    assert "Traceback" not in log and "rank 1:" not in log
    callstack = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert "Traceback" in callstack and "rank 1:" in callstack and "distfn/" not in callstack
    failures._excepthook(type(exc), exc, exc.__traceback__)  # the rank re-raises it: one line, no traceback
    assert capsys.readouterr().err == ("RuntimeError: Timed out waiting 10000ms for recv operation to complete "
                                       "(reported above; DISTFN_DEBUG=1 shows the whole traceback)\n")
    monkeypatch.setenv("DISTFN_DEBUG", "1")
    failures._excepthook(type(exc), exc, exc.__traceback__)
    assert "Traceback (most recent call last)" in capsys.readouterr().err
