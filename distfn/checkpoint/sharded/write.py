"""Writing a sharded checkpoint: every rank streams its own shard file; rank 0 writes the index and commits.

Layout of ``ckpt-1200/`` (`distfn.checkpoint.sharded.spec`, docs/checkpoints.md "Sharded checkpoints"): one shard
per writing rank (its slice of every sharded ``DTensor`` plus its share of the replicated tensors, each written by
one rank, spread so that every rank writes about as many bytes), and the Hugging Face index
(``{"metadata": {...}, "weight_map": {name: file}}``) whose metadata also holds the saved object's JSON tree
(`distfn.checkpoint.format`), the tied names, ``metadata=`` and every tensor's full dtype and shape.

One small collective plans who writes which piece and carries what the caller sends along (a `Rider`:
``ctx.save`` brings every rank's random streams of its last ``ctx.step`` this way, in no collective of their own);
each rank's file is streamed from its tensors by distfn's own writer (`distfn.checkpoint.storage`: no in-memory
copy of the shard; torch's ``HuggingFaceStorageWriter`` first builds every file in memory and was measured 1.55x
slower than DCP's default writer); the directory is a hidden temporary one until the index is in it and it is
committed under its name. No pickle is written.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from loguru import logger

from ... import collectives, tree
from ...errors import CheckpointError
from .. import format as fmt
from .. import storage
from ..background import DEFAULT, Saves
from ..layout import INDEX, SUFFIX, Location, check_keep, resolve, rotate
from ..objects import is_object, state_of
from .spec import DCP_VERSION, KEY_LAYOUT, KEY_TENSORS, KEY_WORLD, PARTIAL, SAVED_OFFSETS, SHARDING_INFO, shard_file

__all__ = ["Rider", "remove_partials", "save"]


def remove_partials(directory: Location) -> None:
    """Remove the hidden directories of sharded saves whose rank 0 (on this host) no longer runs.

    A killed save leaves ``.<name>.<host>.<pid>.<random>.distfn-partial``; it is never a checkpoint (`latest`
    skips hidden names) and the next save into the same parent removes it (a file save's too). Another host's or
    a live writer's directory is left alone (`distfn.checkpoint.storage.dead_leftovers`).
    """
    storage.remove_stale_tmps(directory)  # and the temporary files of killed file saves


@attrs.frozen
class Rider:
    """A value each rank sends along in the save's planning collective, and the state's last entries made of them.

    Why: ``ctx.save`` writes every rank's random streams of its last ``ctx.step``, which live on each rank; a
    gather of their own cost a sharded save a second object all-gather (14 ms of 96 on rank 0, issue 45 item 5),
    while the planning's all-gather, which every rank makes anyway, can carry them. Every rank gets the same
    gathered list, so every rank builds the same entries and plans their tensors alike (held by every rank, each
    written once, spread like any replicated tensor).

    Attributes:
        own: this rank's value (picklable; it travels in ``all_gather_object``).
        entries: every rank's ``own``, in rank order -> the top-level entries to write after the state's (which
            must be a mapping with str keys), or ``None`` for none; it must give the same answer on every rank.
        replaces: the state's top-level keys that are dropped when ``entries`` gives some (kept, last, otherwise).
    """

    own: Any
    entries: Callable[[list[Any]], Mapping[str, Any] | None]
    replaces: frozenset[str] = frozenset()


def _encode(obj: Any, metadata: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(the index's distfn metadata, ``{stored name: tensor}``) for ``obj``; tensors may be ``DTensor`` s.

    The tree is encoded by `distfn.checkpoint.format.plan` exactly as for one file, with a one-element stand-in
    per distinct tensor (so sharded tensors pass, nothing is copied, and tied tensors are still stored once).
    """
    states = tree.tree_map(state_of, obj, is_leaf=is_object)
    real: dict[int, torch.Tensor] = {}
    memo: dict[Any, torch.Tensor] = {}

    def stand_in(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        key = fmt.memory_key(t)  # tied tensors: one stand-in, stored once
        if key not in memo:
            ph = torch.zeros(1, dtype=t.dtype)
            memo[key] = ph
            real[ph.data_ptr()] = t
        return memo[key]

    plan = fmt.plan(tree.tree_map(stand_in, states), metadata)
    header = json.loads(plan.header[8:])
    meta: dict[str, str] = dict(header["__metadata__"])
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, Any] = {}
    for e in plan.entries:
        t = real.get(e.tensor.data_ptr(), e.tensor)
        tensors[e.name] = t  # detached by `_pieces`, after to_local: a DTensor's own detach costs 30 us
        shapes[e.name] = {"dtype": e.code, "shape": [int(s) for s in t.shape]}
    meta[KEY_TENSORS] = json.dumps(shapes, separators=(",", ":"))
    meta[KEY_LAYOUT] = "sharded"
    return meta, tensors


@attrs.frozen
class _Encoded:
    """A part of the saved state, encoded: the index's distfn metadata and ``{stored name: tensor}`` (`_encode`)."""

    meta: dict[str, str]
    tensors: dict[str, torch.Tensor]

    def then(self, more: _Encoded | None) -> _Encoded:
        """This part with ``more``'s top-level entries after its own: the metadata ``_encode`` gives the whole.

        Both trees are mappings with str keys and disjoint names (the caller's split), encoded as compact JSON
        objects, so splicing the text gives what one encoding of the whole writes, byte for byte, without parsing
        a large state's tree again (the tensors' shapes, one small entry per tensor, are listed again in file
        order). A tensor name in both (a key with dots, such as ``"rng.ranks"``) is refused as
        the one encoding refuses it."""
        if more is None:
            return self
        clash = sorted(self.tensors.keys() & more.tensors.keys())
        if clash:
            raise CheckpointError(f"two values would be stored under the same tensor name '{clash[0]}'; rename the "
                                  "state's key. Nothing was written.")
        meta = dict(self.meta)
        for key in (fmt.KEY_TREE, fmt.KEY_ALIASES):
            if key in more.meta:
                meta[key] = _splice(meta[key], more.meta[key]) if key in meta else more.meta[key]
        # the tensors in the order one encoding lists them (`fmt.layout`'s file order), with their shapes
        tensors = dict(sorted({**self.tensors, **more.tensors}.items(), key=lambda i: (-i[1].element_size(), i[0])))
        shapes = {**json.loads(self.meta[KEY_TENSORS]), **json.loads(more.meta[KEY_TENSORS])}
        meta[KEY_TENSORS] = json.dumps({n: shapes[n] for n in tensors}, separators=(",", ":"))
        return _Encoded(meta, tensors)


def _splice(first: str, second: str) -> str:
    """Two compact JSON objects with disjoint keys as one (``second``'s keys last)."""
    if first == "{}" or second == "{}":
        return second if first == "{}" else first
    return f"{first[:-1]},{second[1:]}"


def _split(obj: Any, rider: Rider | None) -> tuple[Any, Any]:
    """``(the state without the rider's keys, those entries or None)``: what is planned before the planning
    collective, apart from what its answer may replace."""
    if rider is None:
        return obj, None
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and not k.startswith("__") for k in obj):
        raise CheckpointError("a sharded save with a rider (ctx.save's random streams) needs a state mapping with "
                              "str keys, such as {'model': model, 'optimizer': opt}")
    base = {k: v for k, v in obj.items() if k not in rider.replaces}
    kept = {k: v for k, v in obj.items() if k in rider.replaces}
    return base, (kept or None)


