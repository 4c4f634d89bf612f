"""distfn.wrapping: `ctx.wrap` per mode; SyncBatchNorm on 2 CPU ranks (kept as BatchNorm, one warning)."""

from __future__ import annotations

import sys
import threading
from typing import ClassVar

import pytest
import torch
from loguru import logger
from torch import nn

from distfn import distributed


@distributed(nprocs=2, seed=0)
def _sync_bn_job(cfg, ctx):
    messages: list[str] = []
    sink = logger.add(messages.append, format="{message}", filter=lambda r: "sync_batchnorm" in r["message"])
    bn = ctx.wrap(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), sync_batchnorm=True)
    bn(torch.randn(6, 4)).sum().backward()  # trains on CPU: per-rank BatchNorm kept
    logger.remove(sink)
    return ctx.gather_object({"sync_bn_modules": sorted({type(m).__name__ for m in ctx.unwrap(bn).modules()}),
                              "messages": messages})


def test_sync_batchnorm_on_cpu_keeps_batchnorm_and_warns_once() -> None:
    r0, r1 = _sync_bn_job()
    # SyncBatchNorm cannot train on CPU: BatchNorm is kept and rank 0 says so once.
    assert r0["sync_bn_modules"] == r1["sync_bn_modules"] == ["BatchNorm1d", "Linear", "Sequential"]
    assert sum("sync_batchnorm=True is ignored on CPU" in m for m in r0["messages"]) == 1
    assert not any("sync_batchnorm" in m for m in r1["messages"])


class _CountsTo(nn.Sequential):
    """Records every `.to()` on the whole model."""

    calls: ClassVar[list] = []

    def to(self, *args, **kwargs):  # type: ignore[override]
        _CountsTo.calls.append((args, kwargs))
        return super().to(*args, **kwargs)


@distributed(mode="fsdp", nprocs=1, fsdp={"min_params": 10})
def _fsdp_wrap_job(cfg, ctx):
    _CountsTo.calls = []
    model = ctx.wrap(_CountsTo(nn.Linear(4, 8), nn.Linear(8, 2)))
    model(torch.randn(3, 4, device=ctx.device)).sum().backward()
    devices = {p.device.type for p in model.parameters()}
    return len(_CountsTo.calls), devices, ctx.device.type


def test_fsdp_wrap_leaves_moving_to_fully_shard() -> None:
    # fully_shard moves each unit to the device just before sharding it; a model.to(device) first would put the
    # whole model on every GPU (issue 20), and defeat cpu_offload.
    moves, devices, device = _fsdp_wrap_job()
    assert moves == 0
    assert devices == {device}


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def _threads_like_torch(modules, inputs, kwargs_tup, devices=None):
    """torch's parallel_apply on CPU: one thread per replica, autocast re-entered there without a dtype."""
    enabled = torch.is_autocast_enabled("cpu")
    results: list = [None] * len(modules)

    def work(i):
        with torch.amp.autocast("cpu", enabled=enabled):
            results[i] = modules[i](*inputs[i], **kwargs_tup[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_dp_replicas_compute_in_the_callers_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU stand-in for issue 20: the autocast dtype is per thread, and DataParallel's replica threads re-enter
    # autocast without one (CUDA's default is fp16, the CPU's bf16: fp16 here shows the same loss of the dtype).
    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "parallel_apply", _threads_like_torch)

    @distributed(mode="dp")
    def job(cfg, ctx):
        model = ctx.wrap(_Recorder())
        model.src_device_obj = torch.device("cpu")  # what DataParallel sets on GPUs
        x = torch.randn(3, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            outs = model.parallel_apply([model.module, model.module], [(x,), (x,)], [{}, {}])
        return [str(o.dtype) for o in outs]

    assert job() == ["torch.float16", "torch.float16"]
