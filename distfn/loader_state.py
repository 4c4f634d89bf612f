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
_BOOL_FIELDS: Final = ("shuffle", "drop_last")
#: The bounds a state is checked against at the load (a saved state is untrusted input: a value past them would
#: pass the load and fail at the first batch, `OverflowError` or `MemoryError`). ``DistributedSampler`` seeds its
#: generator with ``seed + epoch``, which must stay below 2**64 (2**63 + 2**62 leaves every later epoch room).
MAX_SEED: Final = 2**63 - 1
MAX_EPOCH: Final = 2**62
#: Ranks of the job that saved: over 1,000 times the largest jobs run; an epoch's order has ``len + ranks``
#: positions at most, allocated at the first batch.
MAX_WORLD_SIZE: Final = 2**20
#: Samples per step over all ranks (torch's ``BatchSampler`` allocates a list of a batch's size).
MAX_GLOBAL_BATCH: Final = 2**24
#: ``len(dataset)`` (sampler positions are int64 tensors).
MAX_DATASET_LEN: Final = 2**63 - 1
_LIMITS: Final = {"epoch": MAX_EPOCH, "position": MAX_DATASET_LEN + MAX_WORLD_SIZE, "batches": MAX_DATASET_LEN,
                  "seed": MAX_SEED, "global_batch": MAX_GLOBAL_BATCH, "world_size": MAX_WORLD_SIZE,
                  "epoch_world_size": MAX_WORLD_SIZE, "dataset_len": MAX_DATASET_LEN}
_AT_LEAST_ONE: Final = ("global_batch", "world_size", "epoch_world_size")


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
        """The state ``to_dict`` wrote, checked field by field and against the bounds (`MAX_EPOCH`, ...) and
        itself: every value a dataset can mean, so that nothing fails later at the first batch.

        Raises:
            CheckpointError: not a mapping, a field missing, of the wrong type or out of its bounds, an unknown
                field, a position past its epoch's end, or a newer format.
        """
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"a data loader's state is a mapping, got {type(saved).__name__}")
        keys = list(saved)
        if not all(isinstance(k, str) for k in keys):
            raise CheckpointError("malformed data loader state: its keys are not all strings")
        version = saved.get("format", _FORMAT)
        if type(version) is not int or version != _FORMAT:  # 1.0 or True is not format 1 either
            shown = repr(version) if isinstance(version, (int, float, str)) else type(version).__name__
            raise CheckpointError(f"this data loader state has format {_short(shown)}; this distfn reads format "
                                  f"{_FORMAT} (upgrade distfn to resume from it)")
        missing = [k for k in (*_INT_FIELDS, *_BOOL_FIELDS) if k not in saved]
        if missing:
            raise CheckpointError(f"not a data loader state: {', '.join(missing)} missing (keys: "
                                  f"{_short(', '.join(keys[:20]))})")
        unknown = [k for k in keys if k not in (*_INT_FIELDS, *_BOOL_FIELDS, "format")]
        if unknown:
            raise CheckpointError(f"malformed data loader state: unknown field(s) {_short(', '.join(unknown[:5]))}")
        bad = [f"{k}={_shown(saved[k])} (a bool)" for k in _BOOL_FIELDS if type(saved[k]) is not bool]
        for k in _INT_FIELDS:
            value, low = saved[k], 1 if k in _AT_LEAST_ONE else 0
            if type(value) is not int:
                bad.append(f"{k}={_shown(value)} (an int)")
            elif not low <= value <= _LIMITS[k]:
                bad.append(f"{k}={_shown(value)} (from {low} to {_LIMITS[k]})")
        if bad:
            raise CheckpointError(f"malformed data loader state: {'; '.join(bad)}")
        state = cls(**{k: saved[k] for k in (*_INT_FIELDS, *_BOOL_FIELDS)})
        end = _tail_size(state.dataset_len, state.epoch_world_size, state.drop_last)
        if state.position and state.position >= end:
            raise CheckpointError(f"malformed data loader state: position {state.position} is past the end of epoch "
                                  f"{state.epoch} ({end} positions of {state.dataset_len} samples on "
                                  f"{state.epoch_world_size} ranks)")
        if state.batches != state.position // state.global_batch:
            raise CheckpointError(f"malformed data loader state: batches={state.batches} is not position "
                                  f"{state.position} // global batch {state.global_batch}")
        return state


def _shown(value: Any) -> str:
    """A field's value for an error message: an int (however large) by its size, anything else by type."""
    if type(value) is int:
        return str(value) if abs(value) < 10**30 else f"an int of {value.bit_length()} bits"
    if isinstance(value, (bool, float)) or value is None:
        return repr(value)
    return type(value).__name__


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."


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
