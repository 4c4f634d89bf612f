"""One distfn job per fault case, for tests/test_reliability.py and bench/stress_faults.py.

Usage: python rel_job.py CASE[,CASE...] [MARK_DIR|-] [REPEAT]

Runs the cases in turn, REPEAT times over (default 1), in this process and prints one JSON line per launch:
``{"case", "ok", "value", "error", "type", "seconds", "ended", "leftovers"}``; ``leftovers`` lists what the launch left
behind in this process (child processes, listening sockets, /dev/shm segments named after its pids).
With MARK_DIR, every rank writes ``MARK_DIR/<case>.rank<r>.pid`` at start and ``...finally`` in its ``finally``.
Exit status: 0 when the last launch returned, 1 when it raised. REL_UNCAUGHT=1 lets a WorkerError propagate;
REL_START_METHOD picks the start method (default auto, i.e. fork here).
"""

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from distfn import WorkerError, distributed
from distfn.preflight import choose_start_method

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rel_leftovers import leftovers


def _mark(cfg, ctx, what: str) -> None:
    if cfg.get("marks"):
        Path(cfg["marks"], f"{cfg['case']}.rank{ctx.rank}.{what}").write_text(str(os.getpid()))


def body(cfg, ctx):
    case = cfg["case"]
    _mark(cfg, ctx, "pid")
    try:
        ctx.barrier()
        if case == "ok":
            return {"ranks": ctx.gather_object(ctx.rank), "tensor": torch.arange(3) * ctx.world_size}
        if case == "raise" and ctx.rank == 1:
            raise ValueError("boom on rank 1")
        if case == "exit" and ctx.rank == 1:
            sys.exit(3)
        if case == "sigkill" and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "segv" and ctx.rank == 1:
            ctypes.string_at(0)  # a NULL read: SIGSEGV in native code
        if case == "hang" and ctx.rank == 1:
            time.sleep(300)
        if case == "early_return" and ctx.rank == 1:
            return None
        if case == "nested" and ctx.rank == 1:
            return job({"case": "ok"})  # a decorated call inside a worker
        if case == "unpicklable_return":
            return {"fn": lambda x: x}
        if case == "dataloader":
            from torch.utils.data import DataLoader

            loader = DataLoader(list(range(64)), batch_size=4, num_workers=2)
            for i, _ in enumerate(loader):
                if i == 3 and ctx.rank == 1:
                    raise RuntimeError("failed while DataLoader workers run")
        if case in ("sigint", "sigterm", "stubborn"):
            # wait here until the test signals the launching process (this function never polls should_stop)
            steps = 0
            while True:
                ctx.barrier()
                steps += 1
                if steps == 3:
                    _mark(cfg, ctx, "ready")
                time.sleep(0.05)
        ctx.barrier()
        return ctx.rank
    finally:
        _mark(cfg, ctx, "finally")
        if case == "stubborn":
            time.sleep(60)  # a finally block that does not end: only a second Ctrl-C (SIGKILL) stops it


def preempt_body(cfg, ctx):
    """Steps until ctx.should_stop, then returns the step count every rank stopped at."""
    _mark(cfg, ctx, "pid")
    try:
        steps = 0
        while not ctx.should_stop:
            steps += 1
            if steps == 3:
                _mark(cfg, ctx, "ready")
            time.sleep(0.05)
        return {"rank": ctx.rank, "steps": ctx.gather_object(steps)}
    finally:
        _mark(cfg, ctx, "finally")


METHOD = os.environ.get("REL_START_METHOD", "auto")
FORKED = choose_start_method(METHOD)[0] == "fork"  # what distfn picks for the launches below
job = distributed(nprocs=2, timeout=10, start_method=METHOD)(body)
preempt_job = distributed(nprocs=2, timeout=10, start_method=METHOD)(preempt_body)
env_job = distributed(nprocs=2, timeout=10, start_method=METHOD, init_method="env://")(body)  # case "env_ok"


def main() -> int:
    # Ctrl-C must mean KeyboardInterrupt here even when started in the background of a shell script (`cmd &`),
    # which makes the process ignore SIGINT (and Python then keeps ignoring it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cases = sys.argv[1].split(",")
    marks = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    status = 0
    for case in cases * repeat:
        t0 = time.monotonic()
        record = {"case": case, "ok": True, "value": None, "error": None, "type": None}
        try:
            launch = {"preempt": preempt_job, "env_ok": env_job}.get(case, job)
            value = launch({"case": case, "marks": marks})
            record["value"] = repr(value)
            status = 0
        except WorkerError as exc:
            if os.environ.get("REL_UNCAUGHT"):
                raise  # as a user's script would: the traceback on stderr, exit status 1
            record.update(ok=False, error=str(exc), type=type(exc).__name__)
            status = 1
        except KeyboardInterrupt:
            record.update(ok=False, type="KeyboardInterrupt", ended=time.time())
            print(json.dumps(record), flush=True)
            raise
        record["ended"] = time.time()  # wall clock, for the time from a signal sent by another process
        record["seconds"] = round(time.monotonic() - t0, 3)
        record["leftovers"] = leftovers(os.getpid(), forked=FORKED)
        print(json.dumps(record), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
