"""Kept-alive ranks (issue 46 item 1), seen from a plain script: prints ``RESULT {json}`` for tests/test_pool.py.

One launching process walks through the pool's rules in order: later calls on the same ranks with the results of a
fresh launch, a per-call option (same ranks) and a process-level one (fresh ranks), then each way a call can end
the ranks (a failure, a hang, Ctrl-C, ``sys.exit``, a rank killed between calls), each followed by a call that
works on fresh ranks, and the environment's changes reaching the ranks. The test checks what is left afterwards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distfn import WorkerError, distributed
from distfn.launch import pool

import pool_state


@distributed(mode="ddp", nprocs=2, seed=0, keep_alive=True, timeout=6)
def job(cfg: dict[str, Any], ctx: Any) -> Any:
    pool_state.CALLS += 1  # a global of an imported module: kept between the calls of one pool
    do = cfg["do"]
    if do == "fail" and ctx.rank == 1:
        raise ValueError("boom from rank 1")
    if do == "hang":
        if ctx.rank == 1:
            time.sleep(60)  # never reaches the barrier: rank 0's times out, the hang report names rank 1
        ctx.barrier()
    if do == "sleep":
        with open(os.path.join(cfg["ready"], f"asleep{ctx.rank}"), "w"):
            pass
        time.sleep(60)
    if do == "exit":
        sys.exit(0)
    if do == "env":
        return os.environ.get("POOL_X")
    model = ctx.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(3):
        opt.zero_grad()
        (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
        opt.step()
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.zeros_like(w) for _ in range(ctx.world_size)]
    dist.all_gather(every, w)
    return {"w": [round(v, 6) for v in w.tolist()], "same": all(torch.equal(every[0], t) for t in every),
            "draws": [random.random(), float(np.random.rand()), torch.rand(1).item()],
            "pid": os.getpid(), "calls": pool_state.CALLS, "world": ctx.world_size,
            "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}  # no growth per call


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def pids() -> list[int]:
    kept = pool.current()
    return kept.pids if kept is not None else []


def ended_by(do: str, **extra: Any) -> dict[str, Any]:
    """Call ``job`` with ``do``, which must not succeed; what the caller saw and whether the ranks are gone."""
    before = pids()
    seen = "returned"
    try:
        job({"do": do, **extra})
    except WorkerError as exc:
        seen = f"WorkerError: {exc}"
    except KeyboardInterrupt:
        seen = "KeyboardInterrupt"
    time.sleep(0.2)
    after = job({"do": "train"})
    return {"seen": seen[:3000], "pool_after": pool.current() is not None, "old_alive": alive(before),
            "next_ok": after["same"], "next_fresh": after["pid"] not in before and after["calls"] == 1}


def interrupt_when_asleep(ready: str) -> None:
    """SIGINT to this process (Ctrl-C) once both ranks wrote that they sleep in the call (at most 60 s from now)."""
    deadline = time.monotonic() + 60
    while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)


def main() -> None:
    # Ctrl-C as in a terminal: a process started from a background job of a non-interactive shell inherits SIGINT
    # ignored, and Python then leaves it ignored (how two clean-clone CI trials saw the interrupted call return)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out: dict[str, Any] = {}
    first = job({"do": "train"})
    ranks = pids()
    second = job({"do": "train"})
    out["reuse"] = {"first": first, "second": second, "same_pids": pids() == ranks and len(ranks) == 2}
    out["fresh"] = job.options(keep_alive=False)({"do": "train"})  # the launch without a pool: same results
    out["reseeded"] = job.options(seed=1)({"do": "train"})  # a per-call option: the same ranks
    out["after_seed"] = pids() == ranks
    three = job.options(nprocs=3)({"do": "train"})  # a process-level option: fresh ranks
    out["nprocs3"] = {"world": three["world"], "old_alive": alive(ranks), "new": pids()}
    job({"do": "train"})
    os.environ["POOL_X"] = "set"
    out["env_set"] = job({"do": "env"})
    del os.environ["POOL_X"]
    out["env_unset"] = job({"do": "env"})
    out["fail"] = ended_by("fail")
    out["hang"] = ended_by("hang")
    # Ctrl-C once both ranks are inside the call (a timer from before the call raced a launch slowed by load: CI
    # once saw the call run its whole 60 s sleep and return); the seconds it took and the kept ranks' reuse say more
    ready = tempfile.mkdtemp()
    threading.Thread(target=interrupt_when_asleep, args=(ready,), daemon=True).start()
    started, reused = time.monotonic(), pids()
    out["interrupt"] = ended_by("sleep", ready=ready)
    out["interrupt"]["took_s"] = round(time.monotonic() - started, 1)
    out["interrupt"]["on_kept_ranks"] = bool(reused)
    shutil.rmtree(ready)
    out["exit"] = ended_by("exit")
    # a cfg the ranks cannot load (its class's module exists only in this process, made after they started)
    made_here = types.ModuleType("made_here")
    exec("class Thing:\n    pass", made_here.__dict__)
    made_here.Thing.__module__ = "made_here"
    sys.modules["made_here"] = made_here
    out["unloadable"] = ended_by("train", thing=made_here.Thing())
    victim = pids()[1]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    out["killed"] = {"next": job({"do": "train"})["same"], "victim_alive": alive([victim]),
                     "fresh": victim not in pids()}
    last = pids()
    job.options(seed=5).shutdown()  # a variant's shutdown ends the ranks kept for the function
    out["shutdown"] = {"pool": pool.current() is not None, "alive": alive(last), "had": len(last)}
    out["last_pids"] = job({"do": "train"})["pid"] not in last
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
