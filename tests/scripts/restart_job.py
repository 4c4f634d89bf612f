"""A 2-rank job (``DISTFN_NPROCS`` overrides the count) that resumes from its newest checkpoint; with KILL_AT=k,
rank 1 SIGKILLs itself at step k of attempt 0 and ``max_restarts=1`` starts the job again. Used by
bench/bench_restart.py and bench/stress_faults.py (restart case).

    python tests/scripts/restart_job.py CKPT_DIR MARKS_FILE [KILL_AT]

Prints ``RESULT <sha256 of the final weights>``; MARKS_FILE gets "<event> <attempt> <time>" lines: "call" (the
launching process), "group-up" (rank 0, entering the function: its process group is up), "wrapped" (rank 0,
``ctx.wrap`` returned), "resumed" (rank 0,
``ctx.resume`` returned), "first-step" (rank 0, first step of each attempt), "death" (rank 1, just before the kill);
with ``DISTFN_LAUNCH_TRACE`` set to MARKS_FILE, the launcher adds its own (`distfn.launch.local.TRACE_ENV`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch

from distfn import distributed

STEPS, SAVE_EVERY = 24, 4


def mark(path: str, event: str, attempt: int) -> None:
    with open(path, "a") as f:
        f.write(f"{event} {attempt} {time.time():.6f}\n")


@distributed(mode="ddp", nprocs=2, seed=0, max_restarts=1)
def train(cfg: dict, ctx) -> str:
    if ctx.is_main:
        mark(cfg["marks"], "group-up", ctx.restart)  # the bootstrap joined the process group before the call
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)))
    if ctx.is_main:
        mark(cfg["marks"], "wrapped", ctx.restart)  # DDP's first construction imports torch._dynamo (~1-2 s)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optimizer": opt}
    start = ctx.resume(state, cfg["ckpt"])
    if ctx.is_main:
        mark(cfg["marks"], "resumed", ctx.restart)
    for step in range(start, STEPS):
        if step == start and ctx.is_main:
            mark(cfg["marks"], "first-step", ctx.restart)
        if ctx.restart == 0 and ctx.rank == 1 and step == cfg["kill_at"]:
            mark(cfg["marks"], "death", ctx.restart)
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % SAVE_EVERY == 0:
            ctx.save(state, f"{cfg['ckpt']}/ckpt-{step + 1}.safetensors", keep=2, rng=True)
    flat = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    ckpt, marks = sys.argv[1], sys.argv[2]
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    mark(marks, "call", 0)
    print("RESULT", train({"ckpt": ckpt, "marks": marks, "kill_at": kill_at}))