def _encode_plain(obj: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """`_encode` of a value of plain containers, scalars and plain tensors only (a `Rider`'s entries: random
    states and per-rank values), in one walk: no state objects to ask and no ``DTensor`` to stand in for, so the
    two tree walks of `_encode` are skipped (they cost 26 ms of a 4-rank state's streams per save, for the
    lists of 625 ints that a random state is)."""
    plan = fmt.plan(obj, None)
    meta: dict[str, str] = dict(json.loads(plan.header[8:])["__metadata__"])
    tensors = {e.name: e.tensor for e in plan.entries}
    meta[KEY_TENSORS] = json.dumps({e.name: {"dtype": e.code, "shape": list(e.shape)} for e in plan.entries},
                                   separators=(",", ":"))
    meta[KEY_LAYOUT] = "sharded"
    return meta, tensors


def _rank_world() -> tuple[int, int, bool]:
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size(), True) if on else (0, 1, False)


def _publish(tmp: Location, target: Location) -> None:
    """Commit the complete temporary directory as ``target`` (an older checkpoint there is moved aside first)."""
    store, old = target.fs, None
    if tmp.path == target.path:  # written in place (an object store): its index, committed last, made it visible
        store.commit(tmp.path, target.path)
        return
    if store.is_link(target.path) or target.layout() == "file":
        store.remove(target.path)
    elif target.layout() != "missing":
        old = storage.tmp_name(target, PARTIAL)
        store.rename(target.path, old.path)
    store.commit(tmp.path, target.path)
    if old is not None:
        store.remove_tree(old.path)


