"""Reading a sharded checkpoint: `open_checkpoint` checks the whole directory before anything is returned.

A directory counts as a checkpoint only when everything checks out, from the files' own contents rather than the
index's word: the index (read with a size cap) is well formed, its weight map names only plain files inside the
directory, every shard's header is complete (`distfn.checkpoint.storage.read_header`, as strict as for one file),
and every piece of every tensor listed in the index is accounted for by the shards' sharding metadata: the
pieces have the index's dtype, lie inside its shape, do not overlap and cover it entirely. A missing or truncated
shard, an index whose shapes the shards do not fill, a name leaving the directory: each is a `CheckpointError`
naming the file, so no reader here ever returns memory that no file provided.

`Chunks` then serves whole tensors assembled from the pieces (memory-mapped through the storage reader); `load`
and `consolidate` read through it; `distfn.checkpoint.sharded.restore` restores in place.
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib
import posixpath
from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch
from loguru import logger

from ...errors import CheckpointError
from .. import format as fmt
from .. import storage
from ..layout import INDEX, SUFFIX, Location, resolve
from .spec import KEY_LAYOUT, KEY_TENSORS, KEY_WORLD, SAVED_OFFSETS, SHARDING_INFO

__all__ = ["MAX_INDEX", "Checkpoint", "Chunks", "consolidate", "load", "open_checkpoint"]

#: The most bytes an index may hold: its tree and tensor table are each bounded by the header limit at save time.
MAX_INDEX: Final = 2 * fmt.MAX_HEADER

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) of one piece in its full tensor


@attrs.frozen
class Checkpoint:
    """A checked sharded checkpoint directory (`open_checkpoint`)."""

    location: Location
    index: dict[str, Any]
    tree: Any
    #: ``{stored name: (dtype code, full shape)}``, every entry accounted for by the shards.
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str]
    #: ``{stored name: [(file, offsets, shape), ...]}``: where each piece lies.
    pieces: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...]]]]
    files: tuple[str, ...]

    @property
    def metadata(self) -> dict[str, Any]:
        """The index's metadata (``total_size``, the tree, ``metadata=`` ...)."""
        return dict(self.index["metadata"])


def _bad(where: Location, what: str) -> CheckpointError:
    return CheckpointError(f"'{where}' is not a valid sharded checkpoint: {what}")


def _member(d: Location, name: str, missing: str, what: str) -> Location:
    """``d``'s member ``name``, checked to be a regular file inside ``d`` (no symlink leaving it); ``missing`` is
    the error when it does not exist, ``what`` names it in the error when it is something else."""
    at = d.child(name)
    kind = d.fs.kind(at.path)
    if kind == "missing":
        raise CheckpointError(missing)
    if kind != "file" or not d.fs.inside(at.path, d.path):
        raise _bad(d, f"{what} is not a regular file inside the directory")
    return at


def _read_index(d: Location) -> dict[str, Any]:
    """The index's JSON, read with a size cap; only its outer structure is checked here."""
    index_at = _member(d, INDEX, f"'{d}' is not a complete sharded checkpoint: it has no {INDEX}", f"its {INDEX}")
    try:
        index = fmt.strict_json(d.fs.read_capped(index_at.path, MAX_INDEX))
    except (OSError, ValueError) as exc:  # ValueError: over the cap, not UTF-8, not JSON, nested too deep
        raise CheckpointError(f"'{index_at}': unreadable {INDEX}: {exc}") from None
    if (not isinstance(index, dict) or not isinstance(index.get("metadata"), dict)
            or not isinstance(index.get("weight_map"), dict)
            or not isinstance(index["metadata"].get(fmt.KEY_TREE), str)):
        raise CheckpointError(f"'{index_at}' is not a distfn sharded checkpoint index")
    return index


def plain_file_name(name: Any) -> bool:
    """Whether ``name`` may name a shard: a plain ``.safetensors`` file name, no directory part, no ``..``."""
    return (isinstance(name, str) and name.endswith(SUFFIX) and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and os.sep not in name and "\0" not in name
            and not name.startswith("."))


