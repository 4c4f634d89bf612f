"""distfn.launch.forkserver and .shipping: the fork server made at decoration, and shipping by value (issue 11).

What users rely on: after a torch op the workers still start (from the fork server) and see the launching
process's environment as it is at the call; the server exists only where a call will start workers with it (not
for a plain fork launch, issue 25 item 9), a server that cannot start never fails the import, and neither it nor
the workers outlive the launching process; what a worker cannot find by name arrives by value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from distfn.launch import forkserver, shipping

from conftest import alive, clean_env, run_python


def _children(pid: int) -> dict[int, str]:
    """Live children of ``pid``: {pid: comm}."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found[int(entry)] = comm
    return found


PROBE = """
import os, sys
import torch

def children():
    import time
    for _ in range(50):  # the server names itself just after the fork
        out = list_children()
        if all(name != "python" for name in out):
            break
        time.sleep(0.1)
    return out

def list_children():
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                state, ppid = open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[:2]
                if int(ppid) == os.getpid() and state != "Z":  # not the pool probe, answered, reaped later
                    out.append(open(f"/proc/{e}/comm").read().strip())
            except OSError:
                pass
    return sorted(out)

def running():
    from distfn.launch import forkserver
    return forkserver.server_running()

import distfn
print("import", children(), running())
from distfn import distributed
print("from-import", children(), running())
@distributed(mode="ddp", nprocs=1)
def one(cfg, ctx): pass
print("one process", children(), running())
@distributed(mode="ddp", nprocs=2)
def two(cfg, ctx): pass
print("two processes", children(), running())
@distributed(mode="ddp", nprocs=2, start_method="forkserver")
def served(cfg, ctx): pass
print("forkserver", children(), running())
"""


