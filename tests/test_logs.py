"""Logging (distfn.logs): one format for the launcher and the ranks, levels, ranks and user sinks, the CPU
thread sizing line, and silence outside a job; run as real scripts (stderr captured)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import SCRIPTS, clean_env, run_python

#: The one line shape: time | level | where it comes from | message.
LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} \| [A-Z]+ *\| (launcher|rank \d+/\d+) \| ")


def _log_lines(err: str) -> list[str]:
    """The lines of stderr that any loguru handler wrote (loguru separates its fields with ' | ')."""
    return [line for line in err.splitlines() if " | " in line]


def _logs_run(tmp_path: Path, name: str, **env: str) -> tuple[list[int], str, str]:
    sink = tmp_path / f"{name}.log"
    inherited = ("DISTFN_LOG_RANKS", "DISTFN_LOG_LEVEL", "OMP_NUM_THREADS")  # only what this run sets
    environment = {k: v for k, v in clean_env(**env).items() if k not in inherited or k in env}
    proc = run_python([str(SCRIPTS / "logs_job.py"), str(sink)], env=environment)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, sink.read_text()


def test_logging_levels_ranks_user_sinks_and_thread_sizing(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    threads, err, user = _logs_run(tmp_path, "default", OMP_NUM_THREADS="2")
    assert threads == [min(2, cpus)] * 2  # OMP_NUM_THREADS wins (torch caps it at the core count)
    assert "info from rank 0" in err and "info from rank 1" not in err
    assert "warning from rank 0" in err and "warning from rank 1" in err
    assert "debug from rank" not in err
    assert "starting 2 workers" not in err  # the launcher's TRACE line is below the default level
    assert all(LINE.match(line) for line in _log_lines(err)), err
    assert any("launcher: self-spawned (" in line and "(OMP_NUM_THREADS=2)" in line for line in err.splitlines())
    assert any("rank 1/2" in line and "warning from rank 1" in line for line in err.splitlines())
    for rank in (0, 1):  # the user's own sink is kept and sees everything it asked for
        assert f"debug from rank {rank}" in user and f"info from rank {rank}" in user

    threads, err, _ = _logs_run(tmp_path, "all", DISTFN_LOG_RANKS="all", DISTFN_LOG_LEVEL="TRACE")
    assert threads == [max(1, cpus // 2)] * 2  # OMP_NUM_THREADS unset: the cores are split between the ranks
    assert "info from rank 1" in err and "debug from rank 1" in err
    # the launching process logs in the same format as the ranks, and respects DISTFN_LOG_LEVEL too
    assert all(LINE.match(line) for line in _log_lines(err)), err
    started = r"\| TRACE +\| launcher \| starting 2 workers, start method fork"
    assert any(re.search(started, line) for line in err.splitlines())
    sized = [line for line in err.splitlines() if "CPU thread(s) per process" in line]
    assert len(sized) == 1 and "rank 0/2" in sized[0]  # rank 0's start-up line says how the cores were split
    assert f"{max(1, cpus // 2)} CPU thread(s) per process ({cpus} CPUs / 2 processes on this node)" in sized[0]


_QUIET = """
import sys
import torch
from loguru import logger
import distfn
import distfn.checkpoint as ck

path = sys.argv[1]
ck.save({"w": torch.ones(2)}, path)
ck.load(path)
print("---", file=sys.stderr, flush=True)

@distfn.distributed(mode="single")
def job(cfg, ctx):
    ck.save({"w": torch.ones(2)}, path)  # inside a job distfn logs (at DEBUG: hidden at the default level)
    return ctx.rank

