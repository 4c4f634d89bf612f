"""distfn.context: what `ctx` forwards where. Python numbers, `should_stop` and `gather_for_metrics` travel on the
rank's GPU whenever the group is NCCL alone, however the backend was spelled (CUDA faked: no collective runs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distfn import collectives, data, preemption
from distfn.context import Context


def _ctx(backend: str | None, device: torch.device) -> Context:
    return Context(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                   device=device, backend=backend, mode="ddp", launcher="spawn")


@pytest.mark.parametrize(("backend", "on_gpu"), [
    ("nccl", True), ("NCCL", True), ("cuda:nccl", True), ("cuda:NCCL", True),
    ("gloo", False), ("cuda:nccl,cpu:gloo", False), (None, False),
])
def test_numbers_travel_on_the_gpu_only_when_the_group_is_nccl_alone(
    monkeypatch: pytest.MonkeyPatch, backend: str | None, on_gpu: bool
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(collectives, "all_reduce",
                        lambda value, op="mean", device=None: seen.setdefault("reduce", device))
    monkeypatch.setattr(collectives, "barrier", lambda device=None: seen.setdefault("barrier", device))
    monkeypatch.setattr(preemption.StopSignals, "should_stop",
                        lambda self, device=None: seen.setdefault("stop", device))
    monkeypatch.setattr(data, "gather_for_metrics", lambda v, loader, device=None: seen.setdefault("gather", device))
    gpu = torch.device("cuda", 1)
    ctx = _ctx(backend, gpu)
    ctx.all_reduce(1.0)
    ctx.should_stop  # noqa: B018 - a property that makes a collective
    ctx.gather_for_metrics(torch.zeros(2))
    ctx.barrier()
    expected = gpu if on_gpu else None
    assert seen == {"reduce": expected, "stop": expected, "gather": expected, "barrier": gpu}


def test_the_collective_device_is_worked_out_once_and_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective of a Python number asks where it travels; the answer is worked out once per (backend,
    device), not at every call, and a context whose backend changes gets the new answer."""
    from distfn import context as context_module

    asked: list[tuple[Any, Any]] = []
    real = context_module.collective_device

    def counting(backend: Any, device: Any) -> Any:
        asked.append((backend, device))
        return real(backend, device)

    monkeypatch.setattr(context_module, "collective_device", counting)
    ctx = Context(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                  device=torch.device("cuda", 1), backend="nccl", mode="ddp", launcher="spawn")
    assert [ctx._group_device for _ in range(5)] == [torch.device("cuda", 1)] * 5  # NCCL: numbers on the GPU
    assert len(asked) == 1
    ctx.backend = "gloo"
    assert ctx._group_device is None  # gloo takes CPU tensors
    assert len(asked) == 2
