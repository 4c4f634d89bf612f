"""Collectives that accept tensors and plain Python values, and are identities without a process group.

Every function here takes the world explicitly through ``torch.distributed``'s default group; when no group
is initialised (``mode="single"``/``"dp"``, or a world of one) each is an identity, so user code never needs
an ``if distributed:`` branch. Each collective is noted in this process's ledger (`distfn.ledger`: number,
name, caller's line), which the hang report reads, also when it is called outside a run (a plain script, the
checkpoint library's own calls). Nothing else here keeps state: inside a run, the `Context` method (or the
checkpoint policy) that calls these wraps the call in the run's one hook, `distfn.run.Run.collective` (the sync
point, the ledger entry under the method's name, the step's comm time); the entry made here is then nested in
that one and not recorded twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeVar

import torch
import torch.distributed as dist

from .errors import ConfigError
from .ledger import LEDGER

T = TypeVar("T")

REDUCE_OPS = ("mean", "sum", "max", "min")
#: where Python numbers travel by default; a device object, not the string "cpu", which torch parses on every call
#: (measured: 2 µs of a 5 µs `torch.tensor`), and not ``None``, which would follow `torch.set_default_device`
_CPU: Final = torch.device("cpu")

def active() -> bool:
    """True when a default process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


#: ``(default group, its size)`` as last read by `world_size`.
_world: tuple[Any, int] = (None, 0)


def world_size() -> int:
    """The default process group's size (with one active). Remembered per group object: every collective of a
    Python number divides by it, and `dist.get_world_size` costs 1.1 µs a call against 0.1 µs for reading the
    group (bench/bench_collectives.py); a group destroyed and made anew is a new object, so it is read again."""
    global _world
    group = dist.GroupMember.WORLD
    if group is not _world[0]:
        _world = (group, dist.get_world_size())
    return _world[1]


def barrier(device: torch.device | None = None) -> None:
    """Block until every rank reaches this point (no-op without a process group).

    Args:
        device: this rank's device. On an NCCL group NCCL's barrier is an all-reduce on a GPU; without
            `device_ids` torch picks `global_rank % local_device_count`, a GPU this rank may not own (it opens a
            context there, or fails with "Duplicate GPU" when ranks are not numbered node by node).
    """
    if not active():
        return
    with LEDGER.entered("barrier"):
        if device is not None and device.type == "cuda" and "nccl" in str(dist.get_backend()).lower():
            dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
        else:
            dist.barrier()


#: distfn's op names to torch's (the mean is a sum divided by the world size afterwards).
_TORCH_OPS: Final[dict[str, Any]] = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                     "min": dist.ReduceOp.MIN}

Number = bool | int | float


def _reduce_op(op: str) -> Any:
    try:
        return _TORCH_OPS[op]
    except KeyError:
        raise ConfigError(f"all_reduce op={op!r} is not supported; use one of {', '.join(REDUCE_OPS)}") from None


def all_reduce(value: T, op: str = "mean", *, device: torch.device | None = None, group: Any = None) -> T:
    """Reduce ``value`` over all ranks and return the result; the input is not modified.

    ``value`` is a tensor (any shape; integer tensors are promoted to float for ``"mean"``), a Python
    ``int``/``float``/``bool`` (returned as ``float`` for ``"mean"``, else as the input's type), or a dict of
    Python numbers (what a loop logs: ``{"loss": 0.31, "acc": 0.9}``), reduced key by key in **one** collective
    and returned as a new dict with each value typed as above. Every rank passes the same keys in the same order
    (the same code builds the dict): the values travel as one tensor, matched by position.
    ``device`` is where Python numbers travel (must be a CUDA device for NCCL); defaults to CPU. ``group``: a
    process group to reduce over instead of the world (the data-parallel ranks of a tensor-parallel mesh).
    """
    torch_op = _reduce_op(op)
    if isinstance(value, torch.Tensor):
        return _reduce_tensor(value, op, torch_op, group)  # type: ignore[return-value]
    if isinstance(value, (bool, int, float)):
        return _reduce_number(value, op, torch_op, device, group)  # type: ignore[return-value]
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(item, (bool, int, float)):
                raise ConfigError(
                    f"all_reduce of a dict takes Python numbers as values, got {type(item).__name__} for key "
                    f"{key!r}; pass a number (e.g. loss.item()) or reduce that tensor in a call of its own"
                )
        return dict(zip(value, _reduce_numbers(tuple(value.values()), op, torch_op, device, group),
                        strict=True))  # type: ignore[return-value]
    raise ConfigError(
        f"all_reduce takes a tensor, a Python number or a dict of Python numbers, got {type(value).__name__}; "
        "for arbitrary objects use gather_object"
    )


