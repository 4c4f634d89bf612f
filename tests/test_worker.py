"""Device selection per rank, with CUDA faked (the logic must be right where GPUs exist)."""

from __future__ import annotations

import pytest
import torch

import distfn
from distfn import LauncherError
from distfn.topology import Topology
from distfn.worker import select_device


def _topo(local_rank: int, local_world: int, launcher: str = "torchrun") -> Topology:
    return Topology(launcher=launcher, rank=local_rank, local_rank=local_rank, world_size=local_world,
                    local_world_size=local_world, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                    master_port=29500, reason="test")


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


def test_cpu_without_cuda(gpus) -> None:
    gpus(0)
    assert select_device("ddp", _topo(1, 2), None) == torch.device("cpu")


def test_rank_uses_local_rank_modulo_device_count(gpus) -> None:
    gpus(4)
    assert [select_device("ddp", _topo(r, 4), None) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    gpus(2)
    assert select_device("ddp", _topo(3, 4), "gloo") == torch.device("cuda", 1)  # gloo may share GPUs


def test_nccl_refuses_more_ranks_than_gpus(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(1)
    monkeypatch.delenv("SLURM_STEP_GPUS", raising=False)
    for backend in (None, "nccl", "cpu:gloo,cuda:nccl"):  # None: NCCL is the default on GPUs
        with pytest.raises(LauncherError, match="2 ranks on node 0"):
            select_device("ddp", _topo(1, 2), backend)


def test_slurm_gpu_per_task_binding_is_accepted(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """srun --gpus-per-task=1: each task sees only its own GPU, so device 0 is right for every task."""
    gpus(1)
    monkeypatch.setenv("SLURM_STEP_GPUS", "1")
    assert select_device("ddp", _topo(1, 2, launcher="slurm"), None) == torch.device("cuda", 0)


def test_dp_uses_device_zero(gpus) -> None:
    gpus(4)
    assert select_device("dp", _topo(0, 1), None) == torch.device("cuda", 0)


# -- fork safety on CUDA builds (faked: the child of the probe inherits the patched functions) -----------------
def test_fork_refused_after_a_cuda_driver_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from distfn import spawn

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(spawn, "_BASELINE_THREADS", spawn._thread_ids())
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # what a child sees after is_available()
    method, reason = spawn.choose_start_method("auto")
    assert method == "spawn" and "torch.cuda.is_available()" in reason and "device_count" in reason
    with pytest.raises(distfn.ConfigError, match="start_method='fork' cannot work here"):
        spawn.choose_start_method("fork")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)  # only NVML was asked: fork is fine
    assert spawn.choose_start_method("auto")[0] == "fork"
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no GPU: nothing for the mark to break
    assert spawn.choose_start_method("auto")[0] == "fork"
