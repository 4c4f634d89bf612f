"""Data loading across ranks: a ``DataLoader`` that shards, reshuffles every epoch by itself and seeds its
workers per rank, and ``gather_for_metrics``, which collects per-sample results from every rank without the
duplicates ``DistributedSampler`` pads the last batch with.

Why a loader subclass: forgetting ``sampler.set_epoch(epoch)`` silently replays the same shuffle every epoch.
``DistributedLoader`` calls it itself and moves to the next epoch once an iteration has run (not on a mere
peek such as ``next(iter(loader))``), so the loop needs nothing; ``loader.set_epoch(e)`` stays for exact
resume. It also remembers which batch it is on, which is what lets ``gather_for_metrics`` tell padding rows
from real ones.
"""

from __future__ import annotations

import multiprocessing
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from loguru import logger
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from . import collectives
from .errors import CheckpointError, ConfigError
from .loader_state import GLOBAL_BATCH_CHANGES, GlobalBatchChange, LoaderState, ResumableSampler, per_rank_batch
from .tree import tree_leaves, tree_unflatten

_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A well-spread non-negative 63-bit seed from integers (splitmix64 rounds; stable across processes)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = ((h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


@attrs.define(eq=False)
class LastLoader:
    """Which of a run's loaders handed out a batch most recently (`distfn.run.Run.loaders`).

    ``ctx.gather_for_metrics`` filters the padding of that loader when no loader is named, and ``ctx.accumulate``
    closes its window at that loader's last batch. A weak reference, so a finished loader (and its workers) can be
    freed.
    """

    _last: weakref.ref[DistributedLoader] | None = None

    def note(self, loader: DistributedLoader) -> None:
        """``loader`` just handed out a batch."""
        self._last = weakref.ref(loader)

    def current(self) -> DistributedLoader | None:
        """The loader that handed out a batch most recently (``None``: none yet, or it is gone)."""
        return self._last() if self._last is not None else None

    def at_last_batch(self) -> bool:
        """True while the batch just handed out is its loader's last one of the epoch."""
        loader = self.current()
        return loader is not None and loader.at_last_batch()


class DistributedLoader(DataLoader):
    """A ``DataLoader`` over this rank's ``DistributedSampler`` that advances the sampler's epoch itself.

    Every ``iter(loader)`` (each ``for batch in loader``) calls ``sampler.set_epoch(loader.next_epoch)``, so each
    epoch shuffles differently and identically on all ranks. ``next_epoch`` moves on when an iteration ends, or
    when a new one starts after an iteration that handed out more than one batch (a loop left with ``break``).
    A peek that takes at most one batch and is abandoned, such as ``len(next(iter(loader))[0])`` to read the
    batch size, does not use up an epoch: the next iteration shuffles as if the peek had not happened.
    ``set_epoch(e)`` makes the next iteration use epoch ``e`` (for exact resume). When distfn owns the worker
    seeding (no ``generator`` was passed), the DataLoader workers' seeds are re-derived from
    ``(seed, rank, epoch)`` each epoch, so a resumed epoch sees the same random augmentations (with
    ``persistent_workers=True`` the workers keep their random streams across epochs instead). ``tracker``: the
    run's `LastLoader`, told of every batch handed out. ``timer``: wraps each epoch's batch iterator (the run's
    `distfn.timings.Timings.timed_batches`, which counts the time in ``next()`` as the step's data wait).

    The loader is state (`state_dict` / `load_state_dict`, so ``ctx.save({"loader": loader, ...})`` and
    ``ctx.resume`` keep it): its epoch, the global position reached in that epoch, the shuffle seed and the global
    batch. A restored loader starts its next iteration at that position through its `ResumableSampler`, without
    loading the skipped batches, on the same or another number of ranks (`distfn.loader_state`).
    ``global_batch_change``: what `load_state_dict` does when the saved global batch does not divide over this
    job's ranks (`distfn.loader_state.per_rank_batch`).

    Attributes:
        epoch: the epoch of the current (or last) iteration; ``None`` before the first one.
        next_epoch: the epoch the next iteration will use.
        global_batch_size: ``batch_size * num_replicas`` (samples per step over all ranks).
    """

    sampler: DistributedSampler  # checked in __init__

    def __init__(self, *args: Any, seed_parts: tuple[int, int] | None = None, tracker: LastLoader | None = None,
                 global_batch_change: GlobalBatchChange = "refuse",
                 timer: Callable[[Iterator[Any]], Iterator[Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, DistributedSampler):
            raise ConfigError("DistributedLoader needs a DistributedSampler; build it with ctx.dataloader")
        if global_batch_change not in GLOBAL_BATCH_CHANGES:
            raise ConfigError(f"global_batch_change must be one of {GLOBAL_BATCH_CHANGES}, got {global_batch_change!r}")
        self._on_change: GlobalBatchChange = global_batch_change
        self._start = 0  # global position of the current iteration's first batch (non-zero in a resumed epoch)
        self.epoch: int | None = None
        self.next_epoch = 0
        self._seed_parts = seed_parts  # (base seed, rank) when distfn seeds the workers, else None
        self._tracker = tracker
        self._timer = timer
        self._batch = -1  # index of the batch most recently handed out in this epoch
        self._done = False  # True once this epoch's iteration ran to its end
        self._pending = False  # an iteration started and next_epoch has not moved past it yet
        self._iterations = 0  # iterators created so far (only the newest one may advance the epoch)
        # The "batch_size x ranks = global batch" line, said by rank 0 at the first iteration (`_announce`), so a
        # ctx.resume in between that changes the per-rank batch is in the one line instead of contradicting it.
        self._announce_pending = False
        self._resized_from: tuple[int, int] | None = None  # (saved world size, per-rank batch asked) of a resume

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``batch_size`` × number of ranks sharing the dataset."""
        return int(self.batch_size or 0) * self.sampler.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (then ``epoch + 1``, ...). Use it to resume exactly."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"set_epoch expects a non-negative int, got {epoch!r}")
        self.next_epoch = epoch
        self._pending = False
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.clear()  # an explicit epoch starts at its beginning, whatever was restored

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # An iteration left with `break` after more than one batch counts as an epoch; a peek does not.
        if self._pending and self._batch >= 1:
            self.next_epoch += 1
        # Everything that depends on the epoch happens here, before DataLoader creates its iterator: the
        # iterator takes the sampler's order and draws the workers' base seed when it is created.
        epoch = self.next_epoch
        self.sampler.set_epoch(epoch)
        if self._announce_pending:
            self._announce()
        if self._seed_parts is not None and self.generator is not None:
            self.generator.manual_seed(mix_seed(*self._seed_parts, epoch))
        self.epoch = epoch
        self._start = self._start_of(epoch)[0]
        self._batch, self._done, self._pending = -1, False, True
        self._iterations += 1
        batches = super().__iter__()
        return self._track(batches if self._timer is None else self._timer(batches), self._iterations)

    def _announce(self) -> None:
        """The loader's one line (rank 0): per-rank batch, ranks, global batch, batches per full epoch, and, after a
        resume on another number of ranks, the per-rank batch asked for and the saved global batch it keeps."""
        self._announce_pending = False
        batch, replicas, size = int(self.batch_size or 0), self.sampler.num_replicas, len(self.dataset)  # type: ignore[arg-type]
        per_rank = self.sampler.num_samples
        batches = per_rank // batch if self.drop_last else -(-per_rank // batch)
        padded = self.sampler.total_size - size
        resized = ""
        if self._resized_from is not None:
            saved_world, asked = self._resized_from
            resized = (f"; resumed from {saved_world} rank(s): {batch} per rank instead of the {asked} asked "
                       f"keeps the saved global batch {batch * replicas}")
        logger.info(
            "dataloader: batch_size {} per rank x {} rank(s) = global batch {}; {} batches per epoch per rank "
            "({} samples{}){}", batch, replicas, batch * replicas, batches, size,
            f", {padded} padded with duplicates" if padded > 0 else (f", {-padded} dropped" if padded < 0 else ""),
            resized,
        )

    def _track(self, batches: Iterator[Any], iteration: int) -> Iterator[Any]:
        for batch in batches:
            self._batch += 1
            if self._tracker is not None:
                self._tracker.note(self)
            yield batch
        self._done = True
        if self._pending and iteration == self._iterations:  # not overtaken by a newer iteration or set_epoch
            self.next_epoch, self._pending = self.next_epoch + 1, False

    # -- the loader as state (exact resume, distfn/loader_state.py) --------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, for ``ctx.save``: JSON-able ints and bools, the same on every rank.

        The position counts the batches this iteration has handed out (a batch is consumed once the loop got it),
        so a save after the step on batch ``k`` resumes at batch ``k + 1``; after the epoch's last batch it is
        the next epoch's start.
        """
        epoch, position, epoch_world = self._next_position()
        global_batch = self.global_batch_size
        return LoaderState(
            epoch=epoch, position=position, batches=position // global_batch, seed=int(self.sampler.seed),
            shuffle=bool(self.sampler.shuffle), drop_last=bool(self.sampler.drop_last), global_batch=global_batch,
            world_size=self.sampler.num_replicas, epoch_world_size=epoch_world,
            dataset_len=len(self.dataset),  # type: ignore[arg-type]
        ).to_dict()

    def _next_position(self) -> tuple[int, int, int]:
        """``(epoch, global position, epoch world size)`` of the batch the job draws next."""
        in_epoch = self._pending and not self._done and self.epoch is not None
        if in_epoch and self._batch + 1 < len(self):
            epoch = int(self.epoch or 0)
            world = self._start_of(epoch)[1]
            return epoch, self._start + (self._batch + 1) * self.global_batch_size, world
        if in_epoch:  # the epoch's last batch was handed out: the next one opens the next epoch
            return int(self.epoch or 0) + 1, 0, self.sampler.num_replicas
        return (self.next_epoch, *self._start_of(self.next_epoch))  # between iterations: a restored position, or 0

    def _start_of(self, epoch: int) -> tuple[int, int]:
        if isinstance(self.sampler, ResumableSampler):
            return self.sampler.start_of(epoch)
        return 0, self.sampler.num_replicas

    def load_state_dict(self, state: Any) -> None:
        """Continue from a `state_dict` (``ctx.resume`` / ``ctx.load`` call it): the next iteration starts at the
        saved epoch and position, with the saved seed, on any number of ranks; the per-rank batch becomes the
        saved global batch over this job's ranks (`distfn.loader_state.per_rank_batch`).

        Raises:
            CheckpointError: a malformed state, a dataset of another length, another ``shuffle`` / ``drop_last``,
                or a global batch that does not divide over the ranks with ``global_batch_change="refuse"``.
        """
        saved = LoaderState.from_dict(state)
        n, world = len(self.dataset), self.sampler.num_replicas  # type: ignore[arg-type]
        if saved.dataset_len != n:
            raise CheckpointError(
                f"the checkpoint's data loader ran over a dataset of {saved.dataset_len} samples, this one has {n}: "
                "its position cannot be continued over other data. Resume with the same dataset, or leave the "
                "loader out of the state you restore (it then starts at epoch 0)")
        for name in ("shuffle", "drop_last"):
            if getattr(saved, name) != bool(getattr(self.sampler, name)):
                raise CheckpointError(
                    f"the checkpoint's data loader was built with {name}={getattr(saved, name)}, this one with "
                    f"{name}={getattr(self.sampler, name)}: the saved position means another order; build it as "
                    "it was saved")
        if not isinstance(self.sampler, ResumableSampler):
            raise CheckpointError("this DistributedLoader has no ResumableSampler to continue from a position; build "
                                  "it with ctx.dataloader")
        if saved.position and saved.position >= self.sampler.end_for(saved.epoch_world_size):
            raise CheckpointError(f"malformed data loader state: position {saved.position} is past the end of "
                                  f"epoch {saved.epoch}")
        batch_size = per_rank_batch(saved, world, int(self.batch_size or 0), self._on_change)
        if batch_size != self.batch_size:
            asked = int(self.batch_size or 0)
            self._set_batch_size(batch_size)
            if self._announce_pending:  # said once, with these figures, at the first iteration
                self._resized_from = (saved.world_size, asked)
            elif self.sampler.rank == 0:  # the loader's line was already said: this one supersedes it
                logger.info("dataloader resumed from {} rank(s): batch_size {} per rank x {} rank(s) = global batch "
                            "{} as saved, instead of the {} per rank asked", saved.world_size, batch_size, world,
                            batch_size * world, asked)
        elif batch_size * world != saved.global_batch and self.sampler.rank == 0:  # one line for the job
            logger.warning("dataloader resumed on {} rank(s) (saved on {}): global batch {} instead of the saved {} "
                           "(it does not divide over {} ranks; global_batch_change='continue'); same sample order",
                           world, saved.world_size, batch_size * world, saved.global_batch, world)
        self.sampler.seed = saved.seed
        self.sampler.resume_at(saved.epoch, saved.position, saved.epoch_world_size)
        self.sampler.set_epoch(saved.epoch)  # len(loader) is the resumed epoch's at once (a progress bar's total)
        self.next_epoch, self._pending = saved.epoch, False
        logger.debug("dataloader restored: epoch {}, {} of the epoch's positions consumed", saved.epoch, saved.position)

    def _set_batch_size(self, batch_size: int) -> None:
        # DataLoader forbids setting batch_size after __init__ because its batch sampler was built from it; both are
        # changed together here, before any iterator (which reads them when it is made) exists.
        object.__setattr__(self, "batch_size", batch_size)
        if self.batch_sampler is not None:
            self.batch_sampler.batch_size = batch_size  # type: ignore[attr-defined]

    # -- positions, for gather_for_metrics -------------------------------------------------------------------
    def _batch_len(self, k: int) -> int:
        bs = int(self.batch_size or 0)
        return max(0, min(bs, len(self.sampler) - k * bs))

    def at_last_batch(self) -> bool:
        """True while the batch just handed out is this epoch's last one."""
        return not self._done and self._batch >= 0 and self._batch == len(self) - 1

    def positions(self, rows: int) -> torch.Tensor:
        """Global sampler positions (``local_index * num_replicas + rank``) of ``rows`` per-sample results.

        The rows are either the current batch or everything from the start of the epoch up to now (e.g.
        predictions concatenated after the loop); the row count tells which.
        """
        k, bs = self._batch, int(self.batch_size or 0)
        if k < 0:
            raise ConfigError(
                "gather_for_metrics was called before this loader handed out a batch; call it inside the loop "
                "over the loader (per batch) or after it (on everything concatenated)"
            )
        batch = (k * bs, self._batch_len(k))
        so_far = (0, k * bs + batch[1])
        # During the epoch a row count matching the current batch means the batch; after it, the whole epoch.
        options = [batch, so_far] if not self._done else [so_far, batch]
        for start, count in options:
            if rows == count:
                local = torch.arange(start, start + count, dtype=torch.int64)
                return local * self.sampler.num_replicas + self.sampler.rank + self._start
        raise ConfigError(
            f"gather_for_metrics got {rows} rows, but the current batch of this loader has {batch[1]} samples "
            f"and the epoch so far has {so_far[1]}; pass per-sample results (batch dimension first) for the "
            "current batch, or for everything since the start of the epoch"
        )


def dataloader(
    dataset: Dataset,
    batch_size: int,
    make_sampler: Callable[..., DistributedSampler],
    *,
    rank: int,
    seed: int | None,
    device: torch.device,
    shuffle: bool = True,
    drop_last: bool = False,
    tracker: LastLoader | None = None,
    global_batch_change: GlobalBatchChange = "refuse",
    timer: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
    **kwargs: Any,
) -> DistributedLoader:
    """Build the ``DistributedLoader`` behind ``ctx.dataloader`` (see there).

    ``make_sampler(dataset, shuffle=..., drop_last=...)`` makes this rank's sampler (``ctx.sampler``).
    ``batch_size`` is per rank. ``pin_memory`` defaults to ``device.type == "cuda"`` and is dropped on other
    devices. Unless ``generator`` is
    passed, the workers' base seed comes from a generator seeded with ``(seed, rank, epoch)``: without it,
    identically seeded ranks would give their DataLoader workers identical random streams (the same
    "random" augmentation on every GPU). ``tracker``, ``timer``: the run's `LastLoader` and data-wait timer (see
    `DistributedLoader`). ``global_batch_change``: ``"refuse"`` (default) or ``"continue"``, when a restored global
    batch does not divide over the ranks (see `DistributedLoader.load_state_dict`).
    """
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            "ctx.dataloader shards a map-style dataset (one with __len__ and __getitem__) with a "
            "DistributedSampler; an IterableDataset must shard itself: read ctx.rank and ctx.world_size in its "
            "__iter__ and use torch.utils.data.DataLoader directly"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive int (samples per rank), got {batch_size!r}")
    for key in ("sampler", "batch_sampler", "shuffle"):
        if key in kwargs:
            raise ConfigError(
                f"ctx.dataloader makes its own DistributedSampler, so {key}= cannot be passed; use "
                "ctx.dataloader(dataset, batch_size, shuffle=...) or build a DataLoader with ctx.sampler(dataset)"
            )
    # The same order as ctx.sampler's DistributedSampler; resumable from a saved position (distfn/loader_state.py).
    sampler = ResumableSampler.like(make_sampler(dataset, shuffle=shuffle, drop_last=drop_last))
    if device.type != "cuda" and kwargs.get("pin_memory"):
        # Pinned memory only speeds up copies to a GPU; on a CPU rank torch warns once per rank that it is unused
        # (a script written for GPUs runs on CPUs unchanged, so drop it here instead).
        logger.debug("dataloader: pin_memory=True dropped on {} (it only helps copies to a GPU)", device)
        kwargs["pin_memory"] = False
    kwargs.setdefault("pin_memory", device.type == "cuda")
    inherited = multiprocessing.get_start_method(allow_none=True)
    if kwargs.get("num_workers", 0) > 0 and kwargs.get("multiprocessing_context") is None \
            and sys.platform == "linux" and inherited in ("spawn", "forkserver"):
        # A rank that distfn (or mp.spawn) started with spawn inherits spawn as its default start method, so every
        # epoch's DataLoader workers would re-import torch and the user's script (measured: 82 s instead of 7.6 s
        # for tests/test_data.py's 2-rank job). Fork is Linux's default for DataLoader workers, what a plain
        # script gets.
        kwargs["multiprocessing_context"] = "fork"
    seed_parts: tuple[int, int] | None = None
    if kwargs.get("generator") is None:
        # Without a run seed, torch.initial_seed() differs per process, except under fork where every rank
        # inherits the parent's: mixing in the rank keeps the workers' streams distinct either way.
        seed_parts = (torch.initial_seed() if seed is None else seed, rank)
        kwargs["generator"] = torch.Generator()
    loader = DistributedLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, seed_parts=seed_parts, tracker=tracker,
        global_batch_change=global_batch_change, timer=timer, **kwargs
    )
    loader._announce_pending = rank == 0  # logged at its first iteration, after any ctx.resume (`_announce`)
    return loader


# -- gather_for_metrics -----------------------------------------------------------------------------------------
def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    leaves = tree_leaves(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ConfigError(
                f"gather_for_metrics takes tensors (or dicts / lists / tuples of them), got {type(leaf).__name__}; "
                "for other Python objects use ctx.gather_object"
            )
    return leaves


def gather_for_metrics(
    value: Any,
    loader: DistributedLoader | None = None,
    *,
    device: torch.device | None = None,
    group: Any = None,
) -> Any:
    """Per-sample ``value`` from every rank, concatenated, without the sampler's padding duplicates.

    ``value`` is a tensor with the batch dimension first (or a dict / list / tuple of such tensors with the same
    number of rows), holding results for either the current batch of ``loader`` or everything since the start
    of the epoch (``ctx.gather_for_metrics`` passes the run's loader that handed out a batch most recently when
    none is named: `LastLoader`). With a loader,
    rows whose sampler position is past the end of the dataset (``DistributedSampler``'s padding) are dropped
    and the rest are put in the sampler's order, so with ``shuffle=False`` row ``i`` of the epoch's result is
    ``dataset[i]``. Without a distfn loader the ranks' rows are concatenated in rank order, unfiltered.
    ``device``: where tensors travel for the collective (CUDA for NCCL); results come back on the input's device.
    ``group``: the data-parallel ranks when a tensor-parallel mesh gives a tp group's ranks the same rows (they are
    gathered once, from the group of this rank's tp index); ``None``: the world.
    """
    leaves = _tensor_leaves(value)
    if not leaves:
        return value
    if any(leaf.dim() == 0 for leaf in leaves):
        raise ConfigError("gather_for_metrics needs per-sample tensors (batch dimension first); "
                          "for a scalar use ctx.all_reduce")
    rows = {leaf.shape[0] for leaf in leaves}
    if len(rows) != 1:
        raise ConfigError(f"gather_for_metrics: the tensors have different row counts {sorted(rows)}")
    n = rows.pop()
    positions: torch.Tensor | None = None
    if loader is not None:
        positions = loader.positions(n)
        keep = positions < len(loader.dataset)  # type: ignore[arg-type]
        if not bool(keep.all()):
            positions = positions[keep]
            leaves = [leaf[keep.to(leaf.device)] for leaf in leaves]
    if collectives.active():
        leaves, everyone = collectives.gather_rows(leaves, positions, device=device, group=group)
        if everyone is not None:
            order = torch.argsort(everyone)
            leaves = [g[order.to(g.device)] for g in leaves]
    return tree_unflatten(value, leaves)
