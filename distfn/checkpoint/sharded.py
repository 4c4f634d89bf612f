"""Sharded checkpoints: a directory of standard ``.safetensors`` shards that every rank writes in parallel.

Layout of ``ckpt-1200/`` (specified in docs/checkpoints.md, "Sharded checkpoints"):

- ``shard-0000R-model-00001-of-00001.safetensors``: the pieces rank ``R - 1`` writes: its slice of every sharded
  ``DTensor``, plus its share of the replicated tensors (each written by one rank, spread so that every rank writes
  about as many bytes). Each file's ``__metadata__["DCP_SHARDING_INFO"]`` (JSON) gives the offset of every slice
  in its full tensor: the names and keys torch's `torch.distributed.checkpoint.hf_storage` uses, so its
  `HuggingFaceStorageReader` reads these directories.
- ``model.safetensors.index.json``: the Hugging Face index layout (``{"metadata": {"total_size": ...},
  "weight_map": {name: file}}``) written last, by rank 0, by rename. Its ``metadata`` also holds the saved
  object's JSON tree (`distfn.checkpoint.format`: optimizer hyper-parameters, counters, schedulers, everything
  that is not a tensor), the tied names, ``metadata=``, and every tensor's full shape.

Written here: the plan (one small collective: who writes which piece), each rank's file, streamed from its
tensors by distfn's own writer (`distfn.checkpoint.storage`: no in-memory copy of the shard, writeback started
while writing, ``fsync``; torch's ``HuggingFaceStorageWriter`` first builds every file in memory and was measured
1.55x slower than DCP's default writer), the index with the non-tensor state, the atomicity (a hidden temporary
directory renamed into place once the index is in it), the clean-up of killed saves, ``keep=``, restoring modules,
optimizers and plain values in place, and `consolidate` (one streaming file). Used from torch as is: the
resharding reader (`HuggingFaceStorageReader`, which memory-maps each shard and reads only the slices a rank
needs). No pickle is written or read.

torch's checkpoint modules cost ~0.3 s to import: they are imported inside the functions that use them.
The module is longer than ~500 lines because the writer, the reader and `consolidate` share the layout's private
helpers (names, index, chunk assembly); splitting them would export those helpers across modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import socket
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Final, cast

import attrs
import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from .. import tree
from ..errors import CheckpointError
from ..modules import indexed_optimizer_state, unwrap_module
from ..options import Mode, shards_state
from . import background, storage
from . import format as fmt

__all__ = [
    "INDEX",
    "consolidate",
    "is_sharded_checkpoint",
    "load",
    "load_into",
    "read_index",
    "rotate",
    "save",
    "wants_sharded",
]

#: The index file name (the Hugging Face convention, so `transformers` and `safetensors` tooling find it).
INDEX: Final = "model.safetensors.index.json"
_PARTIAL: Final = ".distfn-partial"
_KEY_TENSORS: Final = "distfn.tensors"
_KEY_LAYOUT: Final = "distfn.layout"
_SHARDING_INFO: Final = "DCP_SHARDING_INFO"  # the keys torch's HuggingFaceStorageReader reads offsets from
_SAVED_OFFSETS: Final = "saved_offsets"
_DCP_VERSION: Final = "DCP_VERSION"
_STEP_DIR: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)$")

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------------
# Names and the rule for ctx.save


def wants_sharded(path: PathLike, mode: Mode, sharded: bool | None) -> bool:
    """The rule of ``ctx.save``: ``sharded=`` when given, else sharded in ``mode="fsdp"`` exactly when the path
    does not end in ``.safetensors`` (``ckpt/step-1200`` is a directory, ``ckpt-1200.safetensors`` one file)."""
    if sharded is not None:
        return bool(sharded)
    return shards_state(mode) and not os.fspath(path).endswith(".safetensors")


def is_sharded_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a directory holding a sharded checkpoint's index (complete or not yet checked)."""
    p = pathlib.Path(os.fspath(path))
    return p.is_dir() and (p / INDEX).is_file()


def step_of_dir(name: str) -> tuple[str, int] | None:
    """``(prefix, step)`` of a step-numbered directory name (``ckpt-1200``), or ``None`` (hidden ones too)."""
    m = _STEP_DIR.match(name)
    if m is None or name.startswith("."):
        return None
    return m.group("prefix"), int(m.group("step"))


