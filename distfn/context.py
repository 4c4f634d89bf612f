"""`Context`: what the user's function gets as `ctx`.

It holds facts about this rank (frozen after start-up), the run's mutable state (`distfn.run.Run`, ``ctx.run``)
and thin methods that forward to the modules that do the work (`collectives`, `data`, `precision`,
`accumulation`, `progress`, `wrapping`, `checkpoint`, `tracking`, `timings`), handing each the part of the run it
needs, so each piece can be tested on its own. Every collective method runs inside ``self.run.collective(op)``
(`distfn.run.Run.collective`), the one hook that notes the sync point, enters the ledger and counts the wait as
the step's comm time.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from . import collectives, data, progress, wrapping
from . import precision as amp
from .checkpoint.background import Saves
from .data import DistributedLoader
from .devices import collective_device
from .errors import ConfigError
from .modules import unwrap_module
from .options import Mode, Precision, runs_one_process
from .progress import Progress
from .run import Run
from .stragglers import TimingTable

if TYPE_CHECKING:  # `distfn.accumulation` is imported at ctx.accumulate / ctx.no_sync, not at every job's start
    from .accumulation import Accumulator


@attrs.define(eq=False)
class Context:
    """Everything one rank knows about the run, handed to the decorated function as `ctx`.

    Attributes:
        rank: global rank of this process, `0 .. world_size-1`.
        local_rank: rank among the processes on this node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, `0 .. num_nodes-1`.
        num_nodes: number of nodes in the job.
        device: the device this rank computes on (`cuda:N` or `cpu`).
        backend: the process group backend (`"gloo"`, `"nccl"`, ...), or `None` without a process group.
        mode: `"ddp"`, `"fsdp"`, `"dp"` or `"single"`.
        launcher: who started this process: `"spawn"` (distfn), `"torchrun"`, `"slurm"`, `"mpi"`,
            `"kubernetes"` / `"env"` (a plain env:// launcher such as a PyTorchJob), or `"local"` (one process
            run in place, no launcher).
        seed: the seed every rank was seeded with, or `None`.
        log: this rank's loguru logger, bound to the rank (`ctx.log.info(...)`; INFO shows on rank 0 only
            unless `DISTFN_LOG_RANKS=all`).
        precision: `"32"`, `"bf16"` or `"16"` (`@distributed(precision=...)`): what `ctx.autocast`,
            `ctx.backward` and `ctx.step` use.
        restart: which attempt of the job this is: 0, then 1, 2, ... after restarts (`@distributed(max_restarts=)`,
            or torchrun's `--max-restarts`).
        run: this run's mutable state (its fsdp options, check-in, stop signals, last loader, sharded models),
            made by the rank bootstrap; the methods below hand it to the services they call.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str | None
    mode: Mode
    launcher: str
    seed: int | None = None
    log: Any = attrs.field(default=None, repr=False)
    precision: Precision = "32"
    restart: int = 0
    run: Run = attrs.field(factory=Run, repr=False)
    _loop: amp.LoopState | None = attrs.field(default=None, init=False, repr=False)  # made on first use
    # (backend, device, collective device) of the last `_group_device` answer: every collective of a Python number
    # asks, and working it out parses the backend's name (~5 µs a call, bench/bench_collectives.py)
    _group_device_of: tuple[Any, Any, torch.device | None] | None = attrs.field(default=None, init=False,
                                                                               repr=False)
    @property
    def saves(self) -> Saves:
        """This rank's background checkpoint writer (``ctx.save(..., blocking=False)``): ``ctx.saves.wait()`` waits
        for a pending save and raises its error; the bootstrap drains it before the process group goes."""
        return self.run.saves

    @property
    def mesh(self) -> Any:
        """The run's named ``torch.distributed.DeviceMesh`` (``@distributed(mesh=...)``: dimensions among
        ``dp_replicate``, ``dp_shard``, ``tp``, outermost first; without ``mesh=``, one ``dp_shard`` dimension over
        every rank), ``None`` in one process. ``ctx.mesh["tp"]`` is this rank's tensor-parallel sub-mesh,
        ``ctx.mesh.get_local_rank("tp")`` its place in it; ``ctx.rank`` and ``ctx.world_size`` stay global."""
        return self.run.mesh.device_mesh if self.run.mesh is not None else None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (the ranks of one tensor-parallel group share it, and
        get the same batches); ``ctx.rank`` without a ``tp`` dimension."""
        return self._data_ranks()[1]

    @property
    def dp_size(self) -> int:
        """How many different batches one step sees: the product of the mesh's ``dp_replicate`` and ``dp_shard``
        (``ctx.world_size`` without a ``tp`` dimension)."""
        return self._data_ranks()[0]

    def _data_ranks(self) -> tuple[int, int]:
        """``(data-parallel ranks, this rank's index among them)``: what the sampler shards over."""
        if runs_one_process(self.mode):
            return 1, 0
        if self.run.mesh_if_made is not None:  # not made yet: the default mesh, every rank data-parallel
            layout = self.run.mesh_if_made.layout
            return layout.dp_size, layout.dp_rank(self.rank)
        return self.world_size, self.rank

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that saves, prints and logs INFO."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (`mode="ddp"` or `"fsdp"`); collectives are identities otherwise."""
        return collectives.active()

    @property
    def _group_device(self) -> torch.device | None:
        known = self._group_device_of
        if known is not None and known[0] is self.backend and known[1] is self.device:
            return known[2]
        found = collective_device(self.backend, self.device)
        self._group_device_of = (self.backend, self.device, found)
        return found

    @property
    def should_stop(self) -> bool:
        """True on **every** rank once any of them received SIGTERM or SIGUSR2 (preemption, time limit).

        A collective (an all-reduce of one flag with MAX): read it on every rank at the same step boundary,
        e.g. `if ctx.should_stop: ctx.save(...); return`, never under `if ctx.is_main:`. Reading it once
        also tells distfn that this function stops by itself: SIGTERM then only sets the flag instead of raising
        `distfn.Terminated` in the middle of a step. See docs/failures.md (SLURM `--signal`).
        """
        with self.run.collective("all_reduce"):  # an all-reduce of one flag
            stop = self.run.stop.should_stop(self._group_device)
        if stop:
            self.saves.wait()  # a pending asynchronous save completes before the function stops
        return stop

    # -- data ---------------------------------------------------------------------------------------------
    def sampler(
        self, dataset: Dataset, shuffle: bool = True, seed: int | None = None, drop_last: bool = False
    ) -> DistributedSampler:
        """A `DistributedSampler` giving this rank its share of `dataset` (works with a world of one).

        The share is over the data-parallel ranks (`ctx.dp_size`, `ctx.dp_rank`): with a ``tp`` dimension in
        ``mesh=``, the ranks of one tensor-parallel group get the same share.

        Call `sampler.set_epoch(epoch)` each epoch to reshuffle (`ctx.dataloader` does it for you).

        Args:
            dataset: a map-style dataset.
            shuffle: shuffle the indices (identically on every rank, so the shares are disjoint).
            seed: the shuffle seed; defaults to the run's seed (or 0).
            drop_last: drop the tail that does not divide evenly instead of padding it with duplicates.
        """
        replicas, rank = self._data_ranks()
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
        """A `DataLoader` over this rank's share of `dataset` that reshuffles every epoch by itself.

        One step sees `batch_size * ctx.dp_size` samples (logged once, on rank 0): `ctx.dp_size` is
        `world_size` unless a ``tp`` mesh dimension gives each tensor-parallel group one batch. Each
        `for batch in loader` starts a new epoch of the `DistributedSampler` (no `set_epoch` to forget), while a
        peek such as `next(iter(loader))` does not use one up; `loader.set_epoch(e)` makes the next one epoch `e`.
        The loader is state: in `ctx.save({..., "loader": loader})` / `ctx.resume` it continues at the next batch,
        also on another number of ranks (docs/data.md, "Exact resume"). DataLoader workers are seeded per rank,
        per worker and per epoch.

        Args:
            dataset: a map-style dataset (an `IterableDataset` must shard itself and is refused).
            batch_size: samples **per rank** in one batch.
            shuffle: reshuffle every epoch (the same permutation on every rank).
            drop_last: applies to the sampler (no padding) and to the last incomplete batch.
            kwargs: passed to `torch.utils.data.DataLoader` (`num_workers`, `collate_fn`, ...); `pin_memory`
                defaults to True on CUDA and is dropped on the CPU (where it only makes torch warn).
                `global_batch_change="continue"` lets a resume on a number of ranks the saved global batch
                does not divide over go on with this per-rank batch (the default `"refuse"` raises).
        """
        return data.dataloader(dataset, batch_size, self.sampler, rank=self.dp_rank, seed=self.seed, device=self.device,
                               shuffle=shuffle, drop_last=drop_last, tracker=self.run.loaders,
                               timer=self.run.timings.timed_batches, **kwargs)

    def gather_for_metrics(self, value: Any, loader: DistributedLoader | None = None) -> Any:
        """Per-sample `value` from every rank, concatenated in the sampler's order without
        `DistributedSampler`'s padding duplicates, so metrics over the gathered results are exact.

        Call it on every rank for the current batch, or after the loop on everything concatenated.

        Args:
            value: a tensor with the batch dimension first, or a dict / list / tuple of such tensors.
            loader: the `ctx.dataloader` the rows come from; defaults to the one iterated last.
        """
        loader = loader if loader is not None else self.run.loaders.current()
        with self.run.collective("gather_for_metrics"):
            mesh = self.run.mesh_if_made  # not made yet: the default mesh, whose group is the world
            group = mesh.dp_group if mesh is not None else None
            side = {"group": group} if group is not None else {}
            return data.gather_for_metrics(value, loader, device=self._group_device, **side)

    # -- models -------------------------------------------------------------------------------------------
    def wrap(
        self,
        model: nn.Module,
        *,
        sync_batchnorm: bool = False,
        init: Callable[[nn.Module], None] | None = None,
        parallelize: Any = None,
        compile: bool = False,
        **ddp_kwargs: Any,
    ) -> nn.Module:
        """Move `model` to `ctx.device` and wrap it for the mode.

        * `"ddp"`: `DistributedDataParallel` (with `device_ids` on CUDA).
        * `"dp"`: `nn.DataParallel` over the visible GPUs.
        * `"single"`: no wrapper.
        * `"fsdp"`: sharded in place with FSDP2 `fully_shard` by the `fsdp={...}` policy of `@distributed`; the
          returned module is the same object, its parameters now `DTensor` shards (see `distfn.fsdp`). A model
          built under `with torch.device("meta"):` is sharded first, then only this rank's shards are materialised
          on `ctx.device` and initialised (every submodule's `reset_parameters()`, or `init`), so no rank ever holds
          the whole model. The other modes refuse a meta model with an error saying how to materialise it.

        Args:
            model: the bare module.
            sync_batchnorm: convert BatchNorm layers to SyncBatchNorm first (on GPUs; on CPU, where torch's
                SyncBatchNorm cannot train, it warns and keeps BatchNorm).
            init: fsdp mode, meta-device model only: `init(model)` initialises the materialised shards in place
                (under `torch.no_grad()`) instead of the submodules' `reset_parameters()`.
            parallelize: fsdp mode with a ``tp`` dimension in ``mesh=``: tensor parallelism applied first, either
                torch's plan (``{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}``, module paths to
                ``ParallelStyle`` s, applied on ``ctx.mesh["tp"]``) or a function ``fn(model, mesh) -> model``
                given the whole mesh; FSDP then shards over the data-parallel dimensions (docs/mesh.md).
            compile: ``torch.compile`` the forward in place before wrapping; in fsdp mode each FSDP unit's
                forward, before sharding, so FSDP's hooks stay outside the compiled code and the checkpoint keys
                stay the bare module's (no ``_orig_mod.``).
            ddp_kwargs: in ddp mode, `DistributedDataParallel` options (`find_unused_parameters`, ...); in fsdp
                mode, overrides of the `fsdp={...}` options for this model (e.g. `module_classes=[Block]`).
        """
        self.run.agree(model)  # every rank got the same cfg and built the same model (distfn.fingerprint)
        wrapped = wrapping.wrap(model, mode=self.mode, device=self.device, is_main=self.is_main,
                                sync_batchnorm=sync_batchnorm, init=init, run=self.run, parallelize=parallelize,
                                compile=compile, **ddp_kwargs)
        self._loop_state().track(wrapped)  # ctx.step(max_grad_norm=) clips in this model's parameter order
        return wrapped

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare module (strips DDP, DataParallel and `torch.compile` wrappers).

        Args:
            model: a module, possibly wrapped.
        """
        return unwrap_module(model)

    # -- training loop (distfn/precision.py as amp, distfn/accumulation.py) -----------------------------------------
    def _loop_state(self) -> amp.LoopState:
        if self._loop is None:
            self._loop = amp.LoopState(precision=self.precision, device=self.device)
        return self._loop

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The `GradScaler` of a `precision="16"` run (`None` otherwise), used by `ctx.backward` and `ctx.step`.

        Put it in the training state so that an fp16 run resumes exactly (its loss scale and growth tracker
        are part of the state): `ctx.save({"model": model, "optimizer": opt, "scaler": ctx.scaler, ...}, path)`,
        and the same mapping in `ctx.load(path, into=...)` restores it in place.
        """
        return self._loop_state().scaler

    def no_sync(self, model: nn.Module) -> Any:
        """Context manager skipping DDP's gradient all-reduce for the forward and backward inside it (a no-op
        for unwrapped models). `ctx.accumulate` does the counting for you.

        Args:
            model: the wrapped model.
        """
        from . import accumulation  # at first use: a job that never accumulates never loads it (issue 46 item 2)

        return accumulation.no_sync(model)

    def accumulate(self, model: nn.Module, every: int) -> Accumulator:
        """An accumulator for `every` micro-batches per optimizer step.

        `with acc:` around each micro-batch skips the all-reduce on all but the last one; inside it
        `ctx.backward` divides the loss by `every` and `ctx.step` steps only when the window closes (also at the
        last batch of a `ctx.dataloader`).

        Args:
            model: the wrapped model.
            every: micro-batches per optimizer step (a positive int).
        """
        from . import accumulation  # see `no_sync`

        return accumulation.Accumulator(model, every, self._loop_state(), loaders=self.run.loaders)

    def autocast(self, *, enabled: bool | None = None, dtype: torch.dtype | None = None) -> Any:
        """`torch.autocast` for `ctx.device` with the run's precision (bf16 works on CPU too); a no-op for
        `precision="32"`. Put the forward pass and the loss inside it, not the backward.

        Args:
            enabled: `False` switches autocast off for the block; `None` follows the run's precision.
            dtype: overrides the precision's dtype (and enables autocast even with `precision="32"`).
        """
        return amp.autocast(self._loop_state(), enabled=enabled, dtype=dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, scaled by the GradScaler for fp16 and divided by the window inside `with acc:`.

        Args:
            loss: the scalar loss.
            kwargs: passed to `Tensor.backward` (`retain_graph`, ...).
        """
        amp.backward(self._loop_state(), loss, **kwargs)

    def step(self, *optimizers: Any, max_grad_norm: float | None = None, zero_grad: bool = True,
             per_rank: Mapping[str, torch.Tensor] | None = None) -> bool:
        """Step the optimizer(s) unless an accumulation window is still open; returns whether it stepped.

        With fp16 the GradScaler unscales, skips steps whose gradients overflowed and updates its scale.

        Each call is a step boundary: this rank's random generator states are snapshot here (in memory, no
        collective), and a later `ctx.save` on rank 0 alone writes every rank's snapshot of that boundary, so
        `ctx.resume` continues each rank's streams exactly (docs/checkpoints.md, "Exact resume").

        Args:
            optimizers: the optimizer(s) to step.
            max_grad_norm: clip the (unscaled) gradients of all their parameters to this norm first, the same
                computation as `clip_grad_norm_(model.parameters(), max_grad_norm)` for the model(s) of
                `ctx.wrap` / `ctx.accumulate`.
            zero_grad: set the gradients to `None` afterwards.
            per_rank: `{name: tensor}` of this rank to keep with the boundary's snapshot, such as a batch
                prefetched before this call (`per_rank={"X": X, "Y": Y}`): the next `ctx.save` writes every rank's,
                and `ctx.resume` puts this rank's back under the state's `"per_rank"` key. Held by reference until
                saved: do not change the tensors in place.
        """
        stepped = amp.step(self._loop_state(), *optimizers, max_grad_norm=max_grad_norm, zero_grad=zero_grad)
        self.run.boundaries.mark(per_rank)
        return stepped

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the per-GPU losses `nn.DataParallel` returns when the loss is computed inside `forward`
        (`mode="dp"`); a scalar loss is returned as is.

        Args:
            loss: the loss as the model returned it.
        """
        return amp.reduce_loss(loss)

    def progress(
        self, iterable: Any, desc: str | None = None, total: int | None = None, **tqdm_kwargs: Any
    ) -> Progress[Any]:
        """Iterate `iterable` with a tqdm bar on rank 0 only; `bar.log(loss=...)` shows running means.
        When the output is not a terminal (a batch job's log), rank 0 logs a plain line instead, every 10 % of the
        loop or 60 s, whichever comes first (step, rate, ETA, the running means), and one at the end.

        Args:
            iterable: what to iterate.
            desc: the bar's label.
            total: the number of items when `iterable` has no `len()`.
            tqdm_kwargs: ``log_percent=`` / ``log_seconds=`` set that cadence (defaults 10 and 60); the rest go to
                `tqdm` (`file`, `disable`, `mininterval`, ...).
        """
        return progress.Progress(iterable, enabled=self.is_main, desc=desc, total=total, timings=self.run.timings,
                                 **tqdm_kwargs)

    def timings(self, *, whole_run: bool = False, plot: str | os.PathLike[str] | None = None) -> TimingTable | None:
        """Where each rank's step time goes (data wait / compute / comm, mean and p90), on rank 0.

        Returns the table of the newest window of `distfn.timings.WINDOW` steps (``DISTFN_TIMINGS_WINDOW``) that
        every rank has reported, with the straggler if the rule names one (see docs/loop.md, "Performance"). It
        is `None` on the other ranks, before the first window, and with ``DISTFN_TIMINGS=0``. Steps are the
        training forwards of the model `ctx.wrap` returned; data wait is seen through `ctx.dataloader`.

        Args:
            whole_run: the totals since the start instead (means only). Then **every rank must call it**: each
                sends its totals and rank 0 waits (at most 10 s) for them; no collective.
            plot: also write, on rank 0, the picture of every window so far to this path: each rank's mean step
                split into data / compute / comm, then each part over the steps with the straggler's line in red
                (``.svg``: no dependency; ``.png``: needs matplotlib). Nothing is written before the first window,
                nor on the other ranks. A suffix other than ``.svg``/``.png`` is a `ConfigError`.
        """
        if plot is not None:
            self.run.timings.plot(plot)  # only rank 0 has the windows; every rank checks the path
        return self.run.timings.whole_run() if whole_run else (self.run.timings.latest if self.is_main else None)

    def writer(self, log_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
        """A TensorBoard `SummaryWriter` on rank 0 and a no-op object with the same methods on the other
        ranks. Needs `pip install 'distfn[tensorboard]'` (an ImportError saying so otherwise).

        Args:
            log_dir: the directory rank 0 writes to (TensorBoard's default `runs/...` when `None`).
            kwargs: passed to `SummaryWriter`.
        """
        return progress.writer(self.is_main, None if log_dir is None else os.fspath(log_dir), **kwargs)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` to the job's tracked run (``@distributed(track=...)``), from rank 0.

        Call it on every rank, with no ``if ctx.is_main:``: on the other ranks it returns at once (no file, no
        thread, no import of the tracker, no GPU sync). On rank 0 a tensor value is detached and read with
        ``.item()``; the values are sent in the background, in batches. The values are this rank's: use
        ``ctx.all_reduce`` first for the mean over ranks. See docs/tracking.md.

        Args:
            metrics: ``{name: number or one-element tensor}``.
            step: your global step (steps never go back; after a restart the steps an earlier attempt logged
                are not sent again). ``None``: one more than the last step logged in this attempt.
        """
        if self.run.tracking is not None:
            self.run.tracking.log_metrics(metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record ``params`` on the tracked run, from rank 0 (a no-op elsewhere). The cfg is recorded by itself
        when the run opens; nested values are flattened to dotted names, values JSON cannot hold left out.

        Args:
            params: ``{name: value}``, possibly nested.
        """
        if self.run.tracking is not None:
            self.run.tracking.log_params(params)

    # -- collectives --------------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every rank gets here (a no-op without a process group)."""
        with self.run.collective("barrier"):
            collectives.barrier(self.device)

    def all_reduce(self, value: Any, op: str = "mean", *, over: Literal["dp", "world"] = "dp") -> Any:
        """`value` reduced over the ranks (a collective: call it on every rank).

        Args:
            value: a tensor, a Python number, or a dict of Python numbers (reduced in one collective); a number
                comes back as a number (`float` for `"mean"`), a dict as a new dict of numbers.
            op: `"mean"`, `"sum"`, `"max"` or `"min"`.
            over: `"dp"` (default): the data-parallel ranks, which is every rank unless ``mesh=`` has a ``tp``
                dimension; then the ranks of one tensor-parallel group, which hold the same batch and the same
                loss, count once (a `"sum"` of correct predictions is not multiplied by the tp size).
                `"world"`: every rank.
        """
        device = self._group_device
        mesh = self.run.mesh_if_made  # not made yet: the default mesh, whose group is the world
        group = mesh.dp_group if over == "dp" and mesh is not None else None
        if over not in ("dp", "world"):
            raise ConfigError(f"ctx.all_reduce(over={over!r}): use 'dp' (the data-parallel ranks) or 'world'")
        side = {"group": group} if group is not None else {}  # the world: the call as it always was
        with self.run.collective("all_reduce"):
            if isinstance(value, torch.Tensor) and device is not None and value.device.type != device.type:
                return collectives.all_reduce(value.to(device), op, **side).to(value.device)
            return collectives.all_reduce(value, op, device=device, **side)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, as a list indexed by rank, on every rank (a collective).

        Args:
            obj: any picklable object.
        """
        with self.run.collective("gather_object"):
            return collectives.gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (a collective; the other ranks' `obj` is ignored).

        Args:
            obj: any picklable object.
            src: the rank whose object everyone gets.
        """
        with self.run.collective("broadcast_object"):
            return collectives.broadcast_object(obj, src=src)

    # -- output -------------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only (other ranks print nothing).

        Args:
            args: what to print.
            kwargs: passed to `print` (`flush` defaults to True).
        """
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
        rng: bool | Mapping[str, Any] | None = None,
        sharded: bool | None = None,
        blocking: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> PurePath:
        """Write ``obj`` to ``path`` as safetensors from rank 0; other ranks return at once.

        ``obj`` is a module (bare, DDP, DP or compiled: saved with the bare module's key names), a flat
        ``{name: tensor}`` dict or a training-state mapping (see ``distfn.checkpoint``). Tensors are copied to the
        CPU one at a time; the live model never moves. There is **no collective** inside, so it is safe under
        ``if ctx.is_main:``; call ``ctx.barrier()`` afterwards if other ranks must read the file.
        Returns the path (on every rank).

        In ``mode="fsdp"``, when ``obj`` holds a sharded model or optimizer, **every rank must call it**: it
        gathers full state dicts to the CPU of rank 0 (a collective), which writes the same single file as DDP
        mode. Calling it on rank 0 only is detected and raises ``CheckpointError`` instead of hanging.

        A training-state mapping also gets every rank's random generator states (Python, NumPy, torch, CUDA)
        under ``"rng"``, by default those each rank had at its last `ctx.step` (snapshot there, brought to rank 0
        through the run's store: still no collective, also under ``if ctx.is_main:``), together with the values
        given to ``ctx.step(..., per_rank=)``; ``ctx.resume`` restores each rank's own, so the run continues
        bit-for-bit, also when the loop draws its next batch before saving (docs/checkpoints.md, "Exact resume").
        ``rng=True`` gathers them at the call instead (a collective: every rank must call ``ctx.save``);
        ``rng=False`` stores none; a mapping (``distfn.checkpoint.rng_state()`` taken earlier) is written as given.

        Args:
            obj: a module, a `{name: tensor}` dict or a training-state mapping.
            path: the file to write (written to a temporary file, then renamed: never half-written).
            metadata: string-keyed JSON-able values stored in the file's header.
            keep: with a step-numbered name such as `ckpt-1200.safetensors`, keep only the `keep` newest files
                of that name in the directory (older ones are deleted once the new file is in place); `None`
                keeps everything.
            rng: which random generator states to store (see above): `None` (each rank's at its last
                `ctx.step`; one-file saves outside `mode="fsdp"`), `True`, `False` or a state to write.
            sharded: write a sharded checkpoint directory, every rank its own shards (a collective: every rank
                calls it; see docs/checkpoints.md, "Sharded checkpoints"). Default: in `mode="fsdp"` when `path`
                does not end in `.safetensors`, else one file.
            blocking: `False` returns once the state is copied to host memory; the write, `fsync` and rename run
                in a background thread. The next save, the function's end (return or exception) and a true
                `ctx.should_stop` wait for it, so nothing is lost (docs/checkpoints.md, "Asynchronous saves").
            storage_options: for a URL (`s3://bucket/...`), the fsspec file system's options (endpoint,
                credentials); by default fsspec's configuration (docs/checkpoints.md, "Remote storage").
        """
        from . import checkpointing as policy  # at the first save/load/resume, not at the job's start: ~30 ms (see
        # distfn.checkpoint's _EXPORTS) that a job which never saves should not pay

        return policy.save_state(obj, path, mode=self.mode, rank=self.rank, run=self.run, metadata=metadata,
                                 keep=keep, rng=rng, sharded=sharded, blocking=blocking,
                                 storage_options=storage_options)

    def load(
        self,
        path: str | os.PathLike[str],
        into: nn.Module | Mapping[str, Any],
        *,
        strict: bool = True,
        rng: bool | Literal["if-present"] = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Restore ``into`` (a module, or a mapping of modules/optimizers/schedulers/...) in place from ``path``
        on every rank, onto ``ctx.device``; returns the non-tensor values saved with it (``step``, ...).

        ``rng=True`` restores this rank's random generator states saved by ``ctx.save(..., rng=True)`` (no
        collective); a file without them is an error, since a run that must continue bit-for-bit should not go on
        silently with fresh generators. ``rng="if-present"`` restores them when the file holds them and goes on
        without them otherwise, as `ctx.resume` does: for code that loads checkpoints written either way.

        In ``mode="fsdp"`` sharded models and optimizers get their shard of the full tensors in the file (written
        in fsdp or ddp mode); call it on every rank (calling it on rank 0 only is detected and raises).

        Args:
            path: the file written by `ctx.save` (or `distfn.save`).
            into: a module, or a mapping of modules / optimizers / schedulers / ... restored in place.
            strict: every tensor of `into` must be in the file and nothing extra (as `load_state_dict`).
            rng: restore this rank's random generator states: True (the file must hold them), ``"if-present"``
                (when it holds them) or False (leave them alone; a saved ``"rng"`` entry is then returned).
            storage_options: for a URL, the fsspec file system's options (as in `ctx.save`).
        """
        from . import checkpointing as policy  # see `save`

        return policy.load_state(path, into, mode=self.mode, rank=self.rank, world_size=self.world_size,
                                 device=self.device, run=self.run, strict=strict, rng=rng,
                                 storage_options=storage_options)

    def resume(
        self,
        state: nn.Module | Mapping[str, Any],
        directory: str | os.PathLike[str],
        *,
        prefix: str = "ckpt-",
        strict: bool = True,
        start: Literal["auto", "resume", "fresh"] = "auto",
        storage_options: Mapping[str, Any] | None = None,
    ) -> int:
        """Continue from the newest complete checkpoint in ``directory``: restore ``state`` and return its step.

        Call it on every rank with the state you save, e.g. ``start = ctx.resume(state, "ckpt")`` before the
        loop and ``ctx.save({**state, "step": step}, f"ckpt/ckpt-{step}.safetensors", keep=3)`` inside it: a
        restarted or requeued job continues where the last save left off, and the numbering goes on.

        Args:
            state: what `ctx.load` restores in place (plain values such as ``"step"`` are replaced by the saved
                ones). The saved random generator states are restored too, each rank its own.
            directory: where the ``<prefix><step>.safetensors`` files (or sharded ``<prefix><step>``
                directories) are; missing or empty means a fresh start.
            prefix: the name before the step number.
            strict: as in `ctx.load`.
            start: `"auto"` continues from the newest checkpoint when there is one; `"resume"` raises
                `CheckpointError` when there is none; `"fresh"` raises when the directory already holds
                checkpoints in the job's first attempt (`ctx.restart == 0` and not a requeued Slurm job: a fresh
                run pointed at an old directory must not silently continue it; a restarted attempt continues its
                own).
            storage_options: for a URL, the fsspec file system's options (as in `ctx.save`).

        Rank 0 logs one line: the file, step, epoch and batch restored and whether the random streams were, or
        that the run starts fresh. Values given to ``ctx.step(..., per_rank=)`` come back as this rank's under
        ``state["per_rank"]`` (``None`` when the checkpoint holds none for this rank).

        Returns:
            The step in the newest complete checkpoint's name (0 when there is none; ``state`` is then left
            alone). Rank 0 picks the file and every rank loads that same one.
        """
        from . import checkpointing as policy  # see `save`

        return policy.resume_state(state, directory, mode=self.mode, rank=self.rank, world_size=self.world_size,
                                   device=self.device, run=self.run, prefix=prefix, strict=strict, start=start,
                                   restart=self.restart, storage_options=storage_options)