@pytest.mark.slow
def test_the_fork_server_exists_only_where_a_call_will_start_workers(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = run_python([str(script)], timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    server = f"['{forkserver.SERVER_NAME}'] True"
    assert lines[0] == "import [] False"  # `import distfn` starts nothing
    # a script's own `from distfn import distributed` makes its copy now, before the script's first torch op
    # (issue 46 item 3): a torch op before the call would make a late server a fresh interpreter (1.92x)
    assert lines[1] == f"from-import {server}"
    assert lines[2:] == [f"one process {server}", f"two processes {server}", f"forkserver {server}"]
    # interactively (a notebook, `python -c`) the copy is made where a call will launch: at decoration
    done = run_python(["-c", PROBE], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:4] == ["from-import [] False", "one process [] False", f"two processes {server}"]
    # under torchrun the call runs in place: no server either
    under_torchrun = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29999", TORCHELASTIC_RUN_ID="x")
    for env in (under_torchrun, clean_env(DISTFN_LAUNCHER="ray")):  # Ray starts the ranks as actors: none either
        done = run_python([str(script)], env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[1] == "from-import [] False"
        assert done.stdout.splitlines()[4] == "forkserver [] False"


IMPORTED = """
import sys
sys.path.insert(0, sys.argv[1])
import helper  # its own `from distfn import distributed`: a module, not the script
from distfn.launch import forkserver
print("RESULT", forkserver.server_running())
"""


def test_only_the_script_itself_gets_a_copy_at_import(tmp_path: Path) -> None:
    """A module that a script (or a test runner) imports, and that imports distfn, makes no copy at import: only a
    script's own top level does, where its first torch op may come next (issue 46 item 3)."""
    (tmp_path / "helper.py").write_text("import torch\nfrom distfn import distributed\n")
    script = tmp_path / "main.py"
    script.write_text(IMPORTED)
    done = run_python([str(script), str(tmp_path)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("RESULT ", 1)[1].strip() == "False"


COPY_AT_EXIT = """
import json, os, sys
import torch
from distfn import distributed
from distfn.launch import forkserver

@distributed(mode="ddp", nprocs=2, backend="gloo")
def job(cfg, ctx):
    return ctx.gather_object(os.getpriority(os.PRIO_PROCESS, 0))

if __name__ == "__main__":
    copy = forkserver._forkserver()._forkserver_pid
    if sys.argv[1] == "op":
        torch.randn(600, 600) @ torch.randn(600, 600)  # an OpenMP pool: the ranks fork from the copy
    print("RESULT", json.dumps({"copy": copy, "nice": job(None), "own": os.getpriority(os.PRIO_PROCESS, 0)}),
          flush=True)
"""


@pytest.mark.parametrize("path", ["fork", "op"])
def test_the_copy_made_at_decoration_is_gone_before_the_launcher_exits(tmp_path: Path, path: str) -> None:
    """The copy prepares at the lowest priority in a thread of its own, yet the ranks it forks run at the launching
    process's priority; at exit the launcher ends it before its own clean-up (whose writes to pages shared with a
    live copy all fault), quietly, and its socket's directory goes too."""
    script = tmp_path / "spare.py"  # not copy.py: it would shadow the standard library's copy module
    script.write_text(COPY_AT_EXIT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = run_python([str(script), path], env=clean_env(OMP_NUM_THREADS="2", TMPDIR=str(tmp)), timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert isinstance(result["copy"], int)
    assert result["nice"] == [result["own"], result["own"]]  # not the preparing thread's 19
    assert ("start method forkserver" in done.stderr) == (path == "op")
    assert "Traceback" not in done.stderr, done.stderr
    assert not alive(result["copy"])
    assert list(tmp.iterdir()) == []  # the standard library's pymp-* directory, with the server's socket


IDLE_COPY = """
import json, os, sys, time
import torch
from distfn import distributed
from distfn.launch import forkserver

def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime

@distributed(mode="ddp", nprocs=2, backend="gloo")
def job(cfg, ctx):
    return ctx.all_reduce(ctx.rank + 1, op="sum")

if __name__ == "__main__":
    copy = forkserver._forkserver()._forkserver_pid
    first = job(None)  # safe to fork: the workers fork from this process
    time.sleep(1)  # time a preparing copy (at the lowest priority) would take to prepare
    idle = cpu_ticks(copy)
    torch.randn(600, 600) @ torch.randn(600, 600)  # an OpenMP pool: the next call's ranks fork from the copy
    second = job(None)
    print("RESULT", json.dumps({"first": first, "second": second, "idle": idle, "used": cpu_ticks(copy),
                                "hz": os.sysconf("SC_CLK_TCK")}), flush=True)
"""


def test_the_copy_made_in_a_script_stays_idle_until_a_call_needs_it(tmp_path: Path) -> None:
    """Issue 46 item 2: in a plain script the copy made at decoration is a spare while the calls still fork, so it
    waits without preparing (its ~50-90 ms of CPU competed with the launch on 2 cores); the first call that
    cannot fork wakes it, and its ranks fork from it with the right result."""
    script = tmp_path / "idle.py"
    script.write_text(IDLE_COPY)
    done = run_python([str(script)], env=clean_env(OMP_NUM_THREADS="2"), timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["first"] == result["second"] == 3
    # idle: well under the preparation's CPU (the launch machinery's import alone is ~50 ms)
    assert result["idle"] * 1000 / result["hz"] < 20, result
    assert result["used"] > result["idle"], result  # woken: it prepared, then forked the second call's ranks
    assert "start method forkserver" in done.stderr and "a copy of this process" in done.stderr, done.stderr


LATE_ENV = """
import os, sys
import torch
from distfn import distributed

@distributed(mode="ddp", nprocs=2)
def job(cfg, ctx):
    return ctx.all_reduce(int(os.environ["DISTFN_TEST_LATE"]) + ctx.rank, op="sum")

if __name__ == "__main__":
    torch.randn(600, 600) @ torch.randn(600, 600)  # an OpenMP pool: fork is unsafe from here on
    os.environ["DISTFN_TEST_LATE"] = "20"  # set after the server was made
    print("RESULT", job({}))
"""


def test_workers_of_the_fork_server_see_the_environment_of_the_call(tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(LATE_ENV)
    done = run_python([str(script)], env=clean_env(OMP_NUM_THREADS="2"), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "RESULT 41" in done.stdout  # (20 + 0) + (20 + 1)
    assert "starting 2 workers, start method forkserver" in done.stderr and "threads" in done.stderr


SLEEPER = """
import os, sys, time
import torch
from distfn import distributed

@distributed(mode="ddp", nprocs=2)
def sleeper(cfg, ctx):
    with open(os.path.join(cfg, f"pid{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    torch.randn(600, 600) @ torch.randn(600, 600)
    sleeper(sys.argv[1])
"""


def _launch_with_own_tmpdir(tmp_path: Path, name: str, source: str) -> tuple[subprocess.Popen[bytes], Path]:
    """Run ``source`` as ``tmp_path/name`` (its argument: ``tmp_path``) with ``TMPDIR`` a fresh ``tmp_path/tmp``,
    where multiprocessing makes its ``pymp-*`` directory; the process and that directory."""
    script = tmp_path / name
    script.write_text(source)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                            env=clean_env(OMP_NUM_THREADS="2", TMPDIR=str(tmp)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, tmp


def test_server_and_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """... and the server's socket (TMPDIR/pymp-*/listener-*) goes with it (issue 25 item 10)."""
    proc, tmp = _launch_with_own_tmpdir(tmp_path, "sleeper.py", SLEEPER)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        workers = [int(p.read_text()) for p in tmp_path.glob("pid*")]
        assert len(workers) == 2, proc.stderr.read().decode() if proc.poll() is not None else "no workers"
        servers = [pid for pid, comm in _children(proc.pid).items() if comm == forkserver.SERVER_NAME]
        assert len(servers) == 1
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in [*servers, *workers]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in [*servers, *workers])
        assert [str(p.relative_to(tmp)) for p in tmp.rglob("*") if "pymp-" in str(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _triple(x: int) -> int:
    return 3 * x


def test_interactive_definitions_travel_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    notebook = types.ModuleType("__main__")  # a notebook's __main__: no file
    exec("def train(cfg, ctx):\n    return cfg['f'](2) + 1\n", notebook.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    assert shipping.interactive_main()
    fn, cfg, how = shipping.pack(notebook.train, {"f": lambda x: x * 10}, "spawn")
    assert "by value" in how
    assert isinstance(fn, shipping.Parcel) and fn.payload is not None and fn.environ is None
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # the worker's: train is not there
    assert shipping.unpack(fn)(shipping.unpack(cfg), None) == 21


def test_a_script_sends_by_name_what_pickle_can_find(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train.py")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert not shipping.interactive_main()
    fn, cfg, how = shipping.pack(_triple, {"lr": 0.1}, "spawn")
    assert fn == shipping.Parcel(value=_triple) and cfg == shipping.Parcel(value={"lr": 0.1})
    assert "import the script" in how
    # under start_method="auto", what pickle cannot send by name goes by value rather than failing
    _, cfg, how = shipping.pack(_triple, {"f": lambda x: x + 1}, "spawn")
    assert "by value" in how and shipping.unpack(cfg)["f"](1) == 2


OP_FIRST = """
import sys
import torch
if sys.argv[1] == "before-import":
    torch.randn(600, 600) @ torch.randn(600, 600)  # before `import distfn`: no safe moment to copy this process
from distfn import distributed
from distfn.launch import forkserver

torch.randn(600, 600) @ torch.randn(600, 600)  # before the decoration: the notebook order, in a script

@distributed(mode="ddp", nprocs=2)
def job(cfg, ctx):
    return ctx.all_reduce(cfg["f"](ctx.rank), op="sum")

if __name__ == "__main__":
    print("RESULT", job({"f": lambda r: r + 5}), forkserver.server_running())
"""


@pytest.mark.parametrize("where", ["before-decoration", "before-import"])
def test_a_torch_op_before_the_decoration(tmp_path: Path, where: str) -> None:
    """Issue 46 item 3: after a torch op that came after the script's `from distfn import distributed`, the ranks
    fork from the copy made at that import (fork speed); an op before the import leaves no safe moment to copy
    the process: the fork server is then a fresh interpreter, started at decoration."""
    script = tmp_path / "op_first.py"
    script.write_text(OP_FIRST)
    done = run_python([str(script), where], env=clean_env(OMP_NUM_THREADS="2"), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "RESULT 11 True" in done.stdout  # (0 + 5) + (1 + 5), the lambda by value
    assert "start method forkserver" in done.stderr
    if where == "before-import":
        assert "a fresh interpreter" in done.stderr, done.stderr
    else:
        assert "a copy of this process made at `from distfn import distributed`" in done.stderr, done.stderr


NEVER_CALLS = """
import torch
torch.randn(600, 600) @ torch.randn(600, 600)  # an OpenMP pool before the import: the probe will hang
from distfn import distributed
from distfn import preflight
from distfn.launch import forkserver
print("RESULT", preflight._pending[0][0], forkserver._forkserver()._forkserver_pid, flush=True)
"""


def test_a_script_that_never_calls_leaves_neither_probe_nor_copy(tmp_path: Path) -> None:
    """The pool probe and the copy started at a script's import are asked about only by a call: a script that
    never calls exits at once all the same (the probe, hung on the OpenMP pool, is not waited for) and leaves
    neither behind."""
    script = tmp_path / "never.py"
    script.write_text(NEVER_CALLS)
    done = run_python([str(script)], env=clean_env(OMP_NUM_THREADS="2"), timeout=120)
    assert done.returncode == 0, done.stderr
    probe, copy = map(int, done.stdout.split("RESULT ", 1)[1].split())
    assert not alive(probe) and not alive(copy)


LONG_TMPDIR_JOB = """
import sys
import torch
from distfn import distributed

@distributed(mode="ddp", nprocs=2, backend="gloo", start_method=sys.argv[1])
def job(cfg, ctx):
    return ctx.all_reduce(ctx.rank + 1, op="sum")

if __name__ == "__main__":
    print("IMPORTED", flush=True)
    if sys.argv[2] == "op":
        torch.randn(600, 600) @ torch.randn(600, 600)  # an OpenMP pool: fork is unsafe from here on
    print("RESULT", job({}))
"""


def _long_tmpdir(tmp_path: Path) -> Path:
    long = tmp_path / ("d" * 60) / ("e" * 60)  # over the ~108 bytes of an AF_UNIX path with pymp-*/listener-*
    long.mkdir(parents=True)
    return long


def test_a_fork_script_runs_with_a_tmpdir_too_long_for_a_unix_socket(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LONG_TMPDIR_JOB)
    env = clean_env(TMPDIR=str(_long_tmpdir(tmp_path)), OMP_NUM_THREADS="2")
    done = run_python([str(script), "auto", "plain"], env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "RESULT 3" in done.stdout
    # forking unsafe at the call: no fork server can start, so the workers start with spawn, saying why
    done = run_python([str(script), "auto", "op"], env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "RESULT 3" in done.stdout and "TMPDIR" in done.stderr and "spawn" in done.stderr


def test_forkserver_by_name_with_a_tmpdir_too_long_is_a_config_error_at_the_call(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LONG_TMPDIR_JOB)
    env = clean_env(TMPDIR=str(_long_tmpdir(tmp_path)), OMP_NUM_THREADS="2")
    done = run_python([str(script), "forkserver", "plain"], env=env, timeout=180)
    assert done.returncode != 0
    assert "IMPORTED" in done.stdout  # the import went through; the call failed
    assert "ConfigError" in done.stderr and "TMPDIR=" in done.stderr and "too long" in done.stderr


LISTENERS = """
import multiprocessing, os, sys, time
import torch
from multiprocessing.connection import Listener
from distfn import distributed


def linger(out):  # a DataLoader worker's way: it sees its parent die, ends within seconds, unlinks its socket
    listener = Listener()
    parent = os.getppid()
    with open(os.path.join(out, "helper"), "w") as f:
        f.write(listener.address)
    while os.getppid() == parent:
        time.sleep(0.05)
    time.sleep(1.0)
    listener.close()


@distributed(mode="ddp", nprocs=2)
def job(cfg, ctx):
    if ctx.rank == 0:
        multiprocessing.get_context("fork").Process(target=linger, args=(cfg,)).start()
    else:
        kept = Listener()  # never closed: this rank dies by SIGKILL with the launcher
        with open(os.path.join(cfg, "rank1"), "w") as f:
            f.write(kept.address)
    time.sleep(600)

if __name__ == "__main__":
    torch.randn(600, 600) @ torch.randn(600, 600)  # fork is unsafe from here: the fork server forks the ranks
    job(sys.argv[1])
"""


@pytest.mark.slow  # a launch, then the server's wait for the sockets' owners (forkserver.LINGER_S)
def test_a_killed_launchers_multiprocessing_directory_goes_with_what_its_ranks_left_in_it(tmp_path: Path) -> None:
    """``pymp-*`` directories were left when the launcher was SIGKILLed: its ranks inherit its multiprocessing
    directory, and a socket a rank or its helper (a DataLoader worker) had in it kept the server from removing
    it. The server, which outlives the launcher, removes it whole once they had time to end."""
    proc, tmp = _launch_with_own_tmpdir(tmp_path, "listeners.py", LISTENERS)
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "helper").exists() and (tmp_path / "rank1").exists()) \
                and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        sockets = [Path((tmp_path / name).read_text()) for name in ("helper", "rank1")]
        pymp = [p for p in tmp.iterdir() if p.name.startswith("pymp-")]
        assert len(pymp) == 1 and all(s.parent == pymp[0] for s in sockets)  # one directory: the launcher's
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + forkserver.LINGER_S + 10
        while pymp[0].exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(tmp.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_the_fork_server_tells_a_live_launcher_from_a_dead_or_dying_one() -> None:
    """The server's clean-up after a killed launcher hinges on this answer (`forkserver._launcher_gone`): a live
    parent that closed the pipe on purpose keeps its directory; another parent (reparented) or a dying one
    (``PF_EXITING``: files already closed, children not yet reparented) means the launcher is gone."""
    assert not forkserver._launcher_gone(os.getppid())  # pytest's parent: alive, not exiting
    assert forkserver._launcher_gone(os.getppid() + 1_000_000)  # not our parent: reparented