def _index_shapes(d: Location, meta: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    try:
        raw = fmt.strict_json(meta.get(KEY_TENSORS, "{}"))
    except (TypeError, ValueError) as exc:
        raise _bad(d, f"corrupt {KEY_TENSORS} in its index: {exc}") from None
    if not isinstance(raw, dict):
        raise _bad(d, f"corrupt {KEY_TENSORS} in its index (not a mapping)")
    out = {}
    for name, spec in raw.items():
        ok = isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and spec["dtype"] in fmt.FROM_CODE
        shape = spec.get("shape") if isinstance(spec, dict) else None
        # the same bound as a shard's own shapes: a zero-element [0, 10**30] would otherwise reach torch.empty
        problem = fmt.shape_problem(shape, fmt.FROM_CODE[spec["dtype"]].itemsize) if ok else "no dtype"
        if problem is not None or not isinstance(shape, list):
            raise _bad(d, f"the index's entry for tensor '{name}' is {fmt.brief(spec)}: it needs a known dtype and "
                          f"a shape of at most {fmt.MAX_NDIM} non-negative ints that fits a tensor")
        out[name] = (spec["dtype"], tuple(shape))
    return out


def _shard_files(d: Location, weight_map: Mapping[Any, Any]) -> tuple[str, ...]:
    """Every shard of ``d``: the files its weight map names and every other ``.safetensors`` file in it, each a
    plain name of a regular file inside the directory (a symlink leaving it is refused)."""
    for tensor, file in weight_map.items():
        if not isinstance(tensor, str) or not plain_file_name(file):
            raise _bad(d, f"its weight map names {fmt.brief(file)} for {fmt.brief(tensor)}: only plain .safetensors "
                          "file names inside the directory are accepted")
    listed = {n for n in d.fs.listdir(d.path) if n.endswith(SUFFIX) and not n.startswith(".")}
    files = sorted({*weight_map.values(), *listed})
    for file in files:
        _member(d, file, f"'{d}' is incomplete: {file} (named by its index) is missing", file)
    return tuple(files)


def _offsets_of(header: fmt.Header) -> dict[str, Any]:
    info = fmt.json_entry(header, SHARDING_INFO, {})
    if not isinstance(info, dict):
        raise CheckpointError(f"'{header.path}': corrupt {SHARDING_INFO} (not a mapping)")
    return info


def _pieces(d: Location, files: tuple[str, ...], shapes: Mapping[str, tuple[str, tuple[int, ...]]],
            ) -> dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Every piece in every shard, each checked against the index's dtype and shape."""
    out: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = {}
    for file in files:
        header = storage.read_header(d.child(file))  # complete, consistent, no bytes past its tensors
        info = _offsets_of(header)
        for name, entry in header.tensors.items():
            if name not in shapes:
                raise _bad(d, f"{file} holds tensor '{name}', which the index does not list")
            code, full = shapes[name]
            shape = tuple(int(s) for s in entry["shape"])
            offsets = info.get(name, {}).get(SAVED_OFFSETS) if isinstance(info.get(name), dict) else None
            offsets = [0] * len(shape) if offsets is None else offsets
            if (entry["dtype"] != code or not isinstance(offsets, list) or len(offsets) != len(full)
                    or len(shape) != len(full) or not all(fmt.natural(o) for o in offsets)
                    or any(o + s > f for o, s, f in zip(offsets, shape, full, strict=True))):
                raise _bad(d, f"{file} holds '{name}' as {entry['dtype']} {list(shape)} at offsets "
                              f"{fmt.brief(offsets)}, which does not fit the index's {code} {list(full)}")
            out.setdefault(name, []).append((file, tuple(offsets), shape))
    return out


def _overlap(a: _Box, b: _Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def _covered(full: tuple[int, ...], boxes: list[_Box]) -> bool:
    """Whether ``boxes`` (each inside ``full``) tile ``full`` exactly: disjoint, and as many elements in total."""
    if sum(math.prod(s) for _, s in boxes) != math.prod(full):
        return False
    nonempty = sorted(b for b in boxes if math.prod(b[1]))
    if all(b[0][1:] == (0,) * (len(full) - 1) and b[1][1:] == full[1:] for b in nonempty):
        # row slices (FSDP's Shard(0)): sorted by first offset, neighbours are enough
        return all(a[0][0] + a[1][0] <= b[0][0] for a, b in itertools.pairwise(nonempty))
    return not any(_overlap(a, b) for i, a in enumerate(nonempty) for b in nonempty[i + 1:])


def _check_tree(d: Location, index: dict[str, Any], shapes: Mapping[str, Any]) -> tuple[Any, dict[str, str]]:
    """The saved tree and tied names, checked exactly as a single file's (`distfn.checkpoint.format.check`)."""
    strings = {k: v for k, v in index["metadata"].items() if isinstance(v, str)}
    header = fmt.Header(d.child(INDEX).path, 0, {n: {"dtype": c, "shape": list(s)} for n, (c, s) in shapes.items()},
                        strings)
    tree = fmt.check(header)
    aliases = fmt.saved_aliases(header)
    missing = sorted({t for t in aliases.values() if t not in shapes})
    if missing:
        raise _bad(d, f"tied names refer to tensors it does not hold: {fmt.describe(missing)}")
    return tree, aliases


def _local_path(loc: Location) -> str | None:
    """The real local path ``loc`` names (a local path, or a ``file://`` URL), or ``None`` for another store."""
    if loc.fs.directories and isinstance(loc.path, pathlib.Path):
        return os.path.realpath(loc.path)
    if getattr(loc.path, "protocol", None) in ("file", "local"):
        return os.path.realpath(getattr(loc.path, "key", str(loc.path)))
    return None


def _within(target: Location, directory: Location) -> bool:
    """Whether ``target`` is ``directory`` or lies inside it, symlinks and ``..`` resolved (a local path and a
    ``file://`` URL of the same place count as the same)."""
    here, there = _local_path(target), _local_path(directory)
    if here is None or there is None:
        if type(target.fs) is not type(directory.fs):
            return False
        here, there = posixpath.normpath(str(target.path)), posixpath.normpath(str(directory.path))
    return here == there or here.startswith(there.rstrip("/" + os.sep) + os.sep) or here.startswith(there + "/")


def open_checkpoint(path: str | os.PathLike[str] | Location) -> Checkpoint:
    """The checked sharded checkpoint at ``path`` (see the module docstring for everything that is checked).

    Raises:
        CheckpointError: no index (an incomplete or foreign directory), or anything damaged, naming the file.
    """
    d = resolve(path)
    index = _read_index(d)
    shapes = _index_shapes(d, index["metadata"])
    files = _shard_files(d, index["weight_map"])
    pieces = _pieces(d, files, shapes)
    for name, (_, full) in shapes.items():
        boxes = [(o, s) for _, o, s in pieces.get(name, [])]
        if not boxes:
            raise CheckpointError(f"'{d}' is incomplete: no shard holds any of tensor '{name}' (a shard file is "
                                  "missing?)")
        if not _covered(full, boxes):
            held = sum(math.prod(s) for _, s in boxes)
            raise CheckpointError(f"'{d}' is incomplete or damaged: the shards hold {held} of the "
                                  f"{math.prod(full)} elements of '{name}' {list(full)}, or overlapping pieces "
                                  "(a shard file is missing or replaced?)")
    for name, file in index["weight_map"].items():
        if name not in shapes or all(f != file for f, _, _ in pieces.get(name, [])):
            raise _bad(d, f"its weight map puts '{name}' in {file}, which does not hold it")
    tree, aliases = _check_tree(d, index, shapes)
    return Checkpoint(d, index, tree, shapes, aliases, pieces, files)


class Chunks:
    """Full tensors of a checked checkpoint, assembled from their pieces (memory-mapped by the storage reader);
    a `distfn.checkpoint.format.TensorSource`."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._readers: dict[str, storage.Reader] = {}

    def _reader(self, file: str) -> storage.Reader:
        if file not in self._readers:
            self._readers[file] = storage.open_reader(self.checkpoint.location.child(file), "cpu")
        return self._readers[file]

    def close(self) -> None:
        """Close the shard files (tensors handed out stay valid)."""
        for reader in self._readers.values():
            reader.close()
        self._readers = {}

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (a view of the file's map when one shard holds all of it)."""
        if name not in self.checkpoint.shapes:
            raise CheckpointError(f"the sharded checkpoint '{self.checkpoint.location}' has no tensor '{name}'")
        code, full = self.checkpoint.shapes[name]
        parts = self.checkpoint.pieces[name]
        if len(parts) == 1:  # checked: one piece covering the whole tensor
            out = self._reader(parts[0][0]).get(name)
        else:
            out = torch.empty(full, dtype=fmt.FROM_CODE[code])  # every element is written below (checked)
            for file, offsets, shape in parts:
                piece = self._reader(file).get(name)
                out[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))].copy_(piece)
        return out if device is None else out.to(device)


