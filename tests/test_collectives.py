"""distfn.collectives: object collectives on 2 ranks with the declared dependencies (NumPy) and no start-up
warning; the NCCL barrier pinned to the rank's own GPU (CUDA faked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distfn import collectives

from conftest import run_python

_JOB = """
import sys, torch
from distfn import distributed

@distributed(mode=sys.argv[1], nprocs=2, seed=0)
def job(cfg, ctx):
    loader = ctx.dataloader(torch.utils.data.TensorDataset(torch.arange(5)), 2, shuffle=False)
    rows = torch.cat([ctx.gather_for_metrics(x) for (x,) in loader]).tolist()
    if mode == "fsdp":
        ctx.wrap(torch.nn.Linear(4, 4))
    return ctx.gather_object(ctx.rank), ctx.broadcast_object({"from": ctx.rank}, src=1), rows

if __name__ == "__main__":
    mode = sys.argv[1]
    print("RESULT", job())
"""


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_object_collectives_work_without_a_numpy_warning(tmp_path: Path, mode: str) -> None:
    # torch's object collectives call tensor.numpy(): NumPy is a declared dependency, so they work and torch
    # prints no "Failed to initialize NumPy" at start (issue 11).
    script = tmp_path / "objects.py"
    script.write_text(_JOB)
    done = run_python([str(script), mode], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT ([0, 1], {'from': 1}, [0, 1, 2, 3, 4])" in done.stdout
    assert "NumPy" not in done.stderr and "numpy" not in done.stderr


def test_barrier_on_nccl_uses_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    for backend in ("nccl", "cuda:nccl,cpu:gloo"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        collectives.barrier(torch.device("cuda", 3))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    collectives.barrier(torch.device("cpu"))
    collectives.barrier()
    # NCCL's barrier is an all-reduce on a GPU: without device_ids torch picks global_rank % local GPUs.
    assert calls == [{"device_ids": [3]}, {"device_ids": [3]}, {}, {}]
