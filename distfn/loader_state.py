"""A data loader's position as savable state, and the sampler that starts an epoch from such a position.

Why the position is *global*: ``DistributedSampler`` draws one permutation per epoch from ``seed + epoch`` alone
(the number of ranks only decides the padding or truncation of its tail) and gives rank ``r`` the positions
``r, r + W, r + 2W, ...`` of it. With ``B`` samples per rank, step ``k`` of the whole job therefore consumes the
contiguous run ``[k*B*W, (k+1)*B*W)`` of that permutation: the *global batch*. So "where the job is" is one number
per epoch, the count of positions already consumed, and it means the same thing on any number of ranks. A resumed
epoch (`ResumableSampler.resume_at`) continues from that position: the rest of the saved world's order is split
across the new ranks the same interleaved way, so each remaining global batch holds the same samples.

Nothing here iterates the data: a resume costs one permutation, not a replay of the skipped batches.
Used by `distfn.data` (``DistributedLoader.state_dict`` / ``load_state_dict``); imports only torch and the errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs
import torch
from torch.utils.data import Dataset, DistributedSampler

from .errors import CheckpointError

__all__ = ["GlobalBatchChange", "LoaderState", "ResumableSampler", "epoch_order", "per_rank_batch"]

#: What a resumed loader does when the saved global batch does not divide over the new ranks: ``"refuse"`` raises
#: `CheckpointError`; ``"continue"`` keeps the loader's own per-rank batch (the global batch changes; same order).
GlobalBatchChange: TypeAlias = Literal["refuse", "continue"]
GLOBAL_BATCH_CHANGES: Final = ("refuse", "continue")

#: The version of the saved mapping; a newer one is refused rather than misread.
_FORMAT: Final = 1
_INT_FIELDS: Final = ("epoch", "position", "batches", "seed", "global_batch", "world_size", "epoch_world_size",
                      "dataset_len")


def _tail_size(n: int, world: int, drop_last: bool) -> int:
    """How many positions an epoch of ``n`` samples has on ``world`` ranks (``DistributedSampler.total_size``)."""
    if drop_last and n % world:
        return (n // world) * world
    return math.ceil(n / world) * world


def _pad_or_cut(indices: list[int], size: int) -> list[int]:
    """``indices`` cut to ``size``, or padded to it by repeating them from the start (``DistributedSampler``'s
    rule: padding duplicates the first samples, as many times over as it takes)."""
    if size <= len(indices) or not indices:
        return indices[:size]
    return (indices * math.ceil(size / len(indices)))[:size]


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool, world_size: int, drop_last: bool) -> list[int]:
    """The whole job's visit order of one epoch: the list whose position ``p`` rank ``p % world_size`` reads.

    The permutation depends on ``seed`` and ``epoch`` only; ``world_size`` and ``drop_last`` decide the tail
    (padded with the first samples, or cut, to a multiple of ``world_size``), exactly as ``DistributedSampler``
    (tests/test_exact_resume.py holds the two equal).
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    return _pad_or_cut(indices, _tail_size(n, world_size, drop_last))


