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
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.utils.data import Dataset, DistributedSampler

    from .data import DistributedLoader
    from .loop import Accumulator, Progress


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
        mode: ``"ddp"``, ``"fsdp"``, ``"dp"`` or ``"single"``.
        launcher: who started this process: ``"spawn"`` (distfn), ``"torchrun"``, ``"slurm"``, ``"mpi"``,
            or ``"local"`` (one process run in place, no launcher).
        seed: the seed every rank was seeded with, or ``None``.
        precision: ``"32"``, ``"bf16"`` or ``"16"`` (``@distributed(precision=...)``): what ``ctx.autocast``,
            ``ctx.backward`` and ``ctx.step`` use.
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
    precision: str = "32"
    _loop: Any = attrs.field(default=None, init=False, repr=False)  # loop.LoopState, made on first use

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that saves, prints and logs INFO."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (``mode="ddp"``); collectives are identities otherwise."""
        return collectives.active()

    @property
    def should_stop(self) -> bool:
        """True on **every** rank once any of them received SIGTERM or SIGUSR2 (preemption, time limit).

        A collective (an all-reduce of one flag with MAX): read it on every rank at the same step boundary,
        e.g. ``if ctx.should_stop: ctx.save(...); return``, never under ``if ctx.is_main:``. Reading it once
        also tells distfn that this function stops by itself: SIGTERM then only sets the flag instead of raising
        ``distfn.Terminated`` in the middle of a step. See docs/failures.md (SLURM ``--signal``).
        """
        from . import preemption

        return preemption.should_stop(self.device if self.backend == "nccl" else None)

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

    def dataloader(
        self, dataset: Dataset, batch_size: int, shuffle: bool = True, drop_last: bool = False, **kwargs: Any
    ) -> DistributedLoader:
        """A ``DataLoader`` over this rank's share of ``dataset`` that reshuffles every epoch by itself.

        ``batch_size`` is **per rank**: one step sees ``batch_size * world_size`` samples (logged once, on
        rank 0). Each ``for batch in loader`` starts a new epoch of the ``DistributedSampler`` (no
        ``set_epoch`` to forget); ``loader.set_epoch(e)`` makes the next one epoch ``e`` for exact resume.
        ``drop_last`` applies to the sampler (no padding) and to the last incomplete batch. ``pin_memory``
        defaults to True on CUDA; DataLoader workers are seeded per rank, per worker and per epoch. Other
        ``kwargs`` (``num_workers``, ``collate_fn``, ...) go to ``torch.utils.data.DataLoader``.
        """
        from . import data

        return data.dataloader(dataset, batch_size, self.sampler, rank=self.rank, seed=self.seed, device=self.device,
                               shuffle=shuffle, drop_last=drop_last, **kwargs)

    def gather_for_metrics(self, value: Any, loader: DistributedLoader | None = None) -> Any:
        """Per-sample ``value`` (tensor, batch dimension first, or a dict/list/tuple of them) from every rank,
        concatenated in the sampler's order without ``DistributedSampler``'s padding duplicates, so metrics over
        the gathered results are exact. Call it on every rank for the current batch, or after the loop on
        everything concatenated; ``loader`` defaults to the ``ctx.dataloader`` iterated last."""
        from . import data

        return data.gather_for_metrics(value, loader, device=self.device if self.backend == "nccl" else None)

    # -- models -------------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, *, sync_batchnorm: bool = False, **ddp_kwargs: Any) -> nn.Module:
        """Move ``model`` to ``ctx.device`` and wrap it for the mode.

        ``"ddp"``: ``DistributedDataParallel`` (with ``device_ids`` on CUDA; ``find_unused_parameters`` and other
        DDP options pass through ``ddp_kwargs``); ``sync_batchnorm=True`` converts BatchNorm layers to
        SyncBatchNorm first (on GPUs; on CPU, where torch's SyncBatchNorm cannot train, it warns and keeps
        BatchNorm). ``"dp"``: ``nn.DataParallel`` over the visible GPUs. ``"single"``: no wrapper.
        ``"fsdp"``: sharded in place with FSDP2 ``fully_shard`` by the ``fsdp={...}`` policy of ``@distributed``
        (keyword arguments here override those options for this model, e.g. ``module_classes=[Block]``); the
        returned module is the same object, its parameters now ``DTensor`` shards (see ``distfn.fsdp``).
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(f"ctx.wrap expects a torch.nn.Module, got {type(model).__name__}")
        if ddp_kwargs and self.mode not in ("ddp", "fsdp"):
            raise ConfigError(f"DDP options {sorted(ddp_kwargs)} were given but mode={self.mode!r}")
        from . import loop

        model = model.to(self.device)
        if self.mode == "fsdp":
            from . import fsdp

            if sync_batchnorm:
                model = loop.convert_sync_batchnorm(model, self.device, warn=self.is_main)
            return fsdp.wrap(model, fsdp.parse_options(fsdp.options(), **ddp_kwargs), self.device)
        if self.mode == "ddp":
            if sync_batchnorm:
                model = loop.convert_sync_batchnorm(model, self.device, warn=self.is_main)
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
        from .checkpoint import unwrap_module

        return unwrap_module(model)

    # -- training loop (distfn/loop.py) ---------------------------------------------------------------------
    def _loop_state(self) -> Any:
        from . import loop

        if self._loop is None:
            self._loop = loop.LoopState(precision=self.precision, device=self.device)
        return self._loop

    def no_sync(self, model: nn.Module) -> Any:
        """Context manager skipping DDP's gradient all-reduce for the forward and backward inside it (a no-op
        for unwrapped models). ``ctx.accumulate`` does the counting for you."""
        from . import loop

        return loop.no_sync(model)

    def accumulate(self, model: nn.Module, every: int) -> Accumulator:
        """An accumulator for ``every`` micro-batches per optimizer step: ``with acc:`` around each micro-batch
        skips the all-reduce on all but the last one; inside it ``ctx.backward`` divides the loss by ``every``
        and ``ctx.step`` steps only when the window closes (also at the last batch of a ``ctx.dataloader``)."""
        from . import loop

        return loop.Accumulator(model, every, self._loop_state())

    def autocast(self, *, enabled: bool | None = None, dtype: torch.dtype | None = None) -> Any:
        """``torch.autocast`` for ``ctx.device`` with the run's precision (bf16 works on CPU too); a no-op for
        ``precision="32"``. Put the forward pass and the loss inside it, not the backward."""
        from . import loop

        return loop.autocast(self._loop_state(), enabled=enabled, dtype=dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the GradScaler for fp16 and divided by the window inside ``with acc:``."""
        from . import loop

        loop.backward(self._loop_state(), loss, **kwargs)

    def step(self, *optimizers: Any, max_grad_norm: float | None = None, zero_grad: bool = True) -> bool:
        """Step the optimizer(s) (through the GradScaler for fp16, clipping to ``max_grad_norm`` when given)
        and zero their gradients, unless an accumulation window is still open; returns whether it stepped."""
        from . import loop

        return loop.step(self._loop_state(), *optimizers, max_grad_norm=max_grad_norm, zero_grad=zero_grad)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the per-GPU losses ``nn.DataParallel`` returns when the loss is computed inside
        ``forward`` (``mode="dp"``); a scalar loss is returned as is."""
        from . import loop

        return loop.reduce_loss(loss)

    def progress(
        self, iterable: Any, desc: str | None = None, total: int | None = None, **tqdm_kwargs: Any
    ) -> Progress[Any]:
        """Iterate ``iterable`` with a tqdm bar on rank 0 only; ``bar.log(loss=...)`` shows running means.
        Silent when the output is not a terminal (one summary line is logged at the end instead)."""
        from . import loop

        return loop.Progress(iterable, enabled=self.is_main, desc=desc, total=total, **tqdm_kwargs)

    def writer(self, log_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """A TensorBoard ``SummaryWriter`` on rank 0 and a no-op object with the same methods on the other
        ranks. Needs ``pip install 'distfn[tensorboard]'`` (an ImportError saying so otherwise)."""
        from . import loop

        return loop.writer(self.is_main, None if log_dir is None else os.fspath(log_dir), **kwargs)

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
        rng: bool = False,
    ) -> Path:
        """Write ``obj`` to ``path`` as safetensors from rank 0; other ranks return at once.

        ``obj`` is a module (bare, DDP, DP or compiled: saved with the bare module's key names), a flat
        ``{name: tensor}`` dict or a training-state mapping (see ``distfn.checkpoint``). Tensors are copied to the
        CPU one at a time; the live model never moves. There is **no collective** inside, so it is safe under
        ``if ctx.is_main:``; call ``ctx.barrier()`` afterwards if other ranks must read the file.
        Returns the path (on every rank).

        In ``mode="fsdp"``, when ``obj`` holds a sharded model or optimizer, **every rank must call it**: it
        gathers full state dicts to the CPU of rank 0 (a collective), which writes the same single file as DDP
        mode. Calling it on rank 0 only is detected and raises ``CheckpointError`` instead of hanging.

        ``rng=True`` also stores every rank's random generator states (Python, NumPy, torch, CUDA) under
        ``"rng"``, so that ``ctx.load(..., rng=True)`` continues bit-for-bit. Gathering them is a collective:
        with ``rng=True`` every rank must call ``ctx.save`` (not only rank 0). ``obj`` must then be a mapping.
        """
        from . import checkpoint

        checked_in = False
        if rng and self.mode == "fsdp":
            from . import fsdp

            fsdp.check_in("ctx.save")  # before the RNG gather: a rank-0-only call must fail there, not hang in it
            checked_in = True
        if rng:
            if not isinstance(obj, Mapping):
                raise ConfigError("ctx.save(..., rng=True) needs a training-state mapping such as "
                                  "{'model': model, 'optimizer': opt, 'step': step}")
            states = collectives.gather_object(checkpoint.rng_state())
            obj = {**obj, "rng": checkpoint.combine_rng_states(states)}

        if self.mode == "fsdp":
            from . import fsdp

            return fsdp.save(obj, path, rank=self.rank, metadata=metadata, keep=keep, checked_in=checked_in)
        if self.is_main:
            return checkpoint.save(obj, path, metadata=metadata, keep=keep)
        return Path(path)

    def load(
        self,
        path: str | os.PathLike[str],
        into: nn.Module | Mapping[str, Any],
        *,
        strict: bool = True,
        rng: bool = False,
    ) -> dict[str, Any]:
        """Restore ``into`` (a module, or a mapping of modules/optimizers/schedulers/...) in place from ``path``
        on every rank, onto ``ctx.device``; returns the non-tensor values saved with it (``step``, ...).

        ``rng=True`` restores this rank's random generator states saved by ``ctx.save(..., rng=True)`` (no
        collective); a file without them is an error.

        In ``mode="fsdp"`` sharded models and optimizers get their shard of the full tensors in the file (written
        in fsdp or ddp mode); call it on every rank (calling it on rank 0 only is detected and raises)."""
        from . import checkpoint

        if self.mode == "fsdp":
            from . import fsdp

            values = fsdp.load(path, into, device=self.device, strict=strict)
        else:
            values = checkpoint.load_into(path, into, device=self.device, strict=strict)
        if rng:
            saved = values.pop("rng", None)
            if saved is None:
                raise CheckpointError(f"{path} holds no RNG states; write it with ctx.save(..., rng=True)")
            checkpoint.set_rng_state(checkpoint.rng_state_for_rank(saved, self.rank, self.world_size))
        return values
