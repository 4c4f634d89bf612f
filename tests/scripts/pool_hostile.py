"""Kept-alive ranks under a hostile or careless user (issue 46 item 1, `distfn.launch.pool`), seen from a plain script
(start method fork): prints ``RESULT {json}`` for tests/test_pool.py.

Each step is something the launching process does between or around calls that a fresh launch would take in its
stride: a ``__main__`` global, the working directory and ``sys.path`` changed; torch settings changed by a call; a
stop signal sent to a rank between calls; a ``cfg`` that only fork can send; a process-level environment variable
changed; a rank stopped with SIGSTOP; a child of ``os.fork`` that exits; two threads calling at once;
``shutdown()`` from another thread during a call; a call from an exit handler after the pool's own.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from distfn import distributed
from distfn.launch import pool

SCALE = 1.0  # a __main__ global the function reads: rebound between calls
CONF = {"k": 1}  # one a helper reads: changed in place between calls
LOCK = threading.Lock()  # one plain pickle cannot send: the ranks keep their own


def conf_k() -> int:
    with LOCK:
        return CONF["k"]


@distributed(mode="ddp", nprocs=2, keep_alive=True, timeout=60)
def job(cfg: dict[str, Any], ctx: Any) -> Any:
    if cfg.get("sleep"):
        time.sleep(cfg["sleep"])
    seen = {"scale": SCALE, "cwd": os.getcwd(), "path": cfg.get("marker", "") in sys.path,
            "grad": torch.is_grad_enabled(), "dtype": str(torch.get_default_dtype()),
            "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "precision": torch.get_float32_matmul_precision(), "pid": os.getpid(),
            "sum": ctx.all_reduce(float(ctx.rank) * SCALE, op="sum"), "tag": cfg.get("tag"),
            "should_stop": ctx.should_stop, "conf": conf_k()}
    seen["leak"] = os.environ.get("POOL_LEAK")
    if cfg.get("mess"):  # process-wide state a fresh rank would not have: torch settings, a variable set here
        os.environ["POOL_LEAK"] = "set by the first call"
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(torch.get_num_threads() + 1)
        torch.use_deterministic_algorithms(True)
        torch.set_float32_matmul_precision("medium")
    return seen


def pids() -> list[int]:
    kept = pool.current()
    return kept.pids if kept is not None else []


def late() -> None:
    """A call from an exit handler that runs after the pool's own: it must keep no ranks (nothing would end them)."""
    value = job({"tag": "late"})["tag"]
    print("LATE", json.dumps({"tag": value, "pool": pool.current() is not None}), flush=True)


def main() -> None:
    global SCALE
    out: dict[str, Any] = {}
    atexit.register(late)  # before the first call, so it runs after the pool's exit handler
    first = job({"mess": True})
    ranks = pids()
    os.kill(ranks[0], signal.SIGUSR2)  # straight to a rank between calls: a fresh rank would have no stop on record
    time.sleep(0.3)
    # what a fresh fork would see: the global as it is now, the cwd, sys.path; the torch state of a fresh rank
    SCALE = 3.0
    CONF["k"] = 2
    here = tempfile.mkdtemp(prefix="pool-hostile-")
    os.chdir(here)
    marker = os.path.join(here, "on-path")
    sys.path.append(marker)
    second = job({"marker": marker})
    out["follows"] = {"first": first, "second": second, "same_ranks": pids() == ranks, "here": os.path.realpath(here)}
    os.chdir("/")
    os.rmdir(here)
    # a cfg only fork can send (a lock): fresh ranks take it, as a fresh launch would
    out["unpicklable"] = {"ok": job({"lock": threading.Lock()})["sum"], "fresh": not set(pids()) & set(ranks)}
    # a variable read once per process (NCCL's) changed: fresh ranks
    ranks = pids()
    os.environ["NCCL_DEBUG"] = "WARN"
    out["process_env"] = {"ok": job({})["sum"], "fresh": not set(pids()) & set(ranks)}
    # a rank stopped between calls: the next call starts fresh ranks at once, not after the collective timeout
    ranks = pids()
    os.kill(ranks[1], signal.SIGSTOP)
    for _ in range(200):  # a signal is delivered when its target next runs: a loaded machine takes a while
        with open(f"/proc/{ranks[1]}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.05)
    began = time.monotonic()
    out["stopped"] = {"ok": job({})["sum"], "seconds": time.monotonic() - began, "fresh": not set(pids()) & set(ranks)}
    # a child of os.fork that exits normally (atexit runs): the parent's ranks are not its to end
    ranks = pids()
    child = os.fork()
    if child == 0:
        sys.exit(0 if pool.current() is None else 3)  # atexit runs here: before the fix it ended the parent's ranks
    _, status = os.waitpid(child, 0)
    out["forked"] = {"child_exit": os.waitstatus_to_exitcode(status), "same_ranks": job({})["pid"] == ranks[0]}
    # two threads at once: one call at a time, both on the kept ranks
    got: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda t=t: got.__setitem__(t, job({"tag": t, "sleep": 0.5})))
               for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["threads"] = {t: [got[t]["tag"], got[t]["pid"] == ranks[0]] for t in ("a", "b")}
    # shutdown() from another thread while a call runs: it waits for the call, which returns its value
    caller = threading.Thread(target=lambda: got.__setitem__("slow", job({"sleep": 2.0, "tag": "slow"})))
    caller.start()
    time.sleep(0.8)
    job.shutdown()
    caller.join()
    out["shutdown_mid_call"] = {"value": got.get("slow", {}).get("tag"), "pool": pool.current() is not None}
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