def remove_partials(directory: pathlib.Path) -> None:
    """Remove the hidden directories of sharded saves whose rank 0 (on this host) no longer runs.

    A killed save leaves ``.<name>.<host>.<pid>.<random>.distfn-partial``; it is never a checkpoint (`latest`
    skips hidden names) and the next sharded save into the same parent removes it. Another host's or a live
    writer's directory is left alone.
    """
    for name, pid in storage.dead_leftovers(directory, _PARTIAL):
        shutil.rmtree(directory / name, ignore_errors=True)
        logger.debug("removed {} left by a killed sharded save (pid {})", name, pid)


# --------------------------------------------------------------------------------------------------
# Saving


def _is_object(value: Any) -> bool:
    return isinstance(value, nn.Module) or fmt.is_stateful(value)


def _state_of(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return unwrap_module(value).state_dict()
    if fmt.is_stateful(value):
        return value.state_dict()
    return value


def _encode(obj: Any, metadata: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(the index's distfn metadata, ``{stored name: tensor}``) for ``obj``; tensors may be ``DTensor`` s.

    The tree is encoded by `distfn.checkpoint.format.plan` exactly as for one file, with a one-element stand-in
    per distinct tensor (so sharded tensors pass, nothing is copied, and tied tensors are still stored once).
    """
    states = tree.tree_map(_state_of, obj, is_leaf=_is_object)
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
        tensors[e.name] = t.detach()
        shapes[e.name] = {"dtype": e.code, "shape": [int(s) for s in t.shape]}
    meta[_KEY_TENSORS] = json.dumps(shapes, separators=(",", ":"))
    meta[_KEY_LAYOUT] = "sharded"
    return meta, tensors


def _rank_world() -> tuple[int, int, bool]:
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size(), True) if on else (0, 1, False)


def _publish(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Rename the complete temporary directory to ``target`` (an older checkpoint there is moved aside first)."""
    old = None
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        old = storage.tmp_name(target, _PARTIAL)
        os.rename(target, old)
    os.rename(tmp, target)
    storage.fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    blocking: bool = True,
) -> pathlib.Path:
    """Write ``obj`` as a sharded checkpoint directory; **every rank** calls it (a collective) and writes its shards.

    Outside a process group it writes one shard. Sharded models and optimizers (FSDP2 ``DTensor`` s) are written
    by every rank as its own slices, never gathered; replicated tensors are written once, spread over the ranks
    that hold them so that every rank writes about as many bytes.

    Args:
        obj: what `distfn.checkpoint.save` accepts (modules, optimizers, schedulers, tensors, JSON-like values).
        path: the directory to create (missing parents are created; an older checkpoint there is replaced).
        metadata: JSON-like values stored in the index.
        keep: with a step-numbered name (``ckpt-1200``), keep only the ``keep`` newest such directories.
        blocking: ``False`` returns once this rank's pieces are copied to host memory (buffers reused between
            saves, pinned for GPU tensors); the writing, the index and the rename finish in a background thread
            (`distfn.checkpoint.background`).

    Returns:
        The directory, absolute (on every rank).

    Raises:
        CheckpointError: a value that cannot be stored (before anything is written), a bad ``keep``, or a failed
            write on any rank (raised on every rank; the previous checkpoint is then intact and the partial
            directory removed).
    """
    target = storage.local_path(path).absolute()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep= must be a positive int or None, got {keep!r}")
    if keep is not None and step_of_dir(target.name) is None:
        raise CheckpointError(f"keep= needs a step-numbered directory name such as 'ckpt-1200', got '{target.name}'")
    if target.suffix == ".safetensors":
        raise CheckpointError(f"a sharded checkpoint is a directory: '{target}' ends in .safetensors (drop the "
                              "suffix, or save one file with sharded=False)")
    background.wait()  # the previous save first: its collectives must not interleave with this one's
    meta, tensors = _encode(obj, metadata)
    job = _plan_shards(tensors, target)
    if blocking:
        job.write()
        job.finish(meta, keep)
        logger.debug("saved sharded checkpoint {} ({} tensors, {} ranks)", target, len(tensors), job.world)
        return target
    mine = background.stage({name: piece.tensor for name, piece in job.mine.items()})
    job = attrs.evolve(job, mine={n: attrs.evolve(p, tensor=mine[n]) for n, p in job.mine.items()})

    def write_and_finish() -> None:
        job.write()
        job.finish(meta, keep)
        logger.debug("saved sharded checkpoint {} in the background ({} ranks)", target, job.world)

    background.submit(str(target), write_and_finish)
    return target


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
    collective, so a bad value fails on every rank alike."""
    out: dict[str, _Piece] = {}
    for name, t in tensors.items():
        if hasattr(t, "placements"):
            dtensor: Any = t
            chunks = dtensor.__create_chunk_list__()  # the protocol DCP uses; one chunk for every DTensor layout
            local = dtensor.to_local()
            if len(chunks) != 1:
                raise CheckpointError(f"cannot save '{name}': its local shard has {len(chunks)} chunks (distfn "
                                      "writes one per rank)")
            if local.numel() == 0 and t.numel() != 0:
                continue  # this rank holds none of it (an uneven split)
            piece = _Piece(local, tuple(int(o) for o in chunks[0].offsets))
        else:
            piece = _Piece(t, (0,) * t.dim())
        fmt.entry(name, piece.tensor)  # raises the format's CheckpointError for what safetensors cannot hold
        out[name] = piece
    return out


def _shard_file(rank: int) -> str:
    # the name torch's HuggingFaceStorageWriter gives a distributed save's shards (shard numbers from 1)
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


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

    target: pathlib.Path
    tmp: pathlib.Path
    rank: int
    world: int
    group: Any  # the gloo group of the collectives, or None outside a process group
    mine: dict[str, _Piece]  # the pieces this rank writes
    weight_map: dict[str, str]
    total: int
    error: list[str | None] = attrs.field(factory=lambda: [None])

    def write(self) -> None:
        """Write this rank's shard file (streamed from the tensors, ``fsync`` ed); a failure is kept for `finish`."""
        if not self.mine:
            return
        info = {name: {_SAVED_OFFSETS: list(p.offsets)} for name, p in self.mine.items()}
        meta = {"format": "pt", _SHARDING_INFO: json.dumps(info, separators=(",", ":")), _DCP_VERSION: "1.0"}
        try:
            plan = fmt.layout([fmt.entry(name, p.tensor) for name, p in self.mine.items()], meta)
            storage.write(plan, self.tmp / _shard_file(self.rank))
        except (CheckpointError, OSError) as exc:
            self.error[0] = f"rank {self.rank} on {socket.gethostname()}: {exc}"

    def finish(self, meta: dict[str, str], keep: int | None) -> None:
        """Every rank reports; rank 0 writes the index and renames the directory into place (or removes it when
        any rank failed); every rank returns, or raises the same `CheckpointError`."""
        try:
            errors = _gather(self.error[0], self.group, self.world)
        except BaseException:  # a rank died mid-save: its partial directory goes now, not at the next save
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        outcome = "; ".join(e for e in errors if e) or None
        if self.rank == 0:
            try:
                if outcome is None:
                    self._write_index(meta)
                    _publish(self.tmp, self.target)
            except OSError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            if outcome is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            elif keep is not None:
                rotate(self.target, keep)
        outcome = _broadcast(outcome, self.group)
        if outcome is not None:
            raise CheckpointError(f"cannot save '{self.target}': {outcome}. The previous checkpoint, if any, is "
                                  "intact.")

    def _write_index(self, meta: dict[str, str]) -> None:
        index = {"metadata": {"total_size": self.total, **meta, "distfn.world_size": str(self.world)},
                 "weight_map": self.weight_map}
        part = self.tmp / f".{INDEX}.tmp"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            storage.write_all(fd, memoryview(json.dumps(index, indent=1, ensure_ascii=False).encode()))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, self.tmp / INDEX)  # the index goes in last: the directory is complete only with it
        storage.fsync_dir(self.tmp)


def _gather(value: Any, group: Any, world: int) -> list[Any]:
    if group is None:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)  # small values between live processes; nothing is stored
    return out


