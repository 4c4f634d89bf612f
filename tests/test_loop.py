"""Training-loop helpers: one 2-rank DDP run on CPU checks accumulation (all-reduce counts, big-batch
equivalence), bf16 autocast, SyncBatchNorm handling, rank-0 progress and writer; logging and thread sizing run
as scripts; fp16, DataParallel and argument checks run in this process."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, clean_env, run_python
from loguru import logger
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import TensorDataset

from distfn import ConfigError, distributed, loop

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
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
    diff = max((a - b).abs().max().item() for a, b in zip(ctx.unwrap(model).parameters(), reference.parameters()))

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


def _bf16(ctx) -> dict:
    net = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _micro_batch(ctx.rank, 0)
    before = [p.detach().clone() for p in net.parameters()]
    with ctx.autocast():
        out = net(x.float())
        loss = F.mse_loss(out.float(), y.float())
    with ctx.autocast(enabled=False):
        plain = net(x.float())
    ctx.backward(loss)
    grad_dtypes = {str(p.grad.dtype) for p in net.parameters()}
    ctx.step(opt)
    changed = all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    return {"out": str(out.dtype), "plain": str(plain.dtype), "grads": sorted(grad_dtypes),
            "params": sorted({str(p.dtype) for p in net.parameters()}), "changed": changed,
            "zeroed": all(p.grad is None for p in net.parameters()),
            "weights": torch.cat([p.detach().flatten() for p in net.parameters()]).tolist(),
            "mean_loss": ctx.all_reduce(loss.detach().float()).item()}


def _progress_and_writer(ctx, log_dir: str) -> dict:
    buf = io.StringIO()
    bar = ctx.progress(range(5), desc="epoch 1", file=buf, disable=False, mininterval=0)
    for i in bar:
        bar.log(loss=torch.tensor(float(i)))
    quiet = ctx.progress(range(3), desc="quiet")  # stderr is not a terminal under pytest
    for _ in quiet:
        quiet.log(loss=1.5)
    out = {"bar_text": buf.getvalue(), "bar_visible": bar.visible, "bar_means": bar.means,
           "quiet_visible": quiet.visible, "len": len(bar)}
    try:
        w = ctx.writer(log_dir)
    except ImportError as exc:
        out["writer_error"] = str(exc)
        return out
    out["writer"] = type(w).__name__
    from torch.utils.tensorboard import SummaryWriter

    names = [n for n in dir(SummaryWriter) if not n.startswith("_") and callable(getattr(SummaryWriter, n))]
    out["writer_methods_missing"] = [n for n in names if not callable(getattr(w, n, None))]
    w.add_scalar("loss", 1.0, 0)
    w.add_scalars("pair", {"a": 1.0, "b": 2.0}, 0)
    w.flush()
    w.close()
    ctx.barrier()
    out["event_files"] = sorted(p.name.split(".")[0] for p in Path(log_dir).rglob("events.out.tfevents.*"))
    return out


@distributed(nprocs=2, seed=0, precision="bf16")
def _loop_job(cfg, ctx):
    messages: list[str] = []
    sink = logger.add(messages.append, format="{message}",
                      filter=lambda r: "sync_batchnorm" in r["message"] or "quiet:" in r["message"])
    out = {"rank": ctx.rank, "precision": ctx.precision}
    out["accumulation"] = _accumulation(ctx)
    out["bf16"] = _bf16(ctx)
    bn = ctx.wrap(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), sync_batchnorm=True)
    bn(torch.randn(6, 4)).sum().backward()  # trains on CPU: per-rank BatchNorm kept
    out["sync_bn_modules"] = sorted({type(m).__name__ for m in ctx.unwrap(bn).modules()})
    out.update(_progress_and_writer(ctx, cfg))
    logger.remove(sink)
    out["messages"] = messages
    return ctx.gather_object(out)


def test_loop_helpers_on_two_ranks(tmp_path: Path) -> None:
    r0, r1 = _loop_job(str(tmp_path / "tb"))
    assert r0["precision"] == r1["precision"] == "bf16"

    # Accumulation: only the last micro-batch of each window all-reduces (1 bucket) and steps.
    for r in (r0, r1):
        acc = r["accumulation"]
        assert acc["per_micro"] == [0, 0, 0, 1] * 2
        assert acc["stepped"] == [False, False, False, True] * 2
        assert acc["max_diff"] < 1e-12  # equal to one big-batch step per window
        assert acc["syncs"] == [False, True, True] * 2  # the epoch's last batch closes a short window
        assert acc["loader_calls"] == [0, 1, 1] * 2
        assert acc["steps"] == [2, 4]

    # bf16 autocast on CPU: bf16 activations, fp32 weights and gradients, DDP keeps ranks identical.
    for r in (r0, r1):
        b = r["bf16"]
        assert b["out"] == "torch.bfloat16" and b["plain"] == "torch.float32"
        assert b["grads"] == ["torch.float32"] and b["params"] == ["torch.float32"]
        assert b["changed"] and b["zeroed"]
    assert r0["bf16"]["weights"] == r1["bf16"]["weights"]
    assert r0["bf16"]["mean_loss"] == r1["bf16"]["mean_loss"]

    # SyncBatchNorm cannot train on CPU: BatchNorm is kept and rank 0 says so once.
    assert r0["sync_bn_modules"] == r1["sync_bn_modules"] == ["BatchNorm1d", "Linear", "Sequential"]
    assert sum("sync_batchnorm=True is ignored on CPU" in m for m in r0["messages"]) == 1
    assert not any("sync_batchnorm" in m for m in r1["messages"])

    # Progress: a bar with the running mean on rank 0 only; silent off a terminal, with a summary line.
    assert "epoch 1" in r0["bar_text"] and "5/5" in r0["bar_text"] and "loss=2" in r0["bar_text"]
    assert r0["bar_visible"] and r0["bar_means"] == {"loss": 2.0} and r0["len"] == 5
    assert r1["bar_text"] == "" and not r1["bar_visible"] and r1["bar_means"] == {}
    assert not r0["quiet_visible"] and not r1["quiet_visible"]
    assert any("quiet: 3 iterations, mean loss=1.5" in m for m in r0["messages"])
    assert not any("quiet:" in m for m in r1["messages"])

    # Writer: a real SummaryWriter on rank 0, a no-op with the same methods on rank 1 (one event file).
    if HAS_TENSORBOARD:
        assert r0["writer"] == "SummaryWriter" and r1["writer"] == "NullWriter"
        assert r1["writer_methods_missing"] == []
        assert r0["event_files"] == r1["event_files"] == ["events"] * 3  # main + 2 add_scalars runs, rank 0's
    else:
        assert "distfn[tensorboard]" in r0["writer_error"] and "distfn[tensorboard]" in r1["writer_error"]


# -- logging and threads: real scripts, stderr captured -----------------------------------------------------
def _logs_run(tmp_path: Path, name: str, **env: str) -> tuple[list[int], str, str]:
    sink = tmp_path / f"{name}.log"
    inherited = ("DISTFN_LOG_RANKS", "DISTFN_LOG_LEVEL", "OMP_NUM_THREADS")  # only what this run sets
    environment = {k: v for k, v in clean_env(**env).items() if k not in inherited or k in env}
    proc = run_python([str(SCRIPTS / "logs_job.py"), str(sink)], env=environment)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, sink.read_text()


def test_logging_levels_ranks_user_sinks_and_thread_sizing(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    threads, err, user = _logs_run(tmp_path, "default", OMP_NUM_THREADS="2")
    assert threads == [min(2, cpus)] * 2  # OMP_NUM_THREADS wins (torch caps it at the core count)
    assert "info from rank 0" in err and "info from rank 1" not in err
    assert "warning from rank 0" in err and "warning from rank 1" in err
    assert "debug from rank" not in err
    assert any("launcher: spawn" in line and "(OMP_NUM_THREADS=2)" in line for line in err.splitlines())
    assert any("rank 1/2" in line and "warning from rank 1" in line for line in err.splitlines())
    for rank in (0, 1):  # the user's own sink is kept and sees everything it asked for
        assert f"debug from rank {rank}" in user and f"info from rank {rank}" in user

    threads, err, _ = _logs_run(tmp_path, "all", DISTFN_LOG_RANKS="all", DISTFN_LOG_LEVEL="TRACE")
    assert threads == [max(1, cpus // 2)] * 2  # OMP_NUM_THREADS unset: the cores are split between the ranks
    assert "info from rank 1" in err and "debug from rank 1" in err
    sized = [line for line in err.splitlines() if "CPU thread(s) per process" in line]
    assert len(sized) == 1 and "rank 0/2" in sized[0]  # rank 0's start-up line says how the cores were split
    assert f"{max(1, cpus // 2)} CPU thread(s) per process ({cpus} CPUs / 2 processes on this node)" in sized[0]


# -- in this process ------------------------------------------------------------------------------------------
def test_fp16_uses_a_grad_scaler_and_skips_overflowing_steps() -> None:
    @distributed(mode="single", precision=16)
    def job(cfg, ctx):
        model = nn.Linear(4, 1)
        nn.init.zeros_(model.bias)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4) * 0.1  # small enough that 65536 x the gradients stays finite in fp16
        with ctx.autocast():
            out = model(x)
        loss = out.float().pow(2).mean()
        expected = torch.autograd.grad(model(x).pow(2).mean(), model.weight)[0]
        ctx.backward(loss)
        scale = ctx._loop_state().scaler.get_scale()
        scaled = model.weight.grad.clone()
        w0 = model.weight.detach().clone()
        assert ctx.step(opt)
        update = (w0 - model.weight.detach()) / 0.1
        # An overflowing gradient: the scaler skips the step and halves its scale.
        model.weight.grad = torch.full_like(model.weight, float("inf"))
        w1 = model.weight.detach().clone()
        ctx.step(opt, zero_grad=False)
        return (ctx.precision, str(out.dtype), scale, scaled, expected, update, torch.equal(w1, model.weight),
                ctx._loop_state().scaler.get_scale())

    precision, dtype, scale, scaled, expected, update, skipped, new_scale = job()
    assert precision == "16" and dtype == "torch.float16" and scale == 65536.0
    assert torch.allclose(scaled / scale, expected, rtol=1e-2, atol=1e-3)
    assert torch.allclose(update, expected, rtol=1e-2, atol=1e-3)  # the step used unscaled gradients
    assert skipped and new_scale == scale / 2


def test_dp_mode_loss_inside_forward_and_reduce_loss() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):  # the seeds' recipe: the loss computed on each replica
            return F.mse_loss(self.lin(x), y)

    @distributed(mode="dp", seed=1)
    def job(cfg, ctx):
        model = ctx.wrap(WithLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        losses = []
        for _ in range(3):
            loss = ctx.reduce_loss(model(x, x.sum(1, keepdim=True)))
            ctx.backward(loss)
            ctx.step(opt)
            losses.append(loss.item())
        with pytest.raises(ConfigError, match="reduce_loss"):
            ctx.backward(torch.tensor([1.0, 2.0], requires_grad=True))
        return type(model).__name__, losses, ctx.reduce_loss(torch.tensor([1.0, 3.0])).item()

    wrapper, losses, mean = job()
    assert wrapper == "DataParallel"
    assert losses[2] < losses[0]
    assert mean == 2.0
    assert loop.reduce_loss(torch.tensor(4.0)).item() == 4.0


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


def test_argument_checks() -> None:
    with pytest.raises(ConfigError, match="precision='fp8'"):
        distributed(precision="fp8")
    assert distributed(precision=16)(lambda cfg, ctx: None).distfn_options.precision == "16"
    assert distributed(precision="bf16")(lambda cfg, ctx: None).distfn_options.precision == "bf16"
    assert distributed(lambda cfg, ctx: None).distfn_options.precision == "32"
    with pytest.raises(ConfigError, match="positive int"):
        loop.Accumulator(nn.Linear(1, 1), 0)
    with pytest.raises(ConfigError, match="optimizer"):
        loop.step(loop.LoopState())
    with pytest.raises(ConfigError, match="reduce_loss expects a tensor"):
        loop.reduce_loss(1.0)


def test_null_writer_and_missing_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    if HAS_TENSORBOARD:
        assert isinstance(loop.writer(False, "runs/x"), loop.NullWriter)
    null = loop.NullWriter("runs/x")
    assert null.add_scalar("a", 1.0) is None and null.add_anything_new() is None and null.get_logdir() == "runs/x"
    with null as same:
        same.flush()
    with pytest.raises(AttributeError):
        null.not_a_writer_method  # noqa: B018
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"distfn\[tensorboard\]"):
        loop.writer(True, "runs/x")
