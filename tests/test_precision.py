"""distfn.precision: bf16 autocast on 2 DDP ranks (CPU), fp16 with its GradScaler, DataParallel's per-GPU
losses and the argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distfn import ConfigError, distributed
from distfn.accumulation import Accumulator
from distfn.precision import LoopState, autocast, backward, reduce_loss, step


def _micro_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific data that any process can rebuild (for the big-batch reference)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(2, 4, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True) + 0.5


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
    changed = all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    return {"out": str(out.dtype), "plain": str(plain.dtype), "grads": sorted(grad_dtypes),
            "params": sorted({str(p.dtype) for p in net.parameters()}), "changed": changed,
            "zeroed": all(p.grad is None for p in net.parameters()),
            "weights": torch.cat([p.detach().flatten() for p in net.parameters()]).tolist(),
            "mean_loss": ctx.all_reduce(loss.detach().float()).item()}


@distributed(nprocs=2, seed=0, precision="bf16")
def _bf16_job(cfg, ctx):
    from loguru import logger

    told: list[str] = []
    sink = logger.add(told.append, filter=lambda r: "autocast runs" in r["message"], format="{message}")
    try:
        bf16 = _bf16(ctx)
        with ctx.autocast():  # a second autocast block: the line is not repeated
            pass
    finally:
        logger.remove(sink)
    return ctx.gather_object({"precision": ctx.precision, "bf16": bf16, "told": told})


def test_bf16_autocast_on_two_ranks() -> None:
    r0, r1 = _bf16_job()
    assert r0["precision"] == r1["precision"] == "bf16"
    # bf16 autocast on CPU: bf16 activations, fp32 weights and gradients, DDP keeps ranks identical.
    for r in (r0, r1):
        b = r["bf16"]
        assert b["out"] == "torch.bfloat16" and b["plain"] == "torch.float32"
        assert b["grads"] == ["torch.float32"] and b["params"] == ["torch.float32"]
        assert b["changed"] and b["zeroed"]
    assert r0["bf16"]["weights"] == r1["bf16"]["weights"]
    assert r0["bf16"]["mean_loss"] == r1["bf16"]["mean_loss"]
    # autocast on a CPU is said once, by rank 0 only, with what it means for the numbers.
    assert len(r0["told"]) == 1 and r1["told"] == []
    assert "precision='bf16': autocast runs matmuls and convolutions on the CPU in bfloat16" in r0["told"][0]
    assert "use precision='32'" in r0["told"][0]


def test_cpu_autocast_is_told_once_per_run_and_not_for_float32() -> None:
    from loguru import logger

    told: list[str] = []
    sink = logger.add(told.append, filter=lambda r: "autocast runs" in r["message"], format="{message}")
    logger.enable("distfn")  # distfn is quiet outside a job
    try:
        for precision in ("16", "32"):
            state = LoopState(precision=precision)
            for _ in range(3):
                with autocast(state):
                    pass
    finally:
        logger.disable("distfn")
        logger.remove(sink)
    assert len(told) == 1 and "precision='16': autocast runs matmuls and convolutions on the CPU in float16" in told[0]


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
        scale = ctx.scaler.get_scale()
        scaled = model.weight.grad.clone()
        w0 = model.weight.detach().clone()
        assert ctx.step(opt)
        update = (w0 - model.weight.detach()) / 0.1
        # An overflowing gradient: the scaler skips the step and halves its scale.
        model.weight.grad = torch.full_like(model.weight, float("inf"))
        w1 = model.weight.detach().clone()
        ctx.step(opt, zero_grad=False)
        return (ctx.precision, str(out.dtype), scale, scaled, expected, update, torch.equal(w1, model.weight),
                ctx.scaler.get_scale())

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
    assert reduce_loss(torch.tensor(4.0)).item() == 4.0


def test_argument_checks() -> None:
    with pytest.raises(ConfigError, match="precision='fp8'"):
        distributed(precision="fp8")
    assert distributed(precision=16)(lambda cfg, ctx: None).distfn_options.precision == "16"
    assert distributed(precision="bf16")(lambda cfg, ctx: None).distfn_options.precision == "bf16"
    assert distributed(lambda cfg, ctx: None).distfn_options.precision == "32"
    with pytest.raises(ConfigError, match="optimizer"):
        step(LoopState())
    with pytest.raises(ConfigError, match="reduce_loss expects a tensor"):
        reduce_loss(1.0)


def _fp16_steps(ctx, model, opt, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 4, generator=g) * 4  # the first scaled gradients overflow fp16
        with ctx.autocast():
            loss = model(x).float().pow(2).mean()
        ctx.backward(loss)
        ctx.step(opt)


def _fp16_run(path: str, steps: range, resume: bool) -> tuple[list[torch.Tensor], float]:
    @distributed(mode="single", seed=0, precision="16")
    def job(cfg, ctx):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        state = {"model": model, "optimizer": opt, "scaler": ctx.scaler}
        if resume:
            ctx.load(path, into=state)
        _fp16_steps(ctx, model, opt, steps)
        if not resume:
            ctx.save(state, path)
        return [p.detach().clone() for p in model.parameters()], ctx.scaler.get_scale()

    return job()


def test_fp16_resume_is_bit_exact_with_the_scaler_in_the_state(tmp_path) -> None:
    @distributed(mode="single", seed=0)
    def plain(cfg, ctx):
        return ctx.scaler

    assert plain() is None  # only precision="16" has a scaler
    path = str(tmp_path / "half.safetensors")
    straight, straight_scale = _fp16_run(str(tmp_path / "all.safetensors"), range(12), resume=False)
    _fp16_run(path, range(6), resume=False)
    resumed, resumed_scale = _fp16_run(path, range(6, 12), resume=True)
    assert straight_scale < 65536.0  # overflows happened: the scale is part of what must resume
    assert resumed_scale == straight_scale
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))


def _two_group_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """nanoGPT's optimizer shape: weight-decayed matrices in one param group, biases and norms in another, so the
    optimizer lists the parameters in another order than ``model.parameters()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}], lr=1e-2)
    return model, opt


