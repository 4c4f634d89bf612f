"""distfn.collectives: object collectives on 2 ranks with the declared dependencies (NumPy) and no start-up
warning; the NCCL barrier pinned to the rank's own GPU (CUDA faked)."""

from __future__ import annotations

import sys
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


_DICT_JOB = """
from distfn import distributed
from distfn.ledger import LEDGER

@distributed(mode="ddp", nprocs=2, seed=0)
def job(cfg, ctx):
    metrics = {"loss": 1.0 + ctx.rank, "correct": 3 * (ctx.rank + 1), "finite": True}
    before = LEDGER.seq
    mean = ctx.all_reduce(metrics)  # DICT-LINE
    one_collective = LEDGER.seq - before == 1 and LEDGER.entries[-1].site.endswith(":9")
    return (mean, ctx.all_reduce(metrics, op="sum"), ctx.all_reduce(metrics, op="max"),
            ctx.all_reduce(0.5 + ctx.rank), ctx.all_reduce(ctx.rank + 1, op="sum"), one_collective, metrics)

if __name__ == "__main__":
    print("RESULT", job())
"""


def test_all_reduce_of_a_dict_of_numbers_is_one_collective_typed_per_key(tmp_path: Path) -> None:
    """Issue 32: what a loop logs (a dict of floats) is reduced in one collective, not one per key; each value
    comes back typed as a Python number's all_reduce types it (float for the mean, else the input's type), on
    every rank, and the ledger names the user's line."""
    script = tmp_path / "dict_job.py"
    script.write_text(_DICT_JOB)
    assert "DICT-LINE" in _DICT_JOB.splitlines()[8]  # the ":9" the job checks
    done = run_python([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    mean = {"loss": 1.5, "correct": 4.5, "finite": 1.0}
    total = {"loss": 3.0, "correct": 9, "finite": True}  # bool sum 2 -> True, as all_reduce(True, "sum") is
    top = {"loss": 2.0, "correct": 6, "finite": True}
    mine = {"loss": 1.0, "correct": 3, "finite": True}  # rank 0's input, unchanged
    assert f"RESULT ({mean!r}, {total!r}, {top!r}, 1.0, 3, True, {mine!r})" in done.stdout, done.stdout[-2000:]


def test_all_reduce_without_a_group_is_an_identity_with_the_documented_types() -> None:
    assert collectives.all_reduce(3) == 3.0 and isinstance(collectives.all_reduce(3), float)
    assert collectives.all_reduce(3, op="sum") == 3 and isinstance(collectives.all_reduce(3, op="max"), int)
    assert collectives.all_reduce(True, op="min") is True
    assert collectives.all_reduce({"a": 2, "b": 0.5}) == {"a": 2.0, "b": 0.5}
    assert collectives.all_reduce({"a": 2, "b": False}, op="sum") == {"a": 2, "b": False}
    assert collectives.all_reduce({}) == {}
    t = torch.tensor([1, 2])
    out = collectives.all_reduce(t)
    assert out.dtype == torch.float64 and out.tolist() == [1.0, 2.0] and out is not t


def test_all_reduce_refuses_what_it_cannot_reduce_naming_it() -> None:
    with pytest.raises(Exception, match=r"got Tensor for key 'loss'.*loss\.item\(\)"):
        collectives.all_reduce({"acc": 0.5, "loss": torch.tensor(1.0)})
    with pytest.raises(Exception, match="a tensor, a Python number or a dict of Python numbers, got str"):
        collectives.all_reduce("1.0")
    with pytest.raises(Exception, match="op='avg' is not supported; use one of mean, sum, max, min"):
        collectives.all_reduce(1.0, op="avg")


def test_a_python_number_is_one_ledger_entry_at_the_callers_line(tmp_path: Path) -> None:
    """The number path reduces the tensor it made in place under one ledger entry (not a nested tensor
    all-reduce), and the entry names the caller's line; checked in a one-rank gloo group in this process."""
    from distfn.ledger import Ledger

    book = Ledger()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        original, collectives.LEDGER = collectives.LEDGER, book  # type: ignore[misc]
        try:
            reduce = collectives.all_reduce
            line = sys._getframe().f_lineno + 1
            values = [reduce(2.5), reduce(7, op="sum"), reduce({"x": 1.5, "n": 2}, op="max"), reduce(torch.ones(2))]
        finally:
            collectives.LEDGER = original  # type: ignore[misc]
    finally:
        dist.destroy_process_group()
    assert values[:3] == [2.5, 7, {"x": 1.5, "n": 2}] and values[3].tolist() == [1.0, 1.0]
    assert [(e.seq, e.op, e.site) for e in book.entries] == [
        (i, "all_reduce", f"test_collectives.py:{line}") for i in (1, 2, 3, 4)]
    assert not book.state(0).inside


_ROWS_JOB = """
import torch, torch.distributed as dist
from distfn import collectives, distributed
from distfn.ledger import LEDGER

@distributed(mode="ddp", nprocs=2, seed=0)
def job(cfg, ctx):
    r = ctx.rank
    objects, pickled = [], dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: objects.append(a)  # the rows travel as tensors, never pickled
    n = 3 if r == 0 else 1  # uneven row counts, as in an epoch's last batch
    leaves = [torch.arange(n) + 10 * r, torch.full((n, 2), r == 0), torch.ones(n, 2, 2, dtype=torch.bfloat16) * r,
              torch.arange(2 * n, dtype=torch.float32).reshape(2, n).t()]  # not contiguous
    before = LEDGER.seq
    rows, positions = collectives.gather_rows(leaves, torch.arange(n) * 2 + r)  # ROWS-LINE
    entry = LEDGER.entries[-1]
    one_entry = LEDGER.seq - before == 1 and entry.op == "gather_for_metrics" and entry.site.endswith(":15")
    _, only_some = collectives.gather_rows(leaves[:1], torch.arange(n) if r == 0 else None)
    empty, _ = collectives.gather_rows([torch.zeros(0, 3)])
    equal, _ = collectives.gather_rows([torch.tensor([[r, r]])])
    outputs = torch.ones(n, 2, requires_grad=True) * (r + 1)  # a model's output: in the autograd graph
    graded, _ = collectives.gather_rows([outputs])
    dist.all_gather_object = pickled
    return ctx.gather_object(([t.tolist() for t in rows], [t.dtype for t in rows], positions.tolist(), only_some,
                              one_entry, tuple(empty[0].shape), equal[0].tolist(), objects,
                              graded[0].tolist(), graded[0].requires_grad))

if __name__ == "__main__":
    print("RESULT", job())
"""


def test_gather_rows_moves_uneven_rows_of_any_dtype_as_tensors_in_one_ledger_entry(tmp_path: Path) -> None:
    """Issue 32: gather_for_metrics' collective exchanges the row counts as a tensor (no object pickling, which
    cost two collectives and a pickle each way) and gathers each tensor padded to the longest count: uneven
    counts, bool / bfloat16 / non-contiguous tensors, zero rows, equal counts, a model's output that requires
    grad (gathered detached, as metrics are); positions come back only when
    every rank sent some; the ledger names it once, at the caller's line; every rank gets the same result."""
    script = tmp_path / "rows_job.py"
    script.write_text(_ROWS_JOB)
    assert "ROWS-LINE" in _ROWS_JOB.splitlines()[14]  # the ":15" the job checks
    done = run_python([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[0, 1, 2, 10], [[True, True]] * 3 + [[False, False]], [[[0.0] * 2] * 2] * 3 + [[[1.0] * 2] * 2],
            [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0], [0.0, 1.0]]]
    dtypes = [torch.int64, torch.bool, torch.bfloat16, torch.float32]
    one_rank = (rows, dtypes, [0, 2, 4, 1], None, True, (0, 3), [[0, 0], [1, 1]], [],
                [[1.0, 1.0]] * 3 + [[2.0, 2.0]], False)
    assert f"RESULT {[one_rank, one_rank]!r}" in done.stdout, done.stdout[-3000:]


_REGROUP = """
import sys, torch.distributed as dist, torch.multiprocessing as mp
from distfn import collectives

def worker(rank, tmp):
    # alone first: a group of one, then every rank in a new group of two
    dist.init_process_group("gloo", init_method=f"file://{tmp}/alone{rank}", rank=0, world_size=1)
    alone = (collectives.world_size(), collectives.all_reduce(3.0), collectives.all_reduce({"x": 3}, "sum"))
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/both", rank=rank, world_size=2)
    both = (collectives.world_size(), collectives.all_reduce(float(rank)), collectives.all_reduce({"x": rank}))
    dist.destroy_process_group()
    sys.stdout.write(f"RESULT {rank} {alone} {both}\\n")  # one write: both ranks share the pipe

if __name__ == "__main__":
    mp.start_processes(worker, args=(sys.argv[1],), nprocs=2, start_method="fork")
"""


def test_the_mean_divides_by_the_size_of_the_group_now_up(tmp_path: Path) -> None:
    # the group's size is remembered per group (collectives.world_size): a group destroyed and made anew with
    # another size must not leave a mean divided by the old one
    script = tmp_path / "regroup.py"
    script.write_text(_REGROUP)
    done = run_python([str(script), str(tmp_path)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"RESULT {rank} (1, 3.0, {{'x': 3}}) (2, 0.5, {{'x': 0.5}})" in done.stdout, done.stdout
