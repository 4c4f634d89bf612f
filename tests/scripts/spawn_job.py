"""Small self-spawned 2-rank jobs whose caller-side result tests/test_spawn.py inspects.

Usage: python spawn_job.py CASE [START_METHOD]   (prints one JSON line describing what the caller got)

Cases: ``namedtuple`` (rank 0 returns a namedtuple and an OrderedDict holding tensors that require grad),
``view`` (cfg holds a 2-element slice of a 40 MB tensor, and rank 0 returns one: only their bytes travel),
``bad_str`` (rank 1 raises an exception whose ``__str__`` raises), ``exit0`` (rank 1 calls ``sys.exit(0)``
while rank 0 goes on to a collective), ``options`` (a module-level decorated function called through
``.options(precision="bf16")``: every rank reports the precision it ran with; ``DISTFN_PRECISION``
in the environment overrides), ``watchdog`` (a CPU stand-in for NCCL's watchdog: 3 ranks, timeout=3; rank 0
waits past the timeout and aborts like the watchdog would, rank 2 waits at the same place, rank 1 is elsewhere).
``restart`` (``max_restarts=1``: rank 1 raises on attempt 0 only), ``always`` (rank 1 raises on every attempt;
the test sets ``DISTFN_MAX_RESTARTS``), ``config`` (rank 1 raises a ConfigError: never retried).
A failed job prints ``{"error": ...}``.
"""

import collections
import json
import os
import sys
import time

import torch

from distfn import ConfigError, WorkerError, distributed

Result = collections.namedtuple("Result", ["loss", "weights"])


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("__str__ is broken too")


def body(cfg, ctx):
    if cfg == "namedtuple":
        w = torch.ones(3, requires_grad=True)
        return Result(loss=(w * 2).sum(), weights=collections.OrderedDict(w=w * 3))
    if isinstance(cfg, dict) and cfg["case"] == "view":
        big = torch.arange(10_000_000, dtype=torch.float32)  # 40 MB
        return {"cfg": cfg["tensor"].tolist(), "cfg_bytes": cfg["tensor"].untyped_storage().nbytes(),
                "view": big[ctx.rank + 1:ctx.rank + 3]}
    if cfg == "bad_str":
        ctx.barrier()
        if ctx.rank == 1:
            raise BadStr("lost")
        ctx.barrier()
    if cfg == "exit0":
        ctx.barrier()
        if ctx.rank == 1:
            sys.exit(0)
        ctx.barrier()
        return "rank 0 got through"
    if cfg == "watchdog":
        ctx.barrier()
        if ctx.rank == 1:
            time.sleep(60)  # the rank that never arrives
        time.sleep(3.5 if ctx.rank == 0 else 60) or os.abort()  # "blocked at .item()"; the watchdog aborts rank 0
    if cfg in ("restart", "always", "config"):
        if ctx.rank == 1 and (ctx.restart == 0 or cfg == "always"):
            raise (ConfigError if cfg == "config" else ValueError)(f"attempt {ctx.restart} fails")
        return ctx.gather_object([ctx.restart, ctx.rank, os.getpid()])
    raise ValueError(cfg)


@distributed(nprocs=2, precision="32")
def options_job(cfg, ctx):
    return ctx.gather_object([ctx.precision, ctx.rank])


def describe(value):
    if cfg_case in ("options", "restart"):
        return {"ranks": value}
    if cfg_case == "namedtuple":
        return {"type": type(value).__name__, "inner": type(value.weights).__name__,
                "loss": value.loss.item(), "grad": [value.loss.requires_grad, value.weights["w"].requires_grad],
                "devices": [value.loss.device.type, value.weights["w"].device.type]}
    view = value["view"]
    return {"cfg": value["cfg"], "cfg_bytes": value["cfg_bytes"], "values": view.tolist(),
            "storage_bytes": view.untyped_storage().nbytes()}


if __name__ == "__main__":
    cfg_case = sys.argv[1]
    method = sys.argv[2] if len(sys.argv) > 2 else "auto"
    job = distributed(nprocs=2, start_method=method, timeout=60)(body)
    cfg = cfg_case
    if cfg_case == "view":
        cfg = {"case": "view", "tensor": torch.arange(10_000_000, dtype=torch.float32)[3:5]}
    if cfg_case == "options":
        job = options_job.options(precision="bf16", start_method=method)
    if cfg_case == "watchdog":
        job = job.options(nprocs=3, timeout=3)
    if cfg_case == "restart":
        job = job.options(max_restarts=1)
    try:
        out = describe(job(cfg))
    except WorkerError as exc:
        out = {"error": str(exc)}
    print(json.dumps(out), flush=True)
