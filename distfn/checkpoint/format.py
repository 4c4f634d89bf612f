"""The file format: a Python object <-> (a safetensors header with a JSON tree, tensors to write).

Encoding walks the saved object once (`plan`): tensors become references ``{"__tensor__": name}`` and are listed
for the writer in file order; everything else becomes JSON, with a few tags for what JSON cannot hold. Decoding
(`decode`) turns a tree node back into Python values, reading tensors through any object with a
``get(name, device)`` method (the storage reader). `parse_header` checks a header's JSON. The layout itself is
specified in docs/checkpoints.md, section "File format". (Over 500 lines on purpose: the encoder, the header
and tag checks and the decoder are the two directions of one format and change together.)
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import tree
from ..errors import CheckpointError
from ..modules import unwrap_module
from .untrusted import MAX_DEPTH, MAX_NDIM, brief, natural, shape_problem, strict_json

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "FORMAT_VERSION",
    "FROM_CODE",
    "KEY_ALIASES",
    "KEY_METADATA",
    "KEY_TREE",
    "MAX_DEPTH",
    "MAX_HEADER",
    "MAX_NDIM",
    "TAGS",
    "Entry",
    "Header",
    "NoTensors",
    "Plan",
    "Span",
    "TensorSource",
    "as_plain_dict",
    "brief",
    "check",
    "check_tree",
    "decode",
    "describe",
    "entry",
    "is_stateful",
    "json_entry",
    "kind",
    "layout",
    "memory_key",
    "natural",
    "parse_header",
    "path_str",
    "plan",
    "ref",
    "refuse_plain_loader",
    "saved_aliases",
    "saved_metadata",
    "saved_tree",
    "select",
    "shape_problem",
    "strict_json",
]

FORMAT_VERSION: Final = "1"
KEY_FORMAT: Final = "distfn.format"
KEY_TREE: Final = "distfn.tree"
KEY_ALIASES: Final = "distfn.aliases"
KEY_METADATA: Final = "distfn.metadata"
_RESERVED_METADATA: Final = frozenset({"format", KEY_FORMAT, KEY_TREE, KEY_ALIASES, KEY_METADATA})
MAX_HEADER: Final = 100_000_000  # the stock safetensors limit

#: Every dtype a file can hold, with its safetensors code.
DTYPES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        DTYPES[getattr(torch, _attr)] = _name
#: safetensors code -> dtype.
FROM_CODE: Final[dict[str, torch.dtype]] = {code: dtype for dtype, code in DTYPES.items()}

#: The tags of the JSON tree (one-key objects).
TAGS: Final = ("__tensor__", "__ndarray__", "__tuple__", "__float__", "__dtype__", "__device__", "__dict__")


# --------------------------------------------------------------------------------------------------
# Small helpers shared by the package


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def path_str(path: Sequence[Any]) -> str:
    """A key path as users read it: ``model.fc.weight``, or ``<root>``."""
    return ".".join(str(p) for p in path) if path else "<root>"


def describe(keys: Sequence[str], limit: int = 8) -> str:
    """``'a', 'b' and 3 more``: a short list of names for a message."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the real error
        text = object.__repr__(obj)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------------
# Encoding: object -> (JSON tree, tensors to write)


@attrs.frozen
class Entry:
    """One tensor to write: its stored name, the tensor (detached, any device) and its byte span."""

    name: str
    tensor: torch.Tensor
    code: str
    shape: tuple[int, ...]
    nbytes: int


#: Values a JSON node holds as they are (`_Encoder.encode` returns them unchanged): a list of only these is copied.
_FLAT: Final = frozenset({int, str, bool, type(None)})