@attrs.frozen
class LoaderState:
    """Where a ``ctx.dataloader`` is, as every rank sees it (what ``loader.state_dict()`` saves).

    Attributes:
        epoch: the epoch the next batch belongs to.
        position: positions of that epoch's order already consumed by the whole job (a multiple of the global
            batch; 0 at an epoch boundary).
        batches: global batches consumed in that epoch (``position // global_batch``; for people reading it).
        seed: the shuffle seed.
        shuffle: whether the order is shuffled.
        drop_last: whether the tail is cut instead of padded.
        global_batch: samples per step over all ranks.
        world_size: ranks of the job that saved.
        epoch_world_size: the world size whose tail rule defines this epoch's order (``world_size``, unless the
            epoch itself was resumed on another number of ranks).
        dataset_len: ``len(dataset)``; a loader over another length cannot continue from this position.
    """

    epoch: int
    position: int
    batches: int
    seed: int
    shuffle: bool
    drop_last: bool
    global_batch: int
    world_size: int
    epoch_world_size: int
    dataset_len: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-able ints and bools (saved in the checkpoint's metadata tree, no tensor, no pickle)."""
        return {"format": _FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> LoaderState:
        """The state ``to_dict`` wrote, checked field by field.

        Raises:
            CheckpointError: a field missing or of the wrong type, or a newer format.
        """
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"a data loader's state is a mapping, got {type(saved).__name__}")
        if saved.get("format", _FORMAT) != _FORMAT:
            raise CheckpointError(f"this data loader state has format {saved.get('format')!r}; this distfn reads "
                                  f"format {_FORMAT} (upgrade distfn to resume from it)")
        missing = [k for k in (*_INT_FIELDS, "shuffle", "drop_last") if k not in saved]
        if missing:
            raise CheckpointError(f"not a data loader state: {', '.join(missing)} missing (keys: "
                                  f"{', '.join(map(str, saved))})")
        bad = [k for k in _INT_FIELDS if isinstance(saved[k], bool) or not isinstance(saved[k], int) or saved[k] < 0]
        bad += [k for k in ("shuffle", "drop_last") if not isinstance(saved[k], bool)]
        if bad or saved["global_batch"] < 1 or saved["world_size"] < 1 or saved["epoch_world_size"] < 1:
            raise CheckpointError(f"malformed data loader state: {', '.join(bad) or 'sizes'} "
                                  f"({ {k: saved[k] for k in bad} or dict(saved)})")
        return cls(**{k: saved[k] for k in (*_INT_FIELDS, "shuffle", "drop_last")})


def per_rank_batch(saved: LoaderState, world_size: int, batch_size: int, on_change: GlobalBatchChange) -> int:
    """The per-rank batch that keeps the saved global batch on ``world_size`` ranks.

    Returns ``saved.global_batch // world_size`` when it divides; otherwise ``batch_size`` (the loader's own,
    the global batch changes) with ``on_change="continue"``.

    Raises:
        CheckpointError: the global batch cannot be kept and ``on_change="refuse"``.
    """
    if saved.global_batch % world_size == 0:
        return saved.global_batch // world_size
    line = (f"the checkpoint's global batch {saved.global_batch} (saved on {saved.world_size} ranks) does not divide "
            f"over {world_size} ranks")
    if on_change == "refuse":
        raise CheckpointError(f"{line}; pass ctx.dataloader(..., global_batch_change='continue') to go on with "
                              f"{batch_size} per rank (global batch {batch_size * world_size}, the same sample "
                              "order), or resume on a number of ranks that divides it")
    return batch_size


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start one epoch at a global position of another world size's order.

    Without `resume_at` it is ``DistributedSampler`` unchanged (same order, same length). After
    ``resume_at(epoch, position, epoch_world)`` the iteration of that epoch yields this rank's share of
    ``epoch_order(..., world_size=epoch_world)[position:]``: that remainder is padded (or cut, with ``drop_last``)
    to a multiple of this job's ranks and read interleaved, so each global batch of it equals the saved job's.
    Other epochs are unaffected.
    """

    def __init__(self, dataset: Dataset, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.n = len(dataset)  # type: ignore[arg-type]
        self._resume: tuple[int, int, int] | None = None  # (epoch, position, epoch world size)

    @classmethod
    def like(cls, sampler: DistributedSampler) -> ResumableSampler:
        """A resumable copy of ``sampler`` (same dataset, ranks, seed, shuffle and drop_last)."""
        return cls(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
                   seed=sampler.seed, drop_last=sampler.drop_last)

    def resume_at(self, epoch: int, position: int, epoch_world: int) -> None:
        """Make epoch ``epoch`` start at ``position`` of the order of ``epoch_world`` ranks."""
        self._resume = (epoch, position, epoch_world) if position > 0 else None

    def clear(self) -> None:
        """Forget the resume position (every epoch starts at its beginning again)."""
        self._resume = None

    def start_of(self, epoch: int) -> tuple[int, int]:
        """``(position, epoch world size)`` epoch ``epoch`` starts at: ``(0, num_replicas)`` unless resumed."""
        if self._resume is not None and self._resume[0] == epoch:
            return self._resume[1], self._resume[2]
        return 0, self.num_replicas

    def offset(self) -> tuple[int, int]:
        """`start_of` the current epoch (the one ``set_epoch`` set)."""
        return self.start_of(self.epoch)

    def end_for(self, epoch_world: int) -> int:
        """Positions of an epoch's order when ``epoch_world`` ranks' tail rule defines it."""
        return _tail_size(self.n, epoch_world, self.drop_last)

    def end(self) -> int:
        """Positions of the current epoch's order (the saved world's tail rule in a resumed epoch)."""
        return self.end_for(self.offset()[1])

    def _remaining(self) -> int:
        """Positions left in the current epoch after its start, padded or cut to a multiple of the ranks."""
        left = self.end() - self.offset()[0]
        return _tail_size(left, self.num_replicas, self.drop_last) if left > 0 else 0

    def __len__(self) -> int:
        if self.offset()[0] == 0:
            return super().__len__()
        return self._remaining() // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        start, world = self.offset()
        if start == 0:
            return super().__iter__()
        order = epoch_order(self.n, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, world_size=world,
                            drop_last=self.drop_last)
        rest = _pad_or_cut(order[start:], self._remaining())
        return iter(rest[self.rank::self.num_replicas])
