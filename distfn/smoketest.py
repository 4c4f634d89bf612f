"""``distfn test``: what to run first on a new machine or cluster.

It starts 2 ranks the way a job would (the detected launcher, e.g. ``srun -N2 distfn test`` or
``torchrun --nproc_per_node=2 -m distfn test``, or self-spawned under a plain shell), runs an all-reduce, a
barrier, a checkpoint save/load round trip and one DDP step, and prints a pass/fail line with the time of each.
Then it trains `TIMED_STEPS` more steps through ``ctx.dataloader`` and prints the per-rank timing table
(`distfn.timings`: data / compute / comm share per rank, the straggler if any), the first look at where a step's
time goes on this machine. ``--gpu`` runs it over NCCL on the GPUs. The exit status is non-zero when a check fails.

Output here is for a person at a terminal, so this module prints (the library itself logs).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .checkpoint import load
from .decorator import distributed
from .errors import DistfnError, WorkerError

__all__ = ["report", "run_test", "smoke_checks"]

#: Carries ``distfn test``'s start time (``time.time()``) to its ranks.
_T0_ENV = "DISTFN_TEST_T0"

#: DDP steps timed after the checks (for the timing table in the report).
TIMED_STEPS = 20


def smoke_checks(cfg: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
    """The body of ``distfn test``, run on every rank: each check's name, pass/fail, seconds and detail.

    A wrong value is a failed check (the ranks agree on it, so they all go on); an exception on a rank ends the
    job with a `WorkerError` naming that rank, which ``distfn test`` reports as the failure.
    """
    started = time.time() - float(os.environ[_T0_ENV])
    checks: list[dict[str, Any]] = [
        {"name": "start", "ok": True, "seconds": started,
         "detail": f"{ctx.world_size} ranks up, {ctx.backend} process group on {ctx.device} ({ctx.launcher})"}]

    def check(name: str, body: Callable[[], tuple[bool, str]]) -> None:
        t = time.perf_counter()
        ok, detail = body()
        checks.append({"name": name, "ok": ok, "seconds": time.perf_counter() - t, "detail": detail})

    def all_reduce() -> tuple[bool, str]:
        total = ctx.all_reduce(torch.tensor([ctx.rank + 1.0], device=ctx.device), op="sum").item()
        want = ctx.world_size * (ctx.world_size + 1) / 2
        return total == want, f"sum of 1..{ctx.world_size} over the ranks = {total:g} (expected {want:g})"

    def barrier() -> tuple[bool, str]:
        ctx.barrier()
        return True, "every rank arrived"

    def save_load() -> tuple[bool, str]:
        if not ctx.is_main:
            return True, "rank 0 writes and reads"
        model = nn.Linear(16, 8)
        with tempfile.TemporaryDirectory(prefix="distfn-test-") as tmp:
            path = ctx.save({"model": model, "step": 7}, Path(tmp) / "check.safetensors")
            loaded = load(path)
            same = all(torch.equal(loaded[f"model.{k}"], v) for k, v in model.state_dict().items())
            verdict = "equal" if same else "DIFFERENT"
            return same, f"{path.stat().st_size} bytes written atomically and read back: {verdict}"

    wrapped: list[nn.Module] = []

    def ddp_step() -> tuple[bool, str]:
        wrap = time.perf_counter()
        model = ctx.wrap(nn.Linear(32, 4))
        wrapped.append(model)
        wrap = time.perf_counter() - wrap
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(ctx.rank)  # different data on every rank
        x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 4, generator=gen)
        nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        opt.step()
        digest = float(sum(p.detach().double().sum().item() for p in model.parameters()))
        low, high = ctx.all_reduce(digest, op="min"), ctx.all_reduce(digest, op="max")
        same = f"weights identical on {ctx.world_size} ranks after a step on different data"
        return low == high, (same if low == high else f"weights differ across ranks ({low} vs {high})") + \
            f" (ctx.wrap: {_format_seconds(wrap)}{', DDP imports torch._dynamo once' if wrap > 1 else ''})"

    check("all-reduce", all_reduce)
    check("barrier", barrier)
    check("save/load", save_load)
    check("ddp step", ddp_step)
    timings = _timed_steps(ctx, wrapped[0]) if wrapped else None
    return {"rank": ctx.rank, "world_size": ctx.world_size, "launcher": ctx.launcher, "backend": ctx.backend,
            "device": str(ctx.device), "checks": checks, "timings": timings}


def _timed_steps(ctx: Any, model: nn.Module) -> str | None:
    """`TIMED_STEPS` DDP steps of ``model`` through ``ctx.dataloader``, then the whole-run timing table as text
    (rank 0; ``None`` elsewhere, or with ``DISTFN_TIMINGS=0``). Every rank calls ``ctx.timings(whole_run=True)``."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(TIMED_STEPS * 4 * ctx.world_size, 32, generator=gen),
                         torch.randn(TIMED_STEPS * 4 * ctx.world_size, 4, generator=gen))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in ctx.dataloader(data, batch_size=4):
        ctx.backward(nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)))
        ctx.step(opt)
    table = ctx.timings(whole_run=True)
    return None if table is None else str(table.format())


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def run_test(*, gpu: bool = False, nprocs: int | None = None, timeout: float = 120.0) -> int:
    """Run `smoke_checks` on 2 ranks (``gpu``: over NCCL, one rank per GPU; ``nprocs``: another count, a
    launcher's wins) and print rank 0's `report`. Returns the exit status (1: a check failed; 2: a bad ``nprocs`` or
    ``timeout``, or no GPU for ``gpu``)."""
    t0 = time.time()
    # Checked here too, not only by the command line: `nprocs or 2` once turned --nprocs 0 into 2 ranks that passed.
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        print(f"distfn test: --nprocs must be a positive number of ranks, got {nprocs!r}", file=sys.stderr)
        return 2
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        print(f"distfn test: --timeout must be a positive, finite number of seconds, got {timeout!r}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {"mode": "ddp", "seed": 0, "timeout": timeout}
    if gpu:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("distfn test --gpu: no CUDA GPU is visible here (torch.cuda.device_count() == 0)", file=sys.stderr)
            return 2
        # one rank per GPU: NCCL needs it
        options.update(backend="nccl", nprocs=min(2, gpus) if nprocs is None else nprocs)
    else:
        options.update(backend="gloo", nprocs=2 if nprocs is None else nprocs)
    try:
        # The command's start time reaches the ranks through the environment, not the cfg: under a launcher each
        # process has its own, and a cfg that differs between ranks is an error (distfn.fingerprint).
        os.environ[_T0_ENV] = repr(t0)
        result = distributed(**options)(smoke_checks)({})
    except (WorkerError, DistfnError) as exc:
        print(f"distfn test: FAILED after {_format_seconds(time.time() - t0)}\n{exc}", file=sys.stderr)
        return 1
    if result["rank"] != 0:  # under a launcher every rank returns; rank 0 reports, the others only exit
        return 0 if all(c["ok"] for c in result["checks"]) else 1
    text, status = report(result, time.time() - t0)
    print(text)
    return status


def report(result: Mapping[str, Any], seconds: float) -> tuple[str, int]:
    """``distfn test``'s report of rank 0's `smoke_checks` result, and the exit status (1 when a check failed)."""
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    lines = [f"distfn test: {result['world_size']} ranks ({result['launcher']}), {result['backend']} on "
             f"{result['device'].split(':')[0]}"]
    for c in result["checks"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']:<12} {_format_seconds(c['seconds']):>9}  "
                     f"{c['detail']}")
    if result.get("timings"):  # the DDP steps after the checks: where a step's time goes here
        lines += ["  " + line for line in str(result["timings"]).splitlines()]
    verdict = f"{len(failed)} of {len(result['checks'])} checks FAILED: {', '.join(failed)}" if failed else \
        f"all {len(result['checks'])} checks passed"
    lines.append(f"{verdict} in {_format_seconds(seconds)}")
    return "\n".join(lines), 1 if failed else 0

