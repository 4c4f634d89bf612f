"""A job that hangs on purpose, for tests/test_hangs.py and tests/cluster/test_hangs_*.py.

Usage: python hang_job.py CASE [TIMEOUT]

CASE: ``sleep`` (rank 1 sleeps in user code while the others wait at a barrier), ``mismatch`` (rank 0 calls
all_reduce, rank 1 broadcast_object), ``kill`` (rank 1 SIGKILLs itself while the others wait at a barrier),
``gil`` (rank 1 stuck in C code that holds the GIL), ``cfg`` (a different cfg on rank 1), ``model`` (one layer of
a different size on rank 1), ``fsdp-save`` (mode="fsdp": rank 0 in ctx.save's full-state gather while rank 1
sleeps). Run it as is (self-spawn, 2 ranks), or under any launcher.
TIMEOUT: the collective timeout in seconds (default 10).
"""

import os
import re
import signal
import sys
import tempfile
import time

import torch
from torch import nn

from distfn import distributed

CASE = sys.argv[1]
TIMEOUT = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
LAUNCHED = "RANK" in os.environ or "SLURM_PROCID" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def sleepy(seconds: float) -> None:
    time.sleep(seconds)  # HANG-SLEEP-LINE


@distributed(mode="ddp", timeout=TIMEOUT, **({} if LAUNCHED else {"nprocs": 2}))
def job(cfg, ctx):
    ctx.barrier()
    if ctx.rank == 0:
        print("STARTED", time.time(), flush=True)  # the tests time the end of the job from here
    if CASE == "sleep":
        if ctx.rank == 1:
            sleepy(120)
        ctx.barrier()  # HANG-BARRIER-LINE
    elif CASE == "mismatch":
        if ctx.rank == 1:
            ctx.broadcast_object("x")  # HANG-BROADCAST-LINE
        else:
            ctx.all_reduce(1.0)  # HANG-ALLREDUCE-LINE
    elif CASE == "kill":
        if ctx.rank == 1:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.barrier()
    elif CASE == "gil":
        if ctx.rank == 1:
            re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: C code that never releases the GIL
        ctx.barrier()
    elif CASE in ("cfg", "model"):
        width = 9 if CASE == "model" and ctx.rank == 1 else 8
        ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, width)))
    return "done"


@distributed(mode="fsdp", timeout=TIMEOUT, fsdp={"min_params": 1}, **({} if LAUNCHED else {"nprocs": 2}))
def fsdp_save(cfg, ctx):
    model = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))
    ctx.barrier()
    if ctx.rank == 0:
        print("STARTED", time.time(), flush=True)
    if ctx.rank == 1:
        sleepy(120)
    ctx.save(model, os.path.join(tempfile.gettempdir(), f"distfn-hang-{os.getpid()}.safetensors"))  # HANG-SAVE-LINE
    return "done"


if __name__ == "__main__":
    cfg = {"lr": 0.1, "model": {"width": 8}}
    rank = os.environ.get("RANK", "0")
    if CASE == "cfg" and rank == "1":
        cfg["lr"] = 0.2
    print("RESULT", (fsdp_save if CASE == "fsdp-save" else job)(cfg), flush=True)
    torch.set_num_threads(1)