def _size(group: Any) -> int:
    return world_size() if group is None else dist.get_world_size(group)


def _reduce_tensor(value: torch.Tensor, op: str, torch_op: Any, group: Any = None) -> torch.Tensor:
    out = value.detach().clone()
    if op == "mean" and not (out.is_floating_point() or out.is_complex()):
        out = out.to(torch.float64)
    if active():
        with LEDGER.entered("all_reduce"):
            dist.all_reduce(out, op=torch_op, group=group)
        if op == "mean":
            out /= _size(group)
    return out


def _typed(value: Number, reduced: float, op: str) -> Number:
    """``reduced`` typed as `all_reduce` types the result for ``value``: a float for the mean, else its type."""
    return reduced if op == "mean" else type(value)(reduced)


def _reduce_number(value: Number, op: str, torch_op: Any, device: torch.device | None, group: Any = None) -> Number:
    """One Python number: `_reduce_numbers` of one value, in a 0-d tensor read back with ``.item()`` (the raw
    round trip a number needs, without the 1-element list and the list back: measured 1 µs less per call)."""
    if not active():
        return _typed(value, float(value), op)
    # scalar_tensor, not tensor: it skips the nested-sequence parsing (measured 1.7 vs 3.8 µs a call)
    t = torch.scalar_tensor(float(value), dtype=torch.float64, device=device or _CPU)
    with LEDGER.entered("all_reduce"):  # .item() included: under NCCL that is where the rank waits
        dist.all_reduce(t, op=torch_op, group=group)
        reduced = t.item()
    if op == "mean":
        reduced /= _size(group)
    return _typed(value, reduced, op)


def _reduce_numbers(values: tuple[Number, ...], op: str, torch_op: Any, device: torch.device | None,
                    group: Any = None) -> list[Number]:
    """``values`` reduced over all ranks in one collective of a float64 tensor, each typed as `all_reduce` says.

    The numbers travel in a tensor this function made, so it is reduced in place (no copy), and the mean is
    divided in Python (float64 either way: the same result as a division of the tensor, without a tensor op).
    """
    if not active():
        return [_typed(v, float(v), op) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device or _CPU)
    with LEDGER.entered("all_reduce"):  # .tolist() included: under NCCL that is where the rank waits
        dist.all_reduce(t, op=torch_op, group=group)
        reduced = t.tolist()
    if op == "mean":
        world = _size(group)
        return [r / world for r in reduced]
    return [_typed(v, r, op) for v, r in zip(values, reduced, strict=True)]


def on_rank_device() -> contextlib.AbstractContextManager[Any]:
    """The rank's GPU as the calling thread's current device, around an object collective (issue 42, finding 5).

    torch's object collectives move the pickle to ``_get_object_coll_device(group)``, a device *type* ("cuda"),
    which resolves to the calling thread's current device (torch/distributed/distributed_c10d.py:3500 in
    all_gather_object, 4012 in broadcast_object_list, then ``.to(device)`` at 3410);
    ``torch.cuda.set_device`` in the worker holds for the main thread only, so from another thread (a background
    save, a user's thread) that would be cuda:0, another rank's GPU. The rank's device is the one bound to the
    default group (``device_id=`` at init, `distfn.rendezvous`); without one (CPU, or no CUDA binding) nothing is
    entered."""
    bound = getattr(dist.GroupMember.WORLD, "bound_device_id", None)
    if bound is None or bound.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(bound)


def gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` as a list indexed by rank, on every rank (objects must be picklable).

    Args:
        obj: this rank's value.
        group: a process group to run on instead of the default one (e.g. the gloo group of background
            checkpoint saves), which may run in another thread.
    """
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with LEDGER.entered("gather_object"), on_rank_device():
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (other ranks' arguments are ignored).

    Args:
        obj: the value (read on ``src`` only).
        src: the global rank whose value everyone gets.
        group: as in `gather_object`.
    """
    if not active():
        return obj
    box = [obj]
    with LEDGER.entered("broadcast_object"), on_rank_device():
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_rows(
    leaves: Sequence[torch.Tensor], positions: torch.Tensor | None = None, *, device: torch.device | None = None,
    group: Any = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every rank's rows of each tensor in ``leaves``, concatenated in rank order, on every rank (the collective
    behind ``gather_for_metrics``, recorded in the ledger under that name).

    Within a rank the tensors share their row count (the first dimension); across ranks it may differ (the last
    batch of an epoch), the other dimensions and the dtypes may not. ``positions`` (int64, one per row: the rows'
    sampler positions) travel with the rows; the gathered positions come back only when every rank sent some.
    ``device``: where the tensors travel (CUDA for NCCL); the results come back on each input's device. ``group``:
    the ranks to gather from instead of the world (the data-parallel ranks of a tensor-parallel mesh, whose tp
    groups hold the same rows).

    Tensors only, no pickling: one ``all_gather_single`` of every rank's (row count, has positions), then one
    per tensor of rows padded to the longest count, which is no padding at all when the counts agree (measured
    at 2 gloo ranks: the object exchange of the counts that this replaces cost 2 collectives and a pickle each
    way, about a third of the call).
    """
    if not active():
        return list(leaves), positions
    world = world_size() if group is None else dist.get_world_size(group)
    with LEDGER.entered("gather_for_metrics"):
        mine = torch.tensor([leaves[0].shape[0], positions is not None], dtype=torch.int64, device=device or _CPU)
        counts = mine.new_empty(2 * world)
        dist.all_gather_single(counts, mine, group=group)
        sizes, flags = counts[0::2].tolist(), counts[1::2].tolist()
        every = all(flags)
        tensors = [*leaves, positions] if every and positions is not None else list(leaves)
        gathered = [_gather_padded(t, sizes, device, world, group) for t in tensors]
    if every and positions is not None:
        return gathered[:-1], gathered[-1]
    return gathered, None


def _gather_padded(t: torch.Tensor, sizes: list[int], device: torch.device | None, world: int,
                   group: Any = None) -> torch.Tensor:
    """Every rank's rows of ``t`` (row counts ``sizes``) in rank order, via one ``all_gather_single`` of rows
    padded to the longest count, on ``device`` (``None``: where ``t`` is), back on ``t``'s device."""
    home, longest = t.device, max(sizes)
    if longest == 0:
        return t[:0]
    # detached: a model's output is in the autograd graph, and gloo copies the input into views of ``out`` made
    # without grad, which autograd refuses; gathered metrics never carry gradients (nor did they when pickled)
    rows = (t.detach() if device is None else t.detach().to(device)).contiguous()
    if rows.shape[0] != longest:
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        rows = padded
    out = rows.new_empty((world * longest, *rows.shape[1:]))
    dist.all_gather_single(out, rows, group=group)
    if any(n != longest for n in sizes):  # trim each rank's padding
        out = torch.cat([out[r * longest: r * longest + n] for r, n in enumerate(sizes)])
    return out.to(home)