class _Encoder:
    """Walks an object once, producing the JSON tree and the de-duplicated list of tensors."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.aliases: dict[str, str] = {}
        self._by_name: dict[str, str] = {}  # every tensor name (stored or alias) -> the path that produced it
        self._by_memory: dict[Hashable, str] = {}

    def encode(self, obj: Any, path: tuple[Any, ...], depth: int = 0) -> Any:
        """The JSON node of ``obj``; ``depth`` is the JSON nesting of the node being built (bounded by `MAX_DEPTH`,
        so that every file written can be read back, and a value containing itself is an error, not a
        ``RecursionError``)."""
        if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)) or (
                isinstance(obj, float) and math.isfinite(obj)):
            return obj
        if depth >= MAX_DEPTH:  # inside MAX_DEPTH containers already: no room for one more (every node below is)
            raise _too_deep(path)
        if isinstance(obj, float):
            return {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._tensor(obj, path)}
        if isinstance(obj, nn.Module):
            return self.encode(unwrap_module(obj).state_dict(), path, depth + 1)
        if isinstance(obj, Mapping):
            return self._mapping(obj, path, depth)
        if isinstance(obj, (tuple, list)):
            inner = depth + (2 if isinstance(obj, tuple) else 1)  # a tuple is {"__tuple__": [...]}: two levels
            if inner > MAX_DEPTH:
                raise _too_deep(path)
            if type(obj) in (tuple, list) and all(type(v) in _FLAT for v in obj):
                items = list(obj)  # what encoding each item gives, without a call per item (a random state's 625)
            else:
                items = [self.encode(v, (*path, i), inner) for i, v in tree.children(obj)]
            return {"__tuple__": items} if isinstance(obj, tuple) else items
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        return self._other(obj, path, depth)

    def _other(self, obj: Any, path: tuple[Any, ...], depth: int) -> Any:
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return {"__ndarray__": self._tensor(torch.from_numpy(obj), path)}
            if isinstance(obj, np.generic):
                return self.encode(obj.item(), path, depth + 1)
        if is_stateful(obj):
            try:
                state = obj.state_dict()
            except Exception as exc:
                raise CheckpointError(
                    f"cannot save {type(obj).__name__} at '{path_str(path)}': its state_dict() failed: {exc}"
                ) from exc
            return self.encode(state, path, depth + 1)
        if isinstance(obj, DataLoader):  # a loader made outside a job: name the one whose position is state
            raise CheckpointError(
                f"cannot save the {type(obj).__qualname__} at '{path_str(path)}': a torch DataLoader has no position "
                "to save. Build it inside the @distributed function with ctx.dataloader(dataset, batch_size, ...): "
                "that loader is state (its epoch and position are saved and restored). Nothing was written."
            )
        raise CheckpointError(
            f"cannot save the value at '{path_str(path)}': {type(obj).__qualname__} ({_short_repr(obj)}) is "
            "not a tensor, module, optimizer, scheduler, object with state_dict()/load_state_dict(), or a "
            "JSON-like value (None, bool, int, float, str, list, tuple, dict). Nothing was written."
        )

    def _mapping(self, obj: Mapping[Any, Any], path: tuple[Any, ...], depth: int) -> Any:
        pairs = tree.children(obj)
        if all(isinstance(k, str) and not k.startswith("__") for k, _ in pairs):
            return {k: self.encode(v, (*path, k), depth + 1) for k, v in pairs}
        if depth + 3 > MAX_DEPTH:  # {"__dict__": [[key, value], ...]}: three levels
            raise _too_deep(path)
        items = []
        for k, v in pairs:
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise CheckpointError(
                    f"cannot save the mapping at '{path_str(path)}': key {k!r} of type {type(k).__qualname__} "
                    "is not a str, int, float, bool, None or tuple. Nothing was written."
                )
            # {"__dict__": [[key, value], ...]}: the pair list is three levels below the mapping's own
            items.append([self.encode(k, (*path, "<key>"), depth + 3), self.encode(v, (*path, k), depth + 3)])
        return {"__dict__": items}

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str:
        name = ".".join(str(p) for p in path)
        where = path_str(path)
        if not name:
            raise CheckpointError("cannot save a bare tensor: save a mapping such as {'weight': tensor}")
        if name in self._by_name:
            raise CheckpointError(
                f"two values would be stored under the same tensor name '{name}' (key paths "
                f"{self._by_name[name]!r} and {where!r}); rename one of the keys. Nothing was written."
            )
        self._by_name[name] = where
        tensor, code = _storable(tensor, where)
        if tensor.numel():
            key = memory_key(tensor)
            first = self._by_memory.get(key)
            if first is not None:  # tied / shared: store once
                self.aliases[name] = first
                return first
            self._by_memory[key] = name
        shape = tuple(int(s) for s in tensor.shape)
        self.entries.append(Entry(name, tensor, code, shape, tensor.numel() * tensor.element_size()))
        return name


def _too_deep(path: Sequence[Any]) -> CheckpointError:
    return CheckpointError(f"cannot save the value at '{_short_path(path)}': it is nested deeper than {MAX_DEPTH} "
                           "levels (the most a checkpoint's JSON may hold; does a container or state_dict() contain "
                           "itself?). Nothing was written.")


def _short_path(path: Sequence[Any]) -> str:
    """`path_str` of a path that may be very deep: its first and last few keys."""
    if len(path) <= 12:
        return path_str(path)
    return f"{path_str(path[:6])}...({len(path) - 12} more)...{path_str(path[-6:])}"


def memory_key(t: torch.Tensor) -> Hashable:
    """Tensors with the same key are one tensor to store: views of the same memory with the same layout (tied
    weights: ``state_dict()`` gives distinct views of one parameter). A tensor with no memory of its own to compare
    (empty, meta, or a ``DTensor``, whose local shard may be empty on some ranks) is keyed by identity."""
    if hasattr(t, "placements") or t.is_meta or not t.numel():
        return id(t)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _storable(tensor: torch.Tensor, where: str) -> tuple[torch.Tensor, str]:
    """The detached plain tensor to write and its dtype code, or a `CheckpointError` saying why it cannot be."""
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        if hasattr(tensor, "placements") or hasattr(tensor, "full_tensor"):
            raise CheckpointError(f"cannot save the sharded tensor (DTensor) at '{where}': gather it first "
                                  "(e.g. tensor.full_tensor()). Nothing was written.")
        tensor = tensor.as_subclass(torch.Tensor)  # a plain subclass: keep the data, drop the behaviour
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
        what = "meta" if tensor.is_meta else ("quantized" if tensor.is_quantized else str(tensor.layout))
        raise CheckpointError(f"cannot save the {what} tensor at '{where}': only dense tensors with data "
                              "can be stored in safetensors. Nothing was written.")
    code = DTYPES.get(tensor.dtype)
    if code is None:
        raise CheckpointError(f"cannot save the tensor at '{where}': dtype {tensor.dtype} has no safetensors "
                              "equivalent. Nothing was written.")
    return tensor.detach(), code


@attrs.frozen
class Plan:
    """Everything to write: header bytes and tensors in file order."""

    header: bytes
    entries: tuple[Entry, ...]
    total: int  # file size in bytes


def plan(obj: Any, metadata: Mapping[str, Any] | None) -> Plan:
    """Encode ``obj`` (and ``metadata=``) into the header bytes and the tensors to write after it.

    Every error about the content is raised here, before anything touches the disk.
    """
    encoder = _Encoder()
    encoded = encoder.encode(obj, ())
    meta: dict[str, str] = {"format": "pt", KEY_FORMAT: FORMAT_VERSION, KEY_TREE: _dumps(encoded)}
    if encoder.aliases:
        meta[KEY_ALIASES] = _dumps(encoder.aliases)
    if metadata is not None:
        meta.update(_metadata_entries(metadata))
    return layout(encoder.entries, meta)


def entry(name: str, tensor: torch.Tensor) -> Entry:
    """The `Entry` of a plain dense tensor stored under ``name`` (a `CheckpointError` if it cannot be stored)."""
    tensor, code = _storable(tensor, name)
    return Entry(name, tensor, code, tuple(int(s) for s in tensor.shape), tensor.numel() * tensor.element_size())


def layout(entries: Iterable[Entry], meta: Mapping[str, str]) -> Plan:
    """The `Plan` of one safetensors file holding ``entries`` with the string metadata ``meta``.

    Largest element size first keeps every tensor aligned to its element size (the data starts 8-aligned).
    """
    entries = sorted(entries, key=lambda e: (-e.tensor.element_size(), e.name))
    header: dict[str, Any] = {"__metadata__": dict(meta)}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if len(raw) > MAX_HEADER:
        raise CheckpointError(f"the checkpoint header would be {len(raw)} bytes, over the safetensors limit of "
                              f"{MAX_HEADER}: too many non-tensor values. Nothing was written.")
    return Plan(len(raw).to_bytes(8, "little") + raw, tuple(entries), 8 + len(raw) + offset)


def _metadata_entries(metadata: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise CheckpointError("metadata= must be a mapping with str keys")
    out = {KEY_METADATA: _dumps(_Encoder().encode(dict(metadata), ("<metadata>",)), what="metadata")}
    if "__tensor__" in out[KEY_METADATA]:
        raise CheckpointError("metadata= must hold JSON-like values only (no tensors); put tensors in obj")
    for k, v in metadata.items():
        if isinstance(v, str) and k not in _RESERVED_METADATA:
            out[k] = v
    return out


def _dumps(value: Any, what: str = "state") -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:  # pragma: no cover - the encoder only emits JSON-able values
        raise CheckpointError(f"cannot encode the {what} as JSON: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# The header


#: One checked tensor entry of a header: its dtype, shape and ``[begin, end)`` byte span in the data section.
Span = tuple[torch.dtype, tuple[int, ...], int, int]


@attrs.frozen
class Header:
    """A checked safetensors header: where the data starts, the tensor entries and the string metadata."""

    path: pathlib.PurePath
    data_start: int
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]
    #: name -> its entry as checked by `parse_header`, so that a reader builds tensors without parsing again.
    spans: dict[str, Span] = attrs.field(factory=dict)


def parse_header(path: pathlib.PurePath, raw: bytes, size: int) -> Header:
    """Check the JSON header ``raw`` of the ``size``-byte file ``path`` (its 8-byte length prefix excluded).

    As strict as the safetensors library (`strict_json`: UTF-8, at most `MAX_DEPTH` levels, no duplicate key):
    every entry has a known dtype, a shape of non-negative ints (`shape_problem`) and ``data_offsets`` whose length
    matches them; sorted by offset the tensors tile the data exactly (no overlap,
    no hole) up to the end of the file; ``__metadata__`` is a map of strings.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    try:
        header = strict_json(raw)
    except ValueError as exc:  # UnicodeDecodeError too
        raise CheckpointError(f"'{path}' has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"'{path}' has a corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"'{path}' has a corrupt safetensors header: __metadata__ must map strings to strings")
    spans = {name: _span(path, name, info) for name, info in header.items()}
    # One sort by (begin, end, name), then one pass: each span must start where the previous one ended.
    end = 0
    for begin, stop, name in sorted((s[2], s[3], name) for name, s in spans.items()):
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a hole of {begin - end} bytes before it"
            raise CheckpointError(f"'{path}' is corrupt: the data of tensor '{name}' (bytes {begin}-{stop}) {what}")
        end = stop
    n = len(raw)
    if 8 + n + end != size:
        raise CheckpointError(f"'{path}' is incomplete or corrupt: the header describes {8 + n + end} bytes, the "
                              f"file has {size}")
    return Header(path, 8 + n, header, metadata, spans)