def _broadcast(value: Any, group: Any) -> Any:
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _plan_shards(tensors: Mapping[str, torch.Tensor], target: pathlib.Path) -> _ShardJob:
    """Plan a sharded save with one collective: every rank's pieces (and rank 0's temporary directory) are
    gathered, and every rank derives the same assignment, index and file names from them."""
    rank, world, on = _rank_world()
    group = background.cpu_group() if on else None
    error, tmp_name = None, ""
    try:
        pieces = _pieces(tensors)
    except CheckpointError as exc:
        error, pieces = str(exc), {}
    if rank == 0 and error is None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_partials(target.parent)
            tmp_name = storage.tmp_name(target, _PARTIAL).name
            (target.parent / tmp_name).mkdir()
        except OSError as exc:
            error = f"cannot create the checkpoint directory next to '{target}': {exc}"
    summary = [(n, p.offsets, p.tensor.numel() * p.tensor.element_size()) for n, p in pieces.items()]
    gathered = _gather((error, tmp_name, summary), group, world)
    errors = [e for e, _, _ in gathered if e]
    if errors:
        if tmp_name:
            shutil.rmtree(target.parent / tmp_name, ignore_errors=True)
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else "; ".join(errors))
    owner = _assign([s for _, _, s in gathered])
    missing = sorted(set(tensors) - {name for name, _ in owner})
    if missing:  # a tensor no rank holds any of: the ranks were not saving the same state
        raise CheckpointError(f"cannot save '{target}': no rank holds {fmt.describe(missing)}; every rank must "
                              "save the same state")
    first: dict[str, str] = {}
    for (name, _), (writer, _) in sorted(owner.items()):
        first.setdefault(name, _shard_file(writer))  # the file with the piece at the lowest offsets
    return _ShardJob(target=target, tmp=target.parent / gathered[0][1], rank=rank, world=world, group=group,
                     mine={n: p for n, p in pieces.items() if owner[(n, p.offsets)][0] == rank},
                     weight_map=dict(sorted(first.items())), total=sum(n for _, n in owner.values()))