job()
ck.save({"w": torch.ones(2)}, path)  # quiet again after the job
logger.info("the user's own line")  # loguru's default handler is back, in its own format
print("---", file=sys.stderr, flush=True)
logger.enable("distfn")  # the loguru way to see a library's lines
ck.save({"w": torch.ones(2)}, path)
job()
ck.save({"w": torch.ones(2)}, path)  # still enabled: the job kept the user's choice
"""


def test_quiet_outside_a_job(tmp_path: Path) -> None:
    script = tmp_path / "quiet.py"
    script.write_text(_QUIET)
    done = run_python([str(script), str(tmp_path / "a.safetensors")], timeout=120)
    assert done.returncode == 0, done.stderr
    outside, after, enabled = done.stderr.split("---\n")
    assert outside == ""  # a plain save and load print nothing
    assert "DEBUG" not in after and "distfn" not in after and "| INFO     | __main__:<module>" in after
    assert after.count("the user's own line") == 1  # once: distfn's sink is gone, the default handler is back
    assert enabled.count("DEBUG") >= 2 and "distfn.checkpoint" in enabled


def test_an_invalid_level_is_said_once_and_info_applies(monkeypatch, capsys) -> None:
    from distfn import distributed

    monkeypatch.setenv("DISTFN_LOG_LEVEL", "LOUD")

    @distributed(mode="single")
    def job(cfg, ctx):
        ctx.log.debug("hidden line")
        ctx.log.info("shown line")

    job()
    job()
    err = capsys.readouterr().err
    assert err.count("DISTFN_LOG_LEVEL='LOUD' is not a loguru level; using INFO") == 1
    assert "shown line" in err and "hidden line" not in err
    assert all(LINE.match(line) for line in _log_lines(err)), err


def test_one_sink_per_process_not_one_per_job(monkeypatch, capsys) -> None:
    """``logger.add`` costs ~5 ms (loguru scans every install scheme's paths): distfn adds its sink once per
    process, not once per call, rank or nesting; the user's lines outside a job still print once."""
    from loguru import logger

    from distfn import distributed

    adds: list[int] = []
    real_add = logger.add
    monkeypatch.setattr(logger, "add", lambda *a, **k: adds.append(1) or real_add(*a, **k))

    @distributed(mode="single")
    def job(cfg, ctx):
        ctx.log.info("a line of the job")

    job()
    first = len(adds)
    job()
    job()
    logger.info("the user's own line")
    err = capsys.readouterr().err
    assert first <= 1 and len(adds) == first  # the first job in this stream adds it; later ones add nothing
    assert err.count("a line of the job") == 3 and err.count("the user's own line") == 1


_REMOVED = """
import sys
from loguru import logger
import distfn

@distfn.distributed(mode="single")
def job(cfg, ctx):
    ctx.log.info("job line")

job()
logger.info("user line 1")  # printed by the handler standing in for loguru's default
logger.remove()  # the user takes over: every handler gone, distfn's too
logger.info("user line 2")  # nowhere
job()  # distfn's lines are shown again in the job
logger.info("user line 3")  # still nowhere: the user removed the default handler
"""


def test_the_user_removing_every_handler_between_jobs(tmp_path: Path) -> None:
    script = tmp_path / "removed.py"
    script.write_text(_REMOVED)
    done = run_python([str(script)], timeout=120)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert err.count("job line") == 2 and all(LINE.match(line) for line in err.splitlines() if "job line" in line)
    assert "user line 1" in err and "user line 2" not in err and "user line 3" not in err


_DEFINED_INTERACTIVELY = """
import threading, torch
from loguru import logger
from distfn import distributed, logs
torch.randn(600, 600) @ torch.randn(600, 600)  # as in a notebook: torch ran before the definition cell

@distributed(nprocs=2, backend="gloo")
def job(cfg, ctx):
    ctx.log.info("job line")
    return ctx.rank

for thread in threading.enumerate():
    if thread.name == "distfn-warm":
        thread.join()
print("SINK BEFORE THE CALL", logs._state.handler is not None, flush=True)
logger.info("user line")
job(None)
"""


def test_an_interactive_definition_adds_the_sink_before_the_call_and_only_once() -> None:
    """Defined interactively after a torch op (a notebook's definition cell), the launching side readies itself in
    a background thread, the log sink included (~5 ms less in the call cell); the call then adds none, and no line
    is printed twice (the thread and the call never both add one)."""
    done = run_python(["-c", _DEFINED_INTERACTIVELY], env=clean_env(OMP_NUM_THREADS="2"), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "SINK BEFORE THE CALL True" in done.stdout
    err = done.stderr
    assert err.count("user line") == 1 and err.count("job line") == 1
    assert err.count("launcher: self-spawned (") == 1  # rank 0's start-up line


_CLOSED_STREAMS = """
import json, os, sys
from loguru import logger
import distfn

out = sys.argv[1]
probe = open(os.devnull)  # the first file opened after the import: never descriptor 1 or 2


@distfn.distributed(nprocs=2, backend="gloo")
def job(cfg, ctx):
    ctx.log.info("rank line")
    logger.warning("user warning")
    for _ in ctx.progress(range(3)):
        pass
    fds = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)}
    with open(f"{out}.{ctx.rank}", "w") as f:
        json.dump({"rank": ctx.rank, "stderr_none": sys.stderr is None, "fds": fds}, f)
    return ctx.rank


if __name__ == "__main__":
    result = job(None)
    with open(out, "w") as f:
        json.dump({"result": result, "probe_fd": probe.fileno(),
                   "fds": {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)}}, f)
"""


def test_a_script_started_with_stdout_and_stderr_closed_runs(tmp_path: Path) -> None:
    """``python s.py >&- 2>&-``: the job runs and its lines go nowhere (loguru refuses ``sys.stderr is None`` as a
    sink; distfn's sink discards instead). Descriptors 1 and 2 become /dev/null at ``import distfn``, so no pipe,
    socket or checkpoint file takes their number and receives what C code or a child writes to "stderr"."""
    script, out = tmp_path / "closed.py", tmp_path / "out.json"
    script.write_text(_CLOSED_STREAMS)
    done = subprocess.run(["sh", "-c", f'exec "{sys.executable}" "{script}" "{out}" >&- 2>&-'], env=clean_env(),
                          timeout=180)
    assert done.returncode == 0
    launcher = json.loads(out.read_text())
    assert launcher["result"] == 0 and launcher["probe_fd"] > 2
    assert launcher["fds"] == {"1": os.devnull, "2": os.devnull}
    for rank in (0, 1):
        worker = json.loads(Path(f"{out}.{rank}").read_text())
        assert worker["rank"] == rank and worker["fds"] == {"1": os.devnull, "2": os.devnull}