def _span(path: pathlib.PurePath, name: str, info: Any) -> Span:
    """The checked entry of one tensor of a header.

    The common case (a well-formed entry) is one pass of exact type tests (a JSON value that is an ``int`` is
    never a subclass other than ``bool``, which ``type(x) is int`` already refuses); anything else goes through
    `_span_problem`, which names what is wrong. Both accept exactly the same entries.
    """
    if type(info) is dict:
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = FROM_CODE.get(code) if type(code) is str else None
        if (dtype is not None and type(shape) is list and type(offsets) is list and len(offsets) == 2
                and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            begin, stop = offsets
            nbytes = math.prod(shape) * dtype.itemsize
            # zero bytes: the dimensions are bounded by nothing else (see shape_problem); otherwise by the file size
            if (type(begin) is int and type(stop) is int and begin >= 0 and stop - begin == nbytes
                    and (nbytes or shape_problem(shape) is None)):
                return dtype, tuple(shape), begin, stop
    raise _span_problem(path, name, info)


def _span_problem(path: pathlib.PurePath, name: str, info: Any) -> CheckpointError:
    """What is wrong with a header entry that `_span` refused."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"'{path}': corrupt entry for tensor '{name}' in the header: {what}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return bad("it needs dtype, shape and data_offsets")
    dtype = FROM_CODE.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        return CheckpointError(f"'{path}': tensor '{name}' has dtype {brief(info['dtype'])}, unknown to this torch")
    shape, offsets = info["shape"], info["data_offsets"]
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        return bad(problem)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(natural(x) for x in offsets):
        return bad(f"data_offsets {brief(offsets)} is not two non-negative ints")
    begin, stop = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    return bad(f"data_offsets {brief(offsets)} hold {brief(stop - begin)} bytes, shape {brief(shape)} of "
               f"{info['dtype']} needs {brief(nbytes)}")


def json_entry(header: Header, key: str, default: Any) -> Any:
    """The JSON value stored under ``key`` in ``header``'s string metadata, or ``default`` when the key is absent;
    text that is not JSON is a `CheckpointError` naming the file and the key (its structure is the caller's check)."""
    raw = header.metadata.get(key)
    if raw is None:
        return default
    try:
        return strict_json(raw)
    except ValueError as exc:
        raise CheckpointError(f"'{header.path}' has corrupt distfn metadata: {key} is not JSON ({exc})") from None


def saved_tree(header: Header) -> Any:
    """The saved object's JSON tree, checked (`check_tree`); a foreign file (no distfn metadata) reads as a flat
    name -> tensor map."""
    if KEY_TREE not in header.metadata:
        return {name: {"__tensor__": name} for name in header.tensors}
    node = json_entry(header, KEY_TREE, None)
    check_tree(node, header.tensors, header.path)
    return node


def saved_aliases(header: Header) -> dict[str, str]:
    """The tied names of a file: ``{alias: stored name}`` (checked: strings naming stored tensors)."""
    aliases = json_entry(header, KEY_ALIASES, {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"'{header.path}' has corrupt distfn metadata: {KEY_ALIASES} must map names to names")
    return aliases


def select(where: object, names: Sequence[str], aliases: Mapping[str, str], prefix: str | None,
           get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` a load returns, for one file and a sharded directory alike: every stored tensor
    (read through ``get``) and every tied name pointing at the same tensor; with ``prefix`` (``"model"``) only those
    under that key path, with it removed.

    Raises:
        CheckpointError: nothing under ``prefix`` (naming what ``where`` holds), or a tied name without its tensor.
    """
    start = "" if prefix is None else prefix.rstrip(".") + "."
    if prefix is not None:
        wanted = {n for n in [*names, *aliases] if n.startswith(start)}
        if not wanted:
            raise CheckpointError(f"'{where}' has no tensors under '{prefix}' (it holds "
                                  f"{describe(sorted({n.split('.')[0] for n in names}))})")
        names = [n for n in names if n in wanted or n in {aliases.get(w) for w in wanted}]
    stored = {name: get(name) for name in names}
    if not aliases and not start:  # the whole file, no tied names: the dict as read
        return stored
    out = dict(stored)
    for alias, target in aliases.items():
        if target not in stored:
            if prefix is None:
                raise CheckpointError(f"'{where}': the tied name '{alias}' refers to a missing tensor '{target}'")
            continue
        out[alias] = stored[target]
    return {n[len(start):]: t for n, t in out.items() if n.startswith(start)}


def saved_metadata(header: Header) -> dict[str, Any]:
    """The ``metadata=`` mapping saved with a file (checked), or its raw string metadata for a foreign file."""
    if KEY_METADATA not in header.metadata:
        return dict(header.metadata)
    node = json_entry(header, KEY_METADATA, None)
    check_tree(node, None, header.path)
    value = decode(node, NoTensors())
    if not isinstance(value, dict):
        raise CheckpointError(f"'{header.path}' has corrupt distfn metadata: {KEY_METADATA} is not a mapping")
    return value


def check(header: Header) -> Any:
    """Check everything distfn reads from a header (tree, aliases, metadata) without reading any tensor.

    Returns:
        The saved tree (`saved_tree`).
    """
    saved_aliases(header)
    saved_metadata(header)
    return saved_tree(header)


# --------------------------------------------------------------------------------------------------
# Tags: what each may hold, checked before anything is decoded

#: Every dtype a ``{"__dtype__": name}`` tag may name (and nothing else from the torch namespace).
DTYPE_NAMES: Final[dict[str, torch.dtype]] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_FLOATS: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def check_tree(node: Any, tensors: Mapping[str, Any] | None, path: pathlib.PurePath | None = None) -> None:
    """Raise `CheckpointError` (naming ``path``) unless every tag in ``node`` holds what it may: a stored tensor's
    name (``tensors``; ``None``: no tensor references allowed), a float name, a known dtype or device, lists."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if len(item) == 1 and next(iter(item)) in TAGS:
                (tag, value), = item.items()
                problem = _tag_problem(tag, value, tensors)
                if problem is not None:
                    where = f"'{path}' has corrupt distfn metadata" if path else "corrupt distfn metadata"
                    raise CheckpointError(f"{where}: {problem}")
                if tag in ("__tuple__", "__dict__"):
                    stack.extend(value)
            else:
                stack.extend(item.values())


def _key_node(node: Any) -> bool:
    """Whether ``node`` decodes to a hashable value (what the encoder writes for a mapping key: a scalar, a float
    name, a dtype, a device, a tensor, or a tuple of those), so that decoding its mapping cannot raise TypeError."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            return False
        if isinstance(item, dict):
            if len(item) != 1 or next(iter(item)) not in ("__float__", "__dtype__", "__device__", "__tensor__",
                                                          "__tuple__"):
                return False
            (tag, value), = item.items()
            if tag == "__tuple__" and isinstance(value, list):
                stack.extend(value)
    return True


def _tag_problem(tag: str, value: Any, tensors: Mapping[str, Any] | None) -> str | None:
    if tag in ("__tensor__", "__ndarray__"):
        if tensors is None:
            return f"unexpected tensor reference {brief(value)}"
        return None if isinstance(value, str) and value in tensors else f"{tag} names no stored tensor: {brief(value)}"
    if tag == "__tuple__":
        return None if isinstance(value, list) else f"__tuple__ holds {type(value).__name__}, not a list"
    if tag == "__dict__":
        ok = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)
        if not ok:
            return "__dict__ must hold [key, value] pairs"
        bad = next((p[0] for p in value if not _key_node(p[0])), None)
        return None if bad is None else f"__dict__ has the key {brief(bad)}, which cannot be a mapping key"
    if tag == "__float__":
        return None if isinstance(value, str) and value in _FLOATS else f"__float__ {brief(value)} is not nan/inf/-inf"
    if tag == "__dtype__":
        return None if isinstance(value, str) and value in DTYPE_NAMES else f"__dtype__ {brief(value)} is not a dtype"
    if isinstance(value, str):  # "__device__"
        try:
            torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            return f"__device__ {brief(value)} is not a device"
        return None
    return f"__device__ {brief(value)} is not a device"


# --------------------------------------------------------------------------------------------------
# Decoding: JSON tree -> Python values


class TensorSource(Protocol):
    """Where `decode` reads referenced tensors from (the storage reader, or `NoTensors`)."""

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor: ...


class NoTensors:
    """A `TensorSource` for trees that must not reference tensors (metadata, mapping keys)."""

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        raise CheckpointError(f"unexpected tensor reference {brief(name)} in metadata")


def decode(node: Any, reader: TensorSource, device: torch.device | None = None) -> Any:
    """Rebuild the Python value of a JSON tree node (checked by `check_tree`), reading referenced tensors from
    ``reader``."""
    if isinstance(node, list):
        return [decode(v, reader, device) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, value), = node.items()
        if tag in TAGS:
            return _decode_tag(tag, value, reader, device)
    return {k: decode(v, reader, device) for k, v in node.items()}


def _decode_tag(tag: str, value: Any, reader: TensorSource, device: torch.device | None) -> Any:
    if tag == "__tensor__":
        return reader.get(value, device)
    if tag == "__ndarray__":
        tensor = reader.get(value, torch.device("cpu"))
        try:
            return tensor.numpy()
        except (TypeError, RuntimeError) as exc:  # a dtype NumPy lacks (bfloat16, float8), or no NumPy installed
            raise CheckpointError(f"the saved NumPy array '{value}' ({tensor.dtype}) cannot be rebuilt: {exc}"
                                  ) from None
    if tag == "__tuple__":
        return tuple(decode(v, reader, device) for v in value)
    if tag == "__float__":
        return _FLOATS[value]
    if tag == "__dtype__":
        return DTYPE_NAMES[value]
    if tag == "__device__":
        return torch.device(value)
    return {decode(k, reader, device): decode(v, reader, device) for k, v in value}  # "__dict__"


def ref(node: Any) -> str | None:
    """The stored tensor name if ``node`` is a tensor reference."""
    if isinstance(node, dict) and len(node) == 1 and "__tensor__" in node:
        return str(node["__tensor__"])
    return None


def as_plain_dict(node: Any) -> dict[Any, Any] | None:
    """A tree node that encodes a mapping, as a dict of (encoded) children keyed by decoded keys."""
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        (tag, value), = node.items()
        if tag == "__dict__":
            return {decode(k, NoTensors()): v for k, v in value}
        if tag in TAGS:
            return None
    return node


def kind(node: Any) -> str:
    """What a tree node holds, for messages: ``a tensor``, ``a mapping with keys ...``, ``the value 3``."""
    if ref(node) is not None:
        return "a tensor"
    if isinstance(node, dict) and len(node) == 1 and next(iter(node)) in TAGS:
        return f"a {next(iter(node)).strip('_')}"
    if isinstance(node, dict):
        return f"a mapping with keys {describe([str(k) for k in node])}"
    if isinstance(node, list):
        return "a list"
    return f"the value {brief(node)}"


def refuse_plain_loader(target: Any, node: Any, where: str) -> None:
    """Raise when ``target`` holds a torch ``DataLoader`` (not a ``ctx.dataloader``): it has no position to
    continue from, so replacing it by the saved value (what a plain value gets) would silently restart the data at
    batch 0 while the model resumes."""
    loaders = [leaf for leaf in tree.tree_leaves(target, is_leaf=lambda v: isinstance(v, DataLoader))
               if isinstance(leaf, DataLoader) and not is_stateful(leaf)]
    if not loaders:
        return
    saved = as_plain_dict(node)
    held = (" The checkpoint holds a ctx.dataloader's position there (epoch and batch)."
            if saved is not None and {"epoch", "position", "global_batch"} <= set(saved) else "")
    raise CheckpointError(
        f"cannot restore into the torch {type(loaders[0]).__qualname__} at '{where}': a plain DataLoader has no "
        f"position to continue from, so the data would silently start again at batch 0.{held} Build the loader "
        "with ctx.dataloader(dataset, batch_size, ...) (same dataset, shuffle and drop_last as the saved one): "
        "it continues at the saved batch. Or leave it out of what you restore. Nothing was restored.")