def rotate(target: pathlib.Path, keep: int) -> None:
    """Keep ``target`` and the ``keep - 1`` newest other complete checkpoint directories with its prefix."""
    parsed = step_of_dir(target.name)
    if parsed is None:
        raise CheckpointError(f"keep= needs a step-numbered directory name such as 'ckpt-1200', got '{target.name}'")
    found = []
    for p in target.parent.iterdir():
        s = step_of_dir(p.name)
        if s is not None and s[0] == parsed[0] and p != target and is_sharded_checkpoint(p):
            found.append((s[1], p.name, p))
    for _, _, p in sorted(found, reverse=True)[keep - 1:]:
        shutil.rmtree(p, ignore_errors=True)
        logger.debug("keep={}: removed {}", keep, p)


# --------------------------------------------------------------------------------------------------
# Reading


def read_index(path: PathLike) -> dict[str, Any]:
    """The checked index of a sharded checkpoint directory: ``{"metadata": {...}, "weight_map": {...}}``.

    Raises:
        CheckpointError: no index (an incomplete or foreign directory), or a malformed one.
    """
    d = storage.local_path(path)
    try:
        index = json.loads((d / INDEX).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"'{d}' is not a complete sharded checkpoint: it has no {INDEX}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"'{d}': unreadable {INDEX}: {exc}") from None
    if (not isinstance(index, dict) or not isinstance(index.get("metadata"), dict)
            or not isinstance(index.get("weight_map"), dict) or fmt.KEY_TREE not in index["metadata"]):
        raise CheckpointError(f"'{d}/{INDEX}' is not a distfn sharded checkpoint index")
    for file in set(index["weight_map"].values()):
        if not (d / file).is_file():
            raise CheckpointError(f"'{d}' is incomplete: {file} (named by its index) is missing")
    return index


def _tree(index: Mapping[str, Any]) -> Any:
    return json.loads(index["metadata"][fmt.KEY_TREE])


def _shapes(index: Mapping[str, Any]) -> dict[str, Any]:
    return dict(json.loads(index["metadata"].get(_KEY_TENSORS, "{}")))


class _Chunks:
    """Full tensors assembled from their slices in the shards (memory-mapped with ``safetensors.safe_open``);
    a `distfn.checkpoint.format.TensorSource`."""

    def __init__(self, directory: pathlib.Path, index: Mapping[str, Any]) -> None:
        from safetensors import safe_open

        self.shapes = _shapes(index)
        self._files: dict[str, Any] = {}
        self.chunks: dict[str, list[tuple[str, list[int]]]] = {}
        for file in sorted({*index["weight_map"].values(), *(p.name for p in directory.glob("*.safetensors"))}):
            handle = safe_open(str(directory / file), framework="pt")
            self._files[file] = handle
            info = json.loads((handle.metadata() or {}).get(_SHARDING_INFO, "{}"))
            for name in handle.keys():
                offsets = info.get(name, {}).get("saved_offsets", [0] * len(handle.get_slice(name).get_shape()))
                self.chunks.setdefault(name, []).append((file, list(offsets)))

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        if name not in self.chunks:
            raise CheckpointError(f"the sharded checkpoint has no tensor '{name}'")
        spec = self.shapes.get(name)
        parts = self.chunks[name]
        if spec is None or (len(parts) == 1 and not any(parts[0][1])):
            out = self._files[parts[0][0]].get_tensor(name)
        else:
            out = torch.empty(spec["shape"], dtype=fmt.FROM_CODE[spec["dtype"]])
            for file, offsets in parts:
                piece = self._files[file].get_tensor(name)
                out[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape, strict=True))].copy_(piece)
        return out if device is None else out.to(device)


