"""GPU visibility, device choice and the GPU-sharing rule (distfn.devices), with CUDA faked: the logic must be
right where GPUs exist."""

from __future__ import annotations

import os

import pytest
import torch

from distfn import DistfnError, LauncherError
from distfn.devices import (
    apply_visible_devices,
    check_devices,
    collective_device,
    counts_without_driver,
    default_backend,
    select_device,
)
from distfn.topology import Topology


def _topo(local_rank: int, local_world: int, launcher: str = "torchrun", node_rank: int = 0,
          num_nodes: int = 1) -> Topology:
    world = local_world * num_nodes
    return Topology(launcher=launcher, rank=node_rank * local_world + local_rank, local_rank=local_rank,
                    world_size=world, local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
                    master_addr="127.0.0.1", master_port=29500, reason="test")


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


def test_check_devices() -> None:
    t = _topo(1, 2, launcher="slurm", node_rank=1, num_nodes=2)
    check_devices(t, 0)  # CPU run: nothing to check
    check_devices(t, 2)
    check_devices(t, 8)
    with pytest.raises(LauncherError) as err:
        check_devices(t, 1, env={"CUDA_VISIBLE_DEVICES": "3"})
    msg = str(err.value)
    assert "2 ranks on node 1" in msg and "only 1 visible GPU" in msg and "CUDA_VISIBLE_DEVICES='3'" in msg
    assert "--ntasks-per-node=1" in msg and "--gpus-per-task=1" in msg
    assert "allow" not in msg  # no option lets NCCL ranks share a GPU: the message must not suggest one
    # srun --gpus-per-task=1: every task sees its own single GPU
    check_devices(t, 1, env={"SLURM_STEP_GPUS": "1", "CUDA_VISIBLE_DEVICES": "1"})


def test_default_backend() -> None:
    assert default_backend(torch.device("cuda", 1)) == "nccl"
    assert default_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize(("backend", "expected"), [
    (None, None),  # no process group
    ("gloo", None), ("mpi", None), ("ucc", None),
    ("nccl", "cuda:1"), ("NCCL", "cuda:1"), ("cuda:nccl", "cuda:1"),  # NCCL alone takes no CPU tensors
    ("cuda:nccl,cpu:gloo", None), ("cpu:gloo,cuda:nccl", None),  # the CPU half serves Python numbers
])
def test_collective_device(backend: str | None, expected: str | None) -> None:
    got = collective_device(backend, torch.device("cuda", 1))
    assert got == (None if expected is None else torch.device(expected))


# -- issue 20: the GPU paths, with CUDA faked ---------------------------------------------------------------
def test_slurm_step_gpus_exempts_only_a_task_that_sees_one_gpu() -> None:
    """--ntasks-per-node=4 --gpus-per-node=2: Slurm sets SLURM_STEP_GPUS, but each task sees both GPUs."""
    t = _topo(3, 4, launcher="slurm")
    with pytest.raises(LauncherError, match="4 ranks on node 0"):
        check_devices(t, 2, env={"SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"})
    check_devices(t, 1, env={"SLURM_STEP_GPUS": "1", "CUDA_VISIBLE_DEVICES": "1"})  # --gpus-per-task=1


def test_gpus_that_cuda_cannot_start_are_an_error_not_a_cpu_run(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML counts 2 GPUs, CUDA cannot start (a fork after CuPy/JAX started the driver): no silent CPU run."""
    import warnings

    def unavailable() -> bool:
        warnings.warn("CUDA initialization: unexpected error from cudaGetDeviceCount()", UserWarning, stacklevel=1)
        return False

    gpus(2)
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    with pytest.raises(DistfnError) as err:
        select_device("ddp", _topo(0, 2), None)
    msg = str(err.value)
    assert "NVML sees 2 GPU(s)" in msg and "cudaGetDeviceCount" in msg
    assert "start_method='spawn'" in msg and "CUDA_VISIBLE_DEVICES=''" in msg


def test_counting_gpus_without_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    assert counts_without_driver()
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # MIG UUIDs, no libnvidia-ml
    assert not counts_without_driver()
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build never calls the driver
    assert counts_without_driver()


def test_devices_use_nvidia_smi_numbering(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    apply_visible_devices((1, 0))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0" and os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # the user's explicit choice stays
    apply_visible_devices((0,))
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_the_fork_probe_does_not_blame_the_user_when_nvml_cannot_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML failed, so distfn's own GPU count called the CUDA driver: the reason says so."""
    from distfn import preflight

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # MIG UUIDs, or no libnvidia-ml
    monkeypatch.setattr(preflight, "BASELINE_THREADS", preflight.thread_ids())
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # the child sees the driver call
    method, reason = preflight.choose_start_method("auto")
    assert method != "fork" and "NVML cannot count the GPUs here" in reason
    assert "torch.cuda.is_available()" not in reason  # the user did not call it
