"""Kept-alive ranks (issue 46 item 1, `distfn.launch.pool`): ``@distributed(keep_alive=True)`` runs later calls on
the ranks of the first, with the results of a fresh launch; every call that does not succeed (a failure, a hang,
Ctrl-C, ``sys.exit``), a process-level option changed, or a rank that died ends the ranks and the next call starts
fresh ones; nothing is left after the script or the kernel (processes, ports, shared memory, temp files).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from distfn import distributed
from distfn.errors import ConfigError
from distfn.launch import pool
from distfn.options import Options, with_env

from conftest import SCRIPTS, alive, clean_env, requires

sys.path.insert(0, str(SCRIPTS))
from rel_leftovers import outliving


def test_keep_alive_is_a_bool_checked_at_decoration_and_the_environment_overrides_it() -> None:
    with pytest.raises(ConfigError, match="keep_alive must be True or False, got 'yes'"):
        distributed(keep_alive="yes")
    assert distributed(keep_alive=True)(lambda cfg, ctx: None).distfn_options.keep_alive is True
    assert with_env(Options(), {"DISTFN_KEEP_ALIVE": "1"}).keep_alive is True
    assert with_env(Options(keep_alive=True), {"DISTFN_KEEP_ALIVE": "off"}).keep_alive is False
    with pytest.raises(ConfigError, match="DISTFN_KEEP_ALIVE='maybe'"):
        with_env(Options(), {"DISTFN_KEEP_ALIVE": "maybe"})


def test_per_call_options_keep_the_ranks_and_process_level_ones_do_not() -> None:
    def fn(cfg: Any, ctx: Any) -> None: ...

    def other(cfg: Any, ctx: Any) -> None: ...

    base = Options(mode="ddp", keep_alive=True)
    key = pool.pool_key(fn, base, 2)
    for per_call in ({"seed": 3}, {"precision": "bf16"}, {"max_restarts": 2}, {"requeue": True}, {"track": "csv"}):
        assert pool.pool_key(fn, Options(mode="ddp", keep_alive=True, **per_call), 2) == key, per_call
    for fixed in ({"mode": "fsdp"}, {"backend": "gloo"}, {"devices": "0"}, {"start_method": "spawn"},
                  {"timeout": datetime.timedelta(seconds=5)}, {"init_method": "tcp://127.0.0.1:1234"}):
        assert pool.pool_key(fn, Options(keep_alive=True, **{"mode": "ddp", **fixed}), 2) != key, fixed
    assert pool.pool_key(fn, base, 3) != key
    assert pool.pool_key(other, base, 2) != key


def test_a_forked_child_forgets_the_parents_pool_and_its_exit_leaves_the_ranks_alone() -> None:
    # a stand-in for a live pool (a sleeping child as its rank): what the child of the user's os.fork sees
    import multiprocessing as mp

    from distfn.launch import local

    group = local.WorkerGroup("fork", 1, Options(), keep_alive=True)
    rank = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    rank.start()
    reader, writer = mp.Pipe()
    group.workers.append(local._Worker(0, rank, reader))
    fake = pool.Pool(("key",), group, "fork", {})
    pool._current = fake
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's side: no pool, a shutdown (at its exit too) ends nothing
            ok = pool.current() is None and reader.closed
            pool.shutdown()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.current() is fake and rank.is_alive() and not reader.closed
    finally:
        pool._current = None
        rank.kill()
        rank.join()
        group.teardown()  # closes the parent's end of the pipe
        writer.close()


def test_a_kept_rank_puts_back_the_torch_settings_a_call_changed() -> None:
    import torch

    from distfn.launch import protocol

    before = protocol.TorchState.now()
    try:
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        assert protocol.TorchState.now() != before
        before.restore()
        assert protocol.TorchState.now() == before and torch.is_grad_enabled()
    finally:
        before.restore()


def test_putting_back_one_setting_touches_no_other() -> None:
    """A kept rank's every later call finds the thread count changed (the bootstrap sets it per rank): putting it
    back must not call torch.use_deterministic_algorithms, whose first call imports torch._dynamo and inductor (2 s
    on a later call, then a heavier heap: the cost of a fresh launch, found by bench_launch)."""
    code = (
        "import sys, torch\n"
        "from distfn.launch import protocol\n"
        "before = protocol.TorchState.now()\n"
        "torch.set_num_threads(before.threads + 1)\n"
        "torch.set_default_dtype(torch.float64)\n"
        "before.restore()\n"
        "assert protocol.TorchState.now() == before, protocol.TorchState.now()\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "clean"


def _run_job(tmp: Path, timeout: float, script: str = "pool_job.py") -> tuple[dict[str, Any],
                                                                             subprocess.CompletedProcess[str], int]:
    env = clean_env(TMPDIR=str(tmp), OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(SCRIPTS.parent.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("NCCL_DEBUG", None)  # the script changes it to check that the ranks start afresh
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 0 and "RESULT " in out, out[-2000:] + err[-4000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0]), done, proc.pid


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_reuses_the_ranks_and_every_call_that_does_not_succeed_ends_them(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    got, done, pid = _run_job(tmp, timeout=480)
    reuse = got["reuse"]
    first, second = reuse["first"], reuse["second"]
    # the same processes, the same results as the first call and as a fresh launch (seed= reseeds every call),
    # no descriptor or thread more in the ranks
    assert reuse["same_pids"] and first["pid"] == second["pid"] and (first["calls"], second["calls"]) == (1, 2)
    assert first["same"] and {k: v for k, v in second.items() if k != "calls"} == \
        {k: v for k, v in first.items() if k != "calls"}
    fresh = got["fresh"]
    assert fresh["pid"] != first["pid"] and fresh["calls"] == 1
    assert (fresh["w"], fresh["draws"]) == (first["w"], first["draws"])
    # a per-call option (seed) on the same ranks; a process-level one (nprocs) on fresh ones, the old ones gone
    assert got["reseeded"]["pid"] == first["pid"] and got["reseeded"]["w"] != first["w"] and got["after_seed"]
    assert got["nprocs3"]["world"] == 3 and got["nprocs3"]["old_alive"] == [] and len(got["nprocs3"]["new"]) == 3
    # the launching process's environment, as it is at each call
    assert (got["env_set"], got["env_unset"]) == ("set", None)
    # each way a call ends the ranks: what the caller sees is what it sees without a pool, the next call is fresh
    assert got["fail"]["seen"].startswith("WorkerError: rank 1") and "boom from rank 1" in got["fail"]["seen"]
    assert "timed out after 6 s" in got["hang"]["seen"] and "Rank 1 had not reached a collective" in \
        got["hang"]["seen"]  # the hang report as without a pool
    assert got["interrupt"]["seen"] == "KeyboardInterrupt", got["interrupt"]
    assert got["exit"]["seen"] == "returned"  # sys.exit(0) on every rank: no error, but the ranks are ended
    unloadable = got["unloadable"]["seen"]  # reported as the call's failure by the ranks, not a rank dying
    assert unloadable.startswith("WorkerError: rank ") and unloadable.count("failed with ModuleNotFoundError: No "
                                                                            "module named 'made_here'") == 2
    for how in ("fail", "hang", "interrupt", "exit", "unloadable"):
        ended = got[how]
        assert ended["old_alive"] == [] and ended["next_ok"] and ended["next_fresh"] and ended["pool_after"], how
    assert got["killed"] == {"next": True, "victim_alive": [], "fresh": True}  # a rank killed between calls
    assert "keep_alive: starting fresh ranks (a rank died since the last call)" in done.stderr
    assert got["shutdown"] == {"pool": False, "alive": [], "had": 2} and got["last_pids"]  # job.shutdown()
    # nothing outlives the script: no process of its session, no temp entry (sockets, shm files live there)
    assert outliving(pid) == []
    assert not any(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert not any(str(pid) in name for name in os.listdir("/dev/shm"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_later_call_sees_what_a_fresh_launch_would_and_unfit_or_foreign_ranks_are_never_used(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    got, done, pid = _run_job(tmp, timeout=480, script="pool_hostile.py")
    follows = got["follows"]
    first, second = follows["first"], follows["second"]
    assert follows["same_ranks"] and first["pid"] == second["pid"]
    # a __main__ global rebound, the cwd and sys.path changed in the launching process: seen as a fresh fork would
    assert (first["scale"], second["scale"], second["sum"]) == (1.0, 3.0, 3.0)
    assert (first["conf"], second["conf"]) == (1, 2)  # read by a helper, changed in place
    assert os.path.realpath(second["cwd"]) == follows["here"] and second["path"] and not first["path"]
    # the first call changed torch's process-wide settings and a stop signal reached a rank between the calls: the
    # second call starts from what the first started from
    for name in ("grad", "dtype", "threads", "deterministic", "precision", "should_stop", "leak"):
        assert second[name] == first[name], name
    # what the kept ranks cannot take (a cfg only fork sends; NCCL_DEBUG changed; a stopped rank) runs on fresh ones
    assert got["unpicklable"] == {"ok": 3.0, "fresh": True}
    assert got["process_env"] == {"ok": 3.0, "fresh": True}
    assert "starting fresh ranks (NCCL_DEBUG changed" in done.stderr
    stopped = got["stopped"]
    assert stopped["ok"] == 3.0 and stopped["fresh"] and stopped["seconds"] < 40  # not the collective timeout (60 s)
    # the child of an os.fork has no pool, and its exit left the parent's ranks alone
    assert got["forked"] == {"child_exit": 0, "same_ranks": True}
    # threads: one call at a time on the kept ranks; shutdown() from another thread waits for the call in flight
    assert got["threads"] == {"a": ["a", True], "b": ["b", True]}
    assert got["shutdown_mid_call"] == {"value": "slow", "pool": False}
    # a call from an exit handler that runs after the pool's: it runs, and keeps no ranks the exit would wait for
    assert json.loads(done.stdout.split("LATE ", 1)[1].splitlines()[0]) == {"tag": "late", "pool": False}
    assert outliving(pid) == []
    assert not any(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


# A notebook: a torch op first (fork is unsafe: the fork server starts the ranks, the cell's function and a class
# of the notebook travel by value), later calls on the same ranks, a failure, Ctrl-C, then the kernel shut down.
DEFS = '''
import json, os, time
import torch
from distfn import distributed
from distfn.launch import pool
data = torch.randn(300, 300) @ torch.randn(300, 300)

class Scale:
    def __init__(self, k):
        self.k = k

@distributed(mode="ddp", nprocs=2, seed=0, keep_alive=True)
def job(cfg, ctx):
    if cfg == "boom" and ctx.rank == 1:
        raise ValueError("boom from rank 1")
    if isinstance(cfg, str) and cfg.startswith("sleep:"):
        with open(os.path.join(cfg[6:], f"pid{ctx.rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return [ctx.all_reduce(float(ctx.rank + cfg.k), op="sum"), torch.rand(1).item(), os.getpid()]
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
@requires("nbclient", "test")
@requires("ipykernel", "test")
def test_a_jupyter_kernel_reuses_the_ranks_and_leaves_none_after_it_shuts_down(tmp_path: Path) -> None:
    import nbclient
    import nbformat

    pids = tmp_path / "pids"
    pids.mkdir()
    show = "print('RESULT', json.dumps([{}, pool.current() and pool.current().pids]))"
    cells = {
        "defs": DEFS,
        "one": show.format("job(Scale(1))"),
        "two": show.format("job(Scale(2))"),
        "boom": "job('boom')",
        "after_error": show.format("job(Scale(1))"),
        "sleep": f"job('sleep:{pids}')",
        "after_interrupt": show.format("job(Scale(1))"),
    }
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells.values()])
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    out: dict[str, str] = {}
    errors: dict[str, str] = {}

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        asyncio.run(client.km.interrupt_kernel())

    with client.setup_kernel(env=clean_env(TMPDIR=str(tmp_path))):
        kernel_pid = client.km.provisioner.pid if client.km.provisioner is not None else None
        for index, (name, cell) in enumerate(zip(cells, nb.cells, strict=True)):
            helper = threading.Thread(target=interrupt_when_running) if name == "sleep" else None
            if helper is not None:
                helper.start()
            client.execute_cell(cell, index)
            if helper is not None:
                helper.join()
            out[name] = "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")
            errors.update((name, o["ename"]) for o in cell.outputs if o["output_type"] == "error")
    got = {name: json.loads(line.split(" ", 1)[1]) for name, text in out.items()
           for line in text.splitlines() if line.startswith("RESULT ")}
    assert errors == {"boom": "WorkerError", "sleep": "KeyboardInterrupt"}, (errors, out)
    one, two = got["one"], got["two"]
    assert one[0][0] == 0 + 1 + 1 + 1 and two[0][0] == 0 + 1 + 2 + 2  # a class of the notebook, by value
    assert one[0][1] == two[0][1]  # reseeded: the same draw
    assert one[1] == two[1] and one[0][2] == two[0][2] == one[1][0]  # the same ranks
    assert "start method forkserver" in out["one"] and "shipped by value" in out["one"]
    after_error, after_interrupt = got["after_error"], got["after_interrupt"]
    # fresh ranks, the same result
    assert after_error[0][:2] == one[0][:2] and not set(after_error[1]) & set(one[1])
    assert after_interrupt[0][:2] == one[0][:2] and not set(after_interrupt[1]) & set(after_error[1])
    sleepers = [int(p.read_text()) for p in pids.iterdir()]
    assert len(sleepers) == 2 and not any(alive(p) for p in sleepers)
    # the kernel is gone: so are its kept ranks, and whatever of them lay in its TMPDIR
    deadline = time.monotonic() + 20
    while any(alive(p) for p in after_interrupt[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in after_interrupt[1])
    if kernel_pid is not None:
        assert not alive(kernel_pid)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("pymp-", "torch_"))] == []


KILLED = '''
import os, signal
from distfn import distributed
from distfn.launch import pool

@distributed(mode="ddp", nprocs=2, keep_alive=True)
def f(cfg, ctx):
    return os.getpid()

if __name__ == "__main__":
    f(None)
    f(None)
    print("PIDS", *pool.current().pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no clean-up of its own: the ranks must go by themselves
'''


@pytest.mark.slow
def test_kept_ranks_die_with_a_launching_process_killed_by_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env=clean_env(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(
                              [str(SCRIPTS.parent.parent), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == -9 and "PIDS " in done.stdout, done.stdout + done.stderr[-3000:]
    ranks = [int(p) for p in done.stdout.split("PIDS ", 1)[1].split()]
    deadline = time.monotonic() + 20
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) == 2 and not any(alive(p) for p in ranks)  # PR_SET_PDEATHSIG
