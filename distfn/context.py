"""``Context``: what the user's function gets as ``ctx``.

It holds facts about this rank (frozen after start-up) and thin methods that forward to the modules that do the
work (``collectives``, ``checkpoint``), so each piece can be tested on its own.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import attrs
import torch
from torch import nn

from . import collectives
from .errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.data import Dataset, DistributedSampler


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under any DDP / DataParallel / FSDP-less / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


@attrs.define(eq=False)
class Context:
    """Everything one rank knows about the run, handed to the decorated function as ``ctx``.

    Attributes:
        rank: global rank of this process, ``0 .. world_size-1``.
        local_rank: rank among the processes on this node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, ``0 .. num_nodes-1``.
        num_nodes: number of nodes in the job.
        device: the device this rank computes on (``cuda:N`` or ``cpu``).
        backend: the process group backend (``"gloo"``, ``"nccl"``, ...), or ``None`` without a process group.
        mode: ``"ddp"``, ``"dp"`` or ``"single"``.
        launcher: who started this process: ``"spawn"`` (distfn), ``"torchrun"``, ``"slurm"``, ``"mpi"``,
            or ``"local"`` (one process run in place, no launcher).
        seed: the seed every rank was seeded with, or ``None``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str | None
    mode: str
    launcher: str
    seed: int | None = None
    log: Any = attrs.field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that saves, prints and logs INFO."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (``mode="ddp"``); collectives are identities otherwise."""
        return collectives.active()

    # -- data ---------------------------------------------------------------------------------------------
    def sampler(
        self, dataset: Dataset, shuffle: bool = True, seed: int | None = None, drop_last: bool = False
    ) -> DistributedSampler:
        """A ``DistributedSampler`` giving this rank its share of ``dataset`` (works with a world of one).

        ``seed`` defaults to the run's seed (or 0), so every rank shuffles identically and the shares are
        disjoint. Call ``sampler.set_epoch(epoch)`` each epoch to reshuffle.
        """
        from torch.utils.data import DistributedSampler

        replicas, rank = (self.world_size, self.rank) if self.mode not in ("single", "dp") else (1, 0)
        return DistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=(self.seed or 0) if seed is None else seed,
            drop_last=drop_last,
        )

    # -- models -------------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, *, sync_batchnorm: bool = False, **ddp_kwargs: Any) -> nn.Module:
        """Move ``model`` to ``ctx.device`` and wrap it for the mode.

        ``"ddp"``: ``DistributedDataParallel`` (with ``device_ids`` on CUDA; ``find_unused_parameters`` and other
        DDP options pass through ``ddp_kwargs``); ``sync_batchnorm=True`` converts BatchNorm layers to
        SyncBatchNorm first. ``"dp"``: ``nn.DataParallel`` over the visible GPUs. ``"single"``: no wrapper.
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"ctx.wrap expects a torch.nn.Module, got {type(model).__name__}")
        if ddp_kwargs and self.mode != "ddp":
            raise ConfigError(f"DDP options {sorted(ddp_kwargs)} were given but mode={self.mode!r}")
        model = model.to(self.device)
        if self.mode == "ddp":
            if sync_batchnorm:
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            if self.device.type == "cuda":
                ddp_kwargs.setdefault("device_ids", [self.device.index])
                ddp_kwargs.setdefault("output_device", self.device.index)
            return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        if self.mode == "dp":
            return nn.DataParallel(model)
        return model

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare module (strips DDP, DataParallel and ``torch.compile`` wrappers)."""
        return unwrap(model)

    # -- collectives --------------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every rank gets here (a no-op without a process group)."""
        collectives.barrier()

    def all_reduce(self, value: Any, op: str = "mean") -> Any:
        """``value`` (tensor or Python number) reduced over all ranks with ``op``: mean, sum, max or min."""
        device = self.device if self.backend == "nccl" else None
        if isinstance(value, torch.Tensor) and self.backend == "nccl" and value.device.type != "cuda":
            return collectives.all_reduce(value.to(self.device), op).to(value.device)
        return collectives.all_reduce(value, op, device=device)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank, on every rank."""
        return collectives.gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank."""
        return collectives.broadcast_object(obj, src=src)

    # -- output -------------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (other ranks print nothing)."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(
        self,
        obj: nn.Module | Mapping[str, Any],
        path: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        keep: int | None = None,
    ) -> Path:
        """Write ``obj`` to ``path`` as safetensors from rank 0; other ranks return at once.

        ``obj`` is a module (bare, DDP, DP or compiled: saved with the bare module's key names), a flat
        ``{name: tensor}`` dict or a training-state mapping (see ``distfn.checkpoint``). Tensors are copied to the
        CPU one at a time; the live model never moves. There is **no collective** inside, so it is safe under
        ``if ctx.is_main:``; call ``ctx.barrier()`` afterwards if other ranks must read the file.
        Returns the path (on every rank).
        """
        from . import checkpoint

        if self.is_main:
            return checkpoint.save(obj, path, metadata=metadata, keep=keep)
        return Path(path)

    def load(
        self, path: str | os.PathLike[str], into: nn.Module | Mapping[str, Any], *, strict: bool = True
    ) -> dict[str, Any]:
        """Restore ``into`` (a module, or a mapping of modules/optimizers/schedulers/...) in place from ``path``
        on every rank, onto ``ctx.device``; returns the non-tensor values saved with it (``step``, ...)."""
        from . import checkpoint

        return checkpoint.load_into(path, into, device=self.device, strict=strict)