def load(path: str | os.PathLike[str] | Location, device: str | torch.device = "cpu", *,
         prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole, as ``{stored name: tensor}`` (no process group needed).

    Tied names come back too, pointing at the same tensor, as with one file. With ``prefix`` (``"model"``), only
    the tensors under that key path, with it removed (`distfn.checkpoint.format.select`, as for one file).
    """
    checkpoint = open_checkpoint(path)
    chunks = Chunks(checkpoint)
    try:
        return fmt.select(checkpoint.location, list(checkpoint.shapes), checkpoint.aliases, prefix,
                      lambda n: chunks.get(n, torch.device(device)))
    finally:
        chunks.close()


def consolidate(path: str | os.PathLike[str] | Location, out: str | os.PathLike[str] | Location) -> pathlib.PurePath:
    """Turn a sharded checkpoint directory into one ``.safetensors`` file, streaming, with bounded memory.

    The file is an ordinary distfn checkpoint (same tree, same names), so `distfn.load`, ``ctx.load`` and every
    safetensors reader open it. The directory is checked whole first (`open_checkpoint`): nothing is written
    from a damaged one. One full tensor is assembled at a time, from memory-mapped slices, and written by the
    storage writer (temporary file, durable write, commit): host memory stays near the largest tensor.

    Args:
        path: the checkpoint directory.
        out: the file to write.

    Returns:
        The file written, absolute.

    Raises:
        CheckpointError: ``path`` does not exist, is already one file, or is not a complete, intact sharded
            checkpoint; ``out`` is inside the checkpoint directory (or is it); or the write failed (nothing is
            then left at ``out``).
    """
    d, target = resolve(path), resolve(out)
    found = d.layout()
    if found == "missing":
        raise CheckpointError(f"'{d}' does not exist")
    if found == "file":
        raise CheckpointError(f"'{d}' is already one file: there is nothing to consolidate (load it with "
                              "distfn.load)")
    checkpoint = open_checkpoint(d)
    if _within(target, d):
        # Every .safetensors file in the directory counts as a shard: one more there (or a shard replaced) would
        # leave the checkpoint unloadable.
        raise CheckpointError(f"cannot consolidate '{d}' into '{target}': that is inside the checkpoint directory, "
                              "whose every .safetensors file is read as a shard (the checkpoint would no longer load)."
                              f" Write it next to the directory instead, e.g. '{d}.safetensors'. Nothing was written.")
    dropped = {"total_size", KEY_TENSORS, KEY_LAYOUT, KEY_WORLD}
    meta = {k: str(v) for k, v in checkpoint.metadata.items() if k not in dropped}
    stand_ins = [fmt.Entry(name, torch.empty(full, dtype=fmt.FROM_CODE[code], device="meta"), code, full,
                           math.prod(full) * fmt.FROM_CODE[code].itemsize)
                 for name, (code, full) in checkpoint.shapes.items()]
    plan = fmt.layout(stand_ins, meta)
    chunks = Chunks(checkpoint)
    try:
        storage.write(plan, target, fetch=lambda entry: chunks.get(entry.name).contiguous())
    finally:
        chunks.close()
    logger.debug("consolidated {} into {} ({} tensors, {} bytes)", d, target, len(stand_ins), plan.total)
    return target.path