def save(
    obj: Any,
    path: str | os.PathLike[str] | Location,
    *,
    saves: Saves | None = None,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    blocking: bool = True,
    rider: Rider | None = None,
    hook: AbstractContextManager[Any] | None = None,
) -> pathlib.PurePath:
    """Write ``obj`` as a sharded checkpoint directory; **every rank** calls it (a collective) and writes its shards.

    Outside a process group it writes one shard. Sharded models and optimizers (FSDP2 ``DTensor`` s) are written
    by every rank as its own slices, never gathered; replicated tensors are written once, spread over the ranks
    that hold them so that every rank writes about as many bytes.

    Args:
        obj: what `distfn.checkpoint.save` accepts (modules, optimizers, schedulers, tensors, JSON-like values).
        path: the directory to create (missing parents are created; an older checkpoint there is replaced).
        saves: the background writer (its pending save is waited for first; ``blocking=False`` hands it the
            write): ``ctx.save`` passes its context's; by default the process's `background.DEFAULT`.
        metadata: JSON-like values stored in the index.
        keep: with a step-numbered name (``ckpt-1200``), keep only the ``keep`` newest such directories.
        blocking: ``False`` returns once this rank's pieces are copied to host memory (buffers reused between
            saves, pinned for GPU tensors); the writing, the index and the commit finish in a background thread.
        rider: what every rank sends along in the planning collective, and the entries made of it (`Rider`;
            ``ctx.save``'s random streams).
        hook: entered around the planning collective (``ctx.save``: the run's ``run.collective(...)``, so that the
            ledger and a hang report name it).

    Returns:
        The directory, absolute (the same on every rank: different paths on different ranks are an error).

    Raises:
        CheckpointError: a value that cannot be stored (before anything is written), a bad ``keep``, ranks naming
            different directories, or a failed write on any rank (raised on every rank; the previous checkpoint
            is then intact and the partial directory removed).
    """
    target = resolve(path)
    saves = DEFAULT if saves is None else saves
    check_keep(keep, target, directory=True)
    if target.name.endswith(SUFFIX):
        raise CheckpointError(f"a sharded checkpoint is a directory: '{target}' ends in .safetensors (drop the "
                              "suffix, or save one file with sharded=False)")
    saves.wait()  # the previous save first: its collectives must not interleave with this one's
    base, kept = _split(obj, rider)
    job, encoded = _plan_shards(_Encoded(*_encode(base, metadata)), target, saves.cpu_group(),
                                kept=None if kept is None else _Encoded(*_encode(kept, None)), rider=rider, hook=hook)
    meta = encoded.meta
    if blocking:
        job.write()
        job.finish(meta, keep)
        logger.debug("saved sharded checkpoint {} ({} tensors, {} ranks)", target, len(encoded.tensors), job.world)
        return target.path
    if job.mine:  # this rank's file, copied once into one host buffer laid out like the file (the writer's input)
        job = attrs.evolve(job, image=saves.stage_file(job.plan()))

    def write_and_finish() -> None:
        job.write()
        job.finish(meta, keep)
        logger.debug("saved sharded checkpoint {} in the background ({} ranks)", target, job.world)

    saves.submit(str(target), write_and_finish)
    return target.path


# --------------------------------------------------------------------------------------------------
# Who writes what


