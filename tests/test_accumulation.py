"""distfn.accumulation: a 2-rank DDP run on CPU checks the all-reduce counts and the big-batch equivalence of
`ctx.accumulate`; windows without DDP, ctx.step placement and clipping run in this process."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import TensorDataset

from distfn import ConfigError, distributed
from distfn.accumulation import Accumulator

EVERY = 4


def _micro_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific data that any process can rebuild (for the big-batch reference)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(2, 4, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True) + 0.5


def _accumulation(ctx) -> dict:
    """2 windows of EVERY micro-batches through DDP, counting the all-reduces a comm hook sees."""
    base = nn.Linear(4, 1).double()
    reference = copy.deepcopy(base)  # the seed made it identical on both ranks
    model = ctx.wrap(base)
    calls: list[int] = []

    def counting_hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ctx.accumulate(model, every=EVERY)
    per_micro, stepped = [], []
    for step in range(2 * EVERY):
        x, y = _micro_batch(ctx.rank, step)
        before = len(calls)
        with acc:
            ctx.backward(F.mse_loss(model(x), y))
            stepped.append(ctx.step(opt))
        per_micro.append(len(calls) - before)

    # The same two updates as single big-batch steps over every rank's micro-batches, without DDP.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for window in range(2):
        batches = [_micro_batch(r, s) for r in range(ctx.world_size)
                   for s in range(window * EVERY, (window + 1) * EVERY)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    pairs = zip(ctx.unwrap(model).parameters(), reference.parameters(), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)

    # With a distfn loader the last batch of an epoch closes the window: 3 batches per rank, every=2.
    xs = torch.randn(12, 4, dtype=torch.float64)
    loader = ctx.dataloader(TensorDataset(xs, xs.sum(1, keepdim=True)), 2)
    acc2 = ctx.accumulate(model, every=2)
    syncs, loader_calls = [], []
    for _ in range(2):
        for x, y in loader:
            before = len(calls)
            with acc2:
                ctx.backward(F.mse_loss(model(x), y))
                ctx.step(opt)
            syncs.append(acc2.sync)
            loader_calls.append(len(calls) - before)
    return {"per_micro": per_micro, "stepped": stepped, "max_diff": diff, "syncs": syncs,
            "loader_calls": loader_calls, "steps": [acc.steps, acc2.steps]}


@distributed(nprocs=2, seed=0)
def _accumulation_job(cfg, ctx):
    return ctx.gather_object(_accumulation(ctx))


def test_accumulation_on_two_ranks() -> None:
    # Accumulation: only the last micro-batch of each window all-reduces (1 bucket) and steps.
    for acc in _accumulation_job():
        assert acc["per_micro"] == [0, 0, 0, 1] * 2
        assert acc["stepped"] == [False, False, False, True] * 2
        assert acc["max_diff"] < 1e-12  # equal to one big-batch step per window
        assert acc["syncs"] == [False, True, True] * 2  # the epoch's last batch closes a short window
        assert acc["loader_calls"] == [0, 1, 1] * 2
        assert acc["steps"] == [2, 4]


def test_accumulate_without_ddp_and_grad_clipping() -> None:
    @distributed(mode="single")
    def job(cfg, ctx):
        model = nn.Linear(2, 1, bias=False)
        assert isinstance(ctx.no_sync(model), type(ctx.autocast()))  # both no-ops here (nullcontext)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        acc = ctx.accumulate(model, every=2)
        stepped = []
        w0 = model.weight.detach().clone()
        for _ in range(4):
            with acc:
                ctx.backward(model(torch.ones(1, 2)).sum())
                stepped.append(ctx.step(opt, max_grad_norm=0.5))
        moved = (w0 - model.weight.detach()).flatten().tolist()  # 2 steps of grad [1, 1] clipped to norm 0.5
        with pytest.raises(ConfigError, match="nested"), acc, acc:
            pass
        # ctx.step after the block works too; a window left open holds only the call right after it.
        with ctx.accumulate(model, every=3):
            ctx.backward(model(torch.ones(1, 2)).sum())
        after = [ctx.step(opt), ctx.step(opt)]
        return stepped, moved, after, model.weight.grad

    stepped, moved, after, grad = job()
    assert stepped == [False, True, False, True] and after == [False, True] and grad is None
    assert moved == pytest.approx([2 * 0.5 / 2**0.5] * 2)


def test_accumulator_argument_checks() -> None:
    with pytest.raises(ConfigError, match="positive int"):
        Accumulator(nn.Linear(1, 1), 0)


def test_timings_count_optimizer_steps_not_micro_batches() -> None:
    """12 micro-batches accumulated 3 by 3 are 4 steps in ``ctx.timings()``; the same loop without ``with acc:``
    is 12 (issue 43: the table said 121 steps for 61 iterations of 2 micro-batches)."""
    from distfn.timings import HostClock, Timings

    def steps(every: int | None) -> int:
        run = Timings(enabled=True, window=1000)
        model = nn.Linear(2, 1)
        run.watch(model, torch.device("cpu"))
        recorder = run.recorder or run.start(0, 1, None, HostClock())
        acc = Accumulator(model, every) if every else None
        for _ in range(12):
            with acc if acc is not None else contextlib.nullcontext():
                model(torch.ones(1, 2)).sum().backward()
        with torch.no_grad():
            model(torch.ones(1, 2))  # an evaluation forward is no step either
        recorder.close()
        recorder.drain(block=True)
        return recorder.steps

    assert steps(3) == 4 and steps(2) == 6 and steps(None) == 12