def _clipped_run(how: str, precision: str) -> torch.Tensor:
    """8 steps clipped at 0.5 (the norms are ~10-100, so every step clips), by hand or through ``step``."""
    model, opt = _two_group_model()
    state = LoopState(precision=precision)
    hand_scaler = torch.amp.GradScaler("cpu") if precision == "16" else None
    if how == "tracked":
        state.track(model)
    elif how == "accumulate":
        acc = Accumulator(model, 1, state)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        loss = (model(torch.randn(32, 16, generator=g) * 10) ** 2).mean()
        if how == "hand":  # the idiom of every tutorial (and nanoGPT's fp16 path)
            (hand_scaler.scale(loss) if hand_scaler is not None else loss).backward()
            if hand_scaler is not None:
                hand_scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if hand_scaler is not None:
                hand_scaler.step(opt)
                hand_scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        elif how == "accumulate":
            with acc:
                backward(state, loss)
                assert step(state, opt, max_grad_norm=0.5)
        else:
            backward(state, loss)
            assert step(state, opt, max_grad_norm=0.5)
    if precision == "16":
        assert state.scaler is not None and state.scaler.get_scale() == 65536.0  # no step was skipped
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("precision", ["32", "16"])
def test_max_grad_norm_is_bit_identical_to_clip_grad_norm_of_the_model(precision: str) -> None:
    hand = _clipped_run("hand", precision)
    # The model ctx.wrap / ctx.accumulate saw sets the order: the same computation as the idiom, bit for bit
    # (fp16: unscaled first, by step itself).
    assert torch.equal(_clipped_run("tracked", precision), hand)
    assert torch.equal(_clipped_run("accumulate", precision), hand)
    # Without a known model the optimizers' order is used: the same clipping up to rounding.
    untracked = _clipped_run("untracked", precision)
    assert torch.allclose(untracked, hand, atol=1e-5)


def test_clip_order_follows_the_tracked_model_and_keeps_the_rest() -> None:
    model, opt = _two_group_model()
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    state = LoopState()
    assert state.clip_order((opt,)) == [p for group in opt.param_groups for p in group["params"]]
    state.track(model)
    state.track(model)  # once
    assert state.clip_order((opt,)) == [*model.parameters(), extra]


@distributed(mode="single", seed=0)
def _clip_through_ctx(cfg, ctx):
    model, opt = _two_group_model()
    model = ctx.wrap(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        ctx.backward((model(torch.randn(32, 16, generator=g) * 10) ** 2).mean())
        ctx.step(opt, max_grad_norm=0.5)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_ctx_step_clips_in_the_order_of_the_wrapped_model() -> None:
    assert torch.equal(_clip_through_ctx(), _clipped_run("hand", "32"))