def load(path: PathLike, device: str | torch.device = "cpu", *, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole, as ``{stored name: tensor}`` (no process group needed).

    Tied names come back too, pointing at the same tensor, as with one file. With ``prefix`` (``"model"``), only
    the tensors under that key path, with it removed (a model's state dict out of a training state).
    """
    d = storage.local_path(path)
    index = read_index(d)
    chunks = _Chunks(d, index)
    names = list(chunks.shapes)
    aliases = json.loads(index["metadata"].get(fmt.KEY_ALIASES, "{}"))
    start = "" if prefix is None else prefix.rstrip(".") + "."
    if prefix is not None:
        names = [n for n in names if n.startswith(start) or any(a.startswith(start) and s == n
                                                                   for a, s in aliases.items())]
        if not names:
            raise CheckpointError(f"'{d}' has no tensors under '{prefix}'")
    out = {name: chunks.get(name, torch.device(device)) for name in names}
    for alias, stored in aliases.items():
        if stored in out:
            out[alias] = out[stored]
    return {n[len(start):]: t for n, t in out.items() if n.startswith(start)}


# --------------------------------------------------------------------------------------------------
# Restoring in place (resharding)


def _owner(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module:
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in modules:
        if wanted <= {id(p) for p in m.parameters()}:
            return m
    raise CheckpointError("loading an optimizer from a sharded checkpoint needs its model in the same `into` "
                          "mapping (e.g. {'model': model, 'optimizer': opt})")


class _Restore:
    """Collects, for every module and optimizer of ``into``, the live tensors to fill (by stored name); fills
    them with one resharding `torch.distributed.checkpoint.load`; then applies them and every other value."""

    def __init__(self, directory: pathlib.Path, index: Mapping[str, Any], strict: bool) -> None:
        self.directory = directory
        self.strict = strict
        self.targets: dict[str, torch.Tensor] = {}
        self.ties: list[tuple[torch.Tensor, str]] = []
        self.after: list[Any] = []
        self.chunks = _Chunks(directory, index)

    def _want(self, stored: str, tensor: torch.Tensor) -> None:
        if stored in self.targets:
            if self.targets[stored] is not tensor:
                self.ties.append((tensor, stored))
            return
        self.targets[stored] = tensor

    def module(self, where: str, module: nn.Module, node: Any) -> None:
        live = unwrap_module(module).state_dict()
        saved = fmt.as_plain_dict(node)
        if saved is None:
            raise CheckpointError(f"'{where}' in the checkpoint is {fmt.kind(node)}, not a module's state")
        live_keys = {k for k, v in live.items() if isinstance(v, torch.Tensor)}
        missing = sorted(live_keys - set(saved))
        unexpected = sorted(k for k in saved if k not in live_keys and fmt.ref(saved[k]) is not None)
        if self.strict and (missing or unexpected):
            raise CheckpointError(f"cannot load '{where}': missing keys {fmt.describe(missing)}; unexpected keys "
                                  f"{fmt.describe(unexpected)} (strict=False skips them). Nothing was changed.")
        for k in sorted(live_keys & set(saved)):
            stored = fmt.ref(saved[k])
            if stored is None:
                raise CheckpointError(f"'{where}.{k}' in the checkpoint is {fmt.kind(saved[k])}, not a tensor")
            self._check_shape(f"{where}.{k}", stored, live[k])
            self._want(stored, live[k])
        self.after.append(lambda: unwrap_module(module).load_state_dict(live, strict=False))

    def _check_shape(self, where: str, stored: str, live: torch.Tensor) -> None:
        spec = self.chunks.shapes.get(stored)
        if spec is not None and list(spec["shape"]) != list(live.shape):
            raise CheckpointError(f"cannot load '{where}': the checkpoint holds shape {tuple(spec['shape'])}, the "
                                  f"live tensor has {tuple(live.shape)}. Nothing was changed.")

    def optimizer(self, where: str, opt: torch.optim.Optimizer, node: Any, modules: list[nn.Module]) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        saved = fmt.as_plain_dict(node)
        saved_state = fmt.as_plain_dict(saved.get("state")) if saved else None
        if saved is None or saved_state is None or "param_groups" not in saved:
            raise CheckpointError(f"'{where}' in the checkpoint is {fmt.kind(node)}, not an optimizer's state")
        groups = fmt.decode(saved["param_groups"], fmt.NoTensors())
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
            raise CheckpointError(f"cannot load '{where}': the checkpoint's optimizer has param groups of sizes "
                                  f"{[len(g['params']) for g in groups]}, the live one "
                                  f"{[len(g['params']) for g in opt.param_groups]}. Nothing was changed.")
        model = _owner(opt, modules)
        named: Any = get_optimizer_state_dict(model, opt)  # creates the moments of a fresh optimizer
        order = [fqn for g in named["param_groups"] for fqn in g["params"]]
        indexed = indexed_optimizer_state(named)
        state: dict[int, dict[str, Any]] = {}
        for i, entry in saved_state.items():
            values = fmt.as_plain_dict(entry) or {}
            live = indexed["state"].get(int(i), {})
            state[int(i)] = {}
            for k, v in values.items():
                stored = fmt.ref(v)
                if stored is not None and isinstance(live.get(k), torch.Tensor):
                    self._check_shape(f"{where}.state.{i}.{k}", stored, live[k])
                    self._want(stored, live[k])
                    state[int(i)][k] = live[k]
                else:
                    state[int(i)][k] = fmt.decode(v, self.chunks)

        def apply() -> None:
            full: Any = {"state": {order[i]: v for i, v in state.items()},
                    "param_groups": [{**g, "params": [order[j] for j in g["params"]]} for g in groups]}
            set_optimizer_state_dict(model, opt, full)

        self.after.append(apply)

    def run(self) -> None:
        from torch.distributed.checkpoint import load as dcp_load  # ~0.3 s, paid by sharded loads only
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

        if self.targets:
            # no_dist: each rank plans its own reads (its slices only); no collective, so no rank can hang here
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(self.targets, storage_reader=HuggingFaceStorageReader(str(self.directory)), no_dist=True)
        for tensor, stored in self.ties:
            with torch.no_grad():
                tensor.copy_(self.targets[stored])
        for step in self.after:
            step()


def _objects(into: Any) -> Iterator[Any]:
    return iter(x for x in tree.tree_leaves(into, is_leaf=_is_object) if isinstance(x, nn.Module))


def load_into(
    path: PathLike,
    into: nn.Module | Mapping[str, Any],
    *,
    device: torch.device | str = "cpu",
    strict: bool = True,
) -> dict[str, Any]:
    """Restore ``into`` in place from a sharded checkpoint, onto any world size and any mode.

    Sharded (FSDP2) modules and optimizers read only their own slices; plain ones read whole tensors; each rank
    plans its own reads from memory-mapped shards, so there is no collective. Everything is checked (names,
    shapes, param groups) before anything changes.

    Args:
        path: the checkpoint directory.
        into: a module, or a mapping of modules / optimizers / schedulers / plain values (restored in place).
        device: where tensors of plain values go.
        strict: every tensor of a module must be in the checkpoint and nothing extra.

    Returns:
        The saved values not restored in place (``step``, ...), like `distfn.checkpoint.load_into`.
    """
    d = storage.local_path(path)
    index = read_index(d)
    saved = _tree(index)
    job = _Restore(d, index, strict)
    dev = torch.device(device)
    if isinstance(into, nn.Module) or not isinstance(into, Mapping):
        if isinstance(into, torch.optim.Optimizer) or not isinstance(into, nn.Module):
            raise CheckpointError("into= must be a module or a mapping (an optimizer needs its model next to it)")
        job.module("<root>", into, saved)
        job.run()
        return {}
    nodes = fmt.as_plain_dict(saved)
    if nodes is None:
        raise CheckpointError(f"'{d}' holds {fmt.kind(saved)}, not a mapping: load it into a module")
    plain = _plan_mapping(job, into, nodes, strict, dev)
    job.run()
    out = {k: fmt.decode(v, job.chunks, dev) for k, v in nodes.items() if k not in into or k in plain}
    if isinstance(into, dict):
        for k in plain:
            into[k] = out[k]
    return out


def _plan_mapping(job: _Restore, into: Mapping[str, Any], nodes: Mapping[Any, Any], strict: bool,
                  dev: torch.device) -> set[str]:
    """Queue every entry of ``into`` on ``job``; the keys of plain values (replaced by the saved ones)."""
    modules = list(_objects(into))
    plain: set[str] = set()
    for key, value in into.items():
        if key not in nodes:
            if value is not None and strict and _is_object(value):
                raise CheckpointError(f"cannot load '{key}': the checkpoint has no such entry (it holds "
                                      f"{fmt.describe(sorted(str(k) for k in nodes))}). Nothing was changed.")
            continue
        if isinstance(value, nn.Module):
            job.module(str(key), value, nodes[key])
        elif isinstance(value, torch.optim.Optimizer):
            job.optimizer(str(key), value, nodes[key], modules)
        elif fmt.is_stateful(value):
            obj, node = value, nodes[key]
            job.after.append(lambda obj=obj, node=node: obj.load_state_dict(fmt.decode(node, job.chunks, dev)))
        elif value is not None:
            plain.add(key)
    return plain


# --------------------------------------------------------------------------------------------------
# Consolidation


def consolidate(path: PathLike, out: PathLike) -> pathlib.Path:
    """Turn a sharded checkpoint directory into one ``.safetensors`` file, streaming, with bounded memory.

    The file is an ordinary distfn checkpoint (same tree, same names), so `distfn.load`, ``ctx.load`` and every
    safetensors reader open it. One full tensor is assembled at a time, from memory-mapped slices, and written
    atomically (temporary file, ``fsync``, rename): host memory stays near the largest tensor.

    Args:
        path: the checkpoint directory.
        out: the file to write.

    Returns:
        The file written, absolute.
    """
    d = storage.local_path(path)
    target = storage.local_path(out).absolute()
    index = read_index(d)
    chunks = _Chunks(d, index)
    dropped = {"total_size", _KEY_TENSORS, _KEY_LAYOUT, "distfn.world_size"}
    meta = {k: str(v) for k, v in index["metadata"].items() if k not in dropped}
    specs = chunks.shapes
    names = sorted(specs, key=lambda n: (-fmt.FROM_CODE[specs[n]["dtype"]].itemsize, n))
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for n in names:
        size = fmt.FROM_CODE[specs[n]["dtype"]].itemsize
        for s in specs[n]["shape"]:
            size *= int(s)
        header[n] = {"dtype": specs[n]["dtype"], "shape": specs[n]["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    target.parent.mkdir(parents=True, exist_ok=True)
    storage.remove_stale_tmps(target.parent)
    tmp = storage.tmp_name(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        storage.write_all(fd, memoryview(len(raw).to_bytes(8, "little") + raw))
        for n in names:
            t = chunks.get(n).contiguous()
            if t.numel():
                storage.write_all(fd, memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy())))
            del t
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
        storage.fsync_dir(target.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    logger.debug("consolidated {} into {} ({} tensors, {} bytes)", d, target, len(names), offset)
    return target