@attrs.frozen
class _Piece:
    """What one rank holds of one stored tensor: its local tensor and where it sits in the full one."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


def _pieces(tensors: Mapping[str, torch.Tensor]) -> dict[str, _Piece]:
    """This rank's piece of every tensor: a ``DTensor``'s local shard at its offsets in the full tensor (nothing
    when the shard is empty), or a plain tensor whole. Every piece is checked to be storable here, before any
    collective, so a bad value fails on every rank alike.

    Runs at every save over every tensor (a 2-D mesh's optimizer state too), so the per-tensor work is kept to the
    lookups: one ``no_grad`` around the loop (``to_local`` records no autograd) and the rank read once (it keys
    `_offsets`' memo); entering the one and reading the other per tensor took 200 DTensors 2.1 ms instead of 1.3
    (best of 30, one process).
    """
    out: dict[str, _Piece] = {}
    rank = _rank_world()[0]
    with torch.no_grad():
        for name, t in tensors.items():
            if hasattr(t, "placements"):
                dtensor: Any = t
                local = dtensor.to_local().detach()
                if local.numel() == 0 and t.numel() != 0:
                    continue  # this rank holds none of it (an uneven split)
                piece = _Piece(local, _offsets(name, dtensor, local, rank))
            else:
                piece = _Piece(t.detach(), (0,) * t.dim())
            fmt.entry(name, piece.tensor)  # raises the format's CheckpointError for what safetensors cannot hold
            out[name] = piece
    return out


#: `_offsets` by layout: a save of the same state (names, shapes, placements) computes none of them again.
_OFFSETS: dict[tuple[Any, ...], tuple[int, ...]] = {}
_OFFSETS_MAX: Final = 65_536  # entries; more layouts than that in one process start the memo afresh


def _offsets(name: str, dtensor: Any, local: torch.Tensor, rank: int) -> tuple[int, ...]:
    """Where this rank's shard of ``dtensor`` starts in the full tensor, by DCP's protocol
    (``__create_chunk_list__``: one chunk for every DTensor layout), memoised by layout.

    The chunk list costs 0.2 ms per tensor (DTensor's shape arithmetic in Python): 40 ms per save of a 200-tensor
    state, every save, though it only changes with the layout. The key is everything the offsets depend on: the
    rank (``rank``, this process's in the default group), the mesh, the placements, the full shape and strides
    and the local tensor's type.
    """
    key = (rank, dtensor.device_mesh, tuple(dtensor.placements), tuple(dtensor.shape), tuple(dtensor.stride()),
           type(local))
    found = _OFFSETS.get(key)
    if found is not None:
        return found
    chunks = dtensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise CheckpointError(f"cannot save '{name}': its local shard has {len(chunks)} chunks (distfn "
                              "writes one per rank)")
    if len(_OFFSETS) >= _OFFSETS_MAX:
        _OFFSETS.clear()
    offsets = _OFFSETS[key] = tuple(int(o) for o in chunks[0].offsets)
    return offsets


_Key = tuple[str, tuple[int, ...]]  # a piece: (stored name, offsets in the full tensor)


def _assign(summaries: list[list[tuple[str, tuple[int, ...], int]]]) -> dict[_Key, tuple[int, int]]:
    """``(writer rank, bytes)`` of each piece: its only holder, or (replicated pieces, largest first) the holder
    with the fewest bytes so far. Every rank computes the same answer from the same summaries."""
    holders: dict[_Key, list[int]] = {}
    size: dict[_Key, int] = {}
    for rank, pieces in enumerate(summaries):
        for name, offsets, nbytes in pieces:
            holders.setdefault((name, offsets), []).append(rank)
            size[(name, offsets)] = nbytes
    load = [0] * len(summaries)
    owner: dict[_Key, tuple[int, int]] = {}
    for key in sorted(holders, key=lambda k: (len(holders[k]) > 1, -size[k], k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        owner[key] = (rank, size[key])
        load[rank] += size[key]
    return owner


@attrs.frozen
class _ShardJob:
    """One sharded save as every rank sees it after planning: where to write, what this rank writes, and the
    index rank 0 will write. `write` then `finish` (in the caller, or in the background thread)."""

    target: Location
    tmp: Location
    rank: int
    world: int
    group: Any  # the gloo group of the collectives, or None outside a process group
    mine: dict[str, _Piece]  # the pieces this rank writes
    weight_map: dict[str, str]
    total: int
    error: list[str | None] = attrs.field(factory=lambda: [None])
    #: This rank's whole file staged in host memory (`Saves.stage_file`) by an asynchronous save, else ``None``.
    image: memoryview | None = None

    def plan(self) -> fmt.Plan:
        """The layout of this rank's shard file (its header and tensors in file order)."""
        info = {name: {SAVED_OFFSETS: list(p.offsets)} for name, p in self.mine.items()}
        meta = {"format": "pt", SHARDING_INFO: json.dumps(info, separators=(",", ":")), DCP_VERSION: "1.0"}
        return fmt.layout([fmt.entry(name, p.tensor) for name, p in self.mine.items()], meta)

    def write(self) -> None:
        """Write this rank's shard file (streamed from the tensors, or the staged image; durable); a failure is
        kept for `finish`."""
        if not self.mine:
            return
        try:
            if self.image is not None:
                storage.write_image(self.image, self.tmp.child(shard_file(self.rank)))
            else:
                storage.write(self.plan(), self.tmp.child(shard_file(self.rank)))
        except (CheckpointError, OSError) as exc:
            self.error[0] = f"rank {self.rank} on {socket.gethostname()}: {exc}"

    def finish(self, meta: dict[str, str], keep: int | None) -> None:
        """Every rank reports; rank 0 writes the index and commits the directory (or removes it when any rank
        failed); every rank returns, or raises the same `CheckpointError`."""
        store = self.target.fs
        try:
            errors = collectives.gather_object(self.error[0], group=self.group)
        except BaseException:  # a rank died mid-save: its partial directory goes now, not at the next save
            if self.rank == 0:
                store.remove_tree(self.tmp.path)
            raise
        outcome = "; ".join(e for e in errors if e) or None
        if self.rank == 0:
            try:
                if outcome is None:
                    self._write_index(meta)
                    _publish(self.tmp, self.target)
            except (OSError, CheckpointError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            if outcome is not None:
                store.remove_tree(self.tmp.path)
            elif keep is not None:
                rotate(self.target, keep)
        outcome = collectives.broadcast_object(outcome, group=self.group)
        if outcome is not None:
            raise CheckpointError(f"cannot save '{self.target}': {outcome}. The previous checkpoint, if any, is "
                                  "intact.")

    def _write_index(self, meta: dict[str, str]) -> None:
        index = {"metadata": {"total_size": self.total, **meta, KEY_WORLD: str(self.world)},
                 "weight_map": self.weight_map}
        # the index goes in last: the directory is complete only with it
        storage.write_bytes(json.dumps(index, indent=1, ensure_ascii=False).encode(), self.tmp.child(INDEX))


def _make_tmp(target: Location) -> str:
    """Rank 0: create the hidden temporary directory next to ``target`` (`distfn.checkpoint.fs.FileSystem.stage_dir`:
    an object store writes ``target`` itself); the name of the directory the ranks write into."""
    try:
        storage.make_parents(target)
        remove_partials(target.parent)
        tmp = storage.tmp_name(target, PARTIAL)
        staged = target.fs.stage_dir(tmp.path, target.path)  # tmp itself, or (object stores) the target
    except OSError as exc:
        raise CheckpointError(f"cannot create the checkpoint directory next to '{target}': {exc}") from exc
    return staged.name


def _plan_shards(encoded: _Encoded, target: Location, group: Any, *, kept: _Encoded | None = None,
                 rider: Rider | None = None, hook: AbstractContextManager[Any] | None = None,
                 ) -> tuple[_ShardJob, _Encoded]:
    """Plan a sharded save with one collective: every rank's pieces, its target (they must agree), rank 0's
    temporary directory and the ``rider``'s value are gathered, and every rank derives the same assignment, index,
    file names and rider entries. Returns the job and the whole state's encoding (``encoded``, then ``kept`` or
    the rider's entries)."""
    rank, world, _ = _rank_world()
    error, tmp_name = None, ""
    try:
        pieces = _pieces(encoded.tensors if kept is None else {**encoded.tensors, **kept.tensors})
    except CheckpointError as exc:
        error, pieces = str(exc), {}
    if rank == 0 and error is None:
        try:
            tmp_name = _make_tmp(target)
        except CheckpointError as exc:
            error = str(exc)
    summary = [(n, p.offsets, p.tensor.numel() * p.tensor.element_size()) for n, p in pieces.items()]
    gathered = _gather((error, tmp_name, summary, str(target), None if rider is None else rider.own), target,
                       tmp_name, group, hook)
    errors = [e for e, _, _, _, _ in gathered if e]
    paths = [p for _, _, _, p, _ in gathered]
    if not errors and len(set(paths)) > 1:
        errors = [_different_paths(paths)]
    summaries = [s for _, _, s, _, _ in gathered]
    if not errors:
        try:  # every rank alike: the same gathered values give the same entries
            encoded, pieces, summaries = _with_rider(encoded, kept, rider, [r for *_, r in gathered], pieces,
                                                     summaries)
        except CheckpointError as exc:
            errors = [str(exc)]
    if errors:
        if tmp_name:
            target.fs.remove_tree(target.parent.child(tmp_name).path)
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else "; ".join(errors))
    owner = _assign(summaries)
    missing = sorted(set(encoded.tensors) - {name for name, _ in owner})
    if missing:  # a tensor no rank holds any of: the ranks were not saving the same state
        raise CheckpointError(f"cannot save '{target}': no rank holds {fmt.describe(missing)}; every rank must "
                              "save the same state")
    first: dict[str, str] = {}
    for (name, _), (writer, _) in sorted(owner.items()):
        first.setdefault(name, shard_file(writer))  # the file with the piece at the lowest offsets
    job = _ShardJob(target=target, tmp=target.parent.child(gathered[0][1]), rank=rank, world=world, group=group,
                    mine={n: p for n, p in pieces.items() if owner[(n, p.offsets)][0] == rank},
                    weight_map=dict(sorted(first.items())), total=sum(n for _, n in owner.values()))
    return job, encoded


def _gather(item: Any, target: Location, tmp_name: str, group: Any, hook: AbstractContextManager[Any] | None
            ) -> list[Any]:
    """The planning all-gather, inside ``hook``; when it fails (or the hook raises first: a rank that skipped a
    checkpoint call), rank 0's temporary directory is removed now, not left until the process ends."""
    try:
        with nullcontext() if hook is None else hook:
            return collectives.gather_object(item, group=group)
    except BaseException:
        if tmp_name:
            target.fs.remove_tree(target.parent.child(tmp_name).path)
        raise


_Summary = list[tuple[str, tuple[int, ...], int]]  # one rank's pieces: (stored name, offsets, bytes)


def _with_rider(encoded: _Encoded, kept: _Encoded | None, rider: Rider | None, riders: list[Any],
                pieces: dict[str, _Piece], summaries: list[_Summary],
                ) -> tuple[_Encoded, dict[str, _Piece], list[_Summary]]:
    """The whole state's encoding, this rank's pieces and every rank's summary once the rider's values are in:
    the state's own entries (``kept``) when the rider gives none, else its entries in their place, whose tensors
    every rank holds (the same gathered values), planned as replicated pieces: each written once, by the rank
    `_assign` picks, as they were when a gather of their own made them every rank's before planning."""
    entries = None if rider is None else rider.entries(riders)
    if entries is None:
        whole = encoded.then(kept)
        return whole, {n: pieces[n] for n in whole.tensors if n in pieces}, summaries
    assert rider is not None
    unknown = sorted(set(entries) - rider.replaces)
    if unknown:
        raise CheckpointError(f"a save's rider gave entries {unknown} outside the keys it replaces "
                              f"{sorted(rider.replaces)}")
    extra = _Encoded(*_encode_plain(dict(entries)))
    dropped = set() if kept is None else set(kept.tensors)
    held = _pieces(extra.tensors)
    shared = [(n, p.offsets, p.tensor.numel() * p.tensor.element_size()) for n, p in held.items()]
    summaries = [[e for e in s if e[0] not in dropped] + shared for s in summaries]
    whole = encoded.then(extra)
    mine = {**pieces, **held}  # in the whole state's order: the shard's sharding info lists them so
    return whole, {n: mine[n] for n in whole.tensors if n in mine}, summaries


def _different_paths(paths: list[str]) -> str:
    shown = ", ".join(f"rank {r}: '{p}'" for r, p in enumerate(paths[:4])) + (" ..." if len(paths) > 4 else "")
    return (f"the ranks name different checkpoints ({shown}); a sharded checkpoint is one directory that every rank "
            "writes into, so pass the same path on every rank (for one file per rank use distfn.checkpoint.save)")
