"""Parsing what a file says, within bounds: the JSON of headers, indexes and saved trees, and tensor shapes.

Everything a checkpoint file holds is untrusted (docs/threats.md): `strict_json` parses its JSON as strictly as the
safetensors library, refusing deep nesting *before* `json.loads` recurses into it; `shape_problem` bounds a shape
before torch allocates for it; `brief` keeps a hostile value's repr in a message short. Used by
`distfn.checkpoint.format` (one file) and `distfn.checkpoint.sharded.read` (a directory's index).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any, Final

import torch

__all__ = ["MAX_DEPTH", "MAX_NDIM", "brief", "natural", "nesting", "shape_problem", "strict_json"]

#: The deepest JSON nesting distfn writes or reads (a header, an index, a saved tree): serde_json's default recursion
#: limit, so the safetensors library refuses deeper headers too. `plan` refuses to save a value nested deeper.
MAX_DEPTH: Final = 128
#: The most dimensions a stored tensor may have (NumPy 2's limit): a shape claiming millions would make torch
#: allocate sizes and strides for each before anything else is checked.
MAX_NDIM: Final = 64
_INT64: Final = 2**63 - 1


class _Brief(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 40
        self.maxlist = self.maxdict = self.maxtuple = 8

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError (and a product of 64 claimed dimensions gets there)
        bits = abs(x).bit_length()
        return f"<an int of {bits} bits>" if bits > 128 else super().repr_int(x, level)


_BRIEF: Final = _Brief()


def brief(value: Any) -> str:
    """A bounded repr of a value read from a file, for messages: depth, length and digits are cut (a hostile
    entry may be a list of millions, nested as deep as a header allows, or an int of thousands of digits)."""
    return _BRIEF.repr(value)


def natural(value: Any) -> bool:
    """Whether ``value`` is a non-negative int (and not a bool, which JSON ``true`` would give)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_NOT_BRACKET: Final = bytes(c for c in range(256) if c not in b"[]{}")
_PARENS: Final = bytes.maketrans(b"[{]}", b"(())")
_STEPS: Final = bytes.maketrans(b"()", b"\x01\xff")  # an opening bracket +1, a closing one -1 (as int8)
_PASSES: Final = 16
_ESCAPED_SURROGATE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SCAN_CHUNK: Final = 1 << 24


def nesting(raw: bytes | str) -> int:
    """The deepest bracket nesting of the JSON text ``raw`` outside its strings (for text that is not JSON, at least
    as deep as `json.loads` would recurse before it fails), computed without recursion and at C speed: strings
    removed, brackets kept, then innermost pairs removed a few times (a header is 3 deep, a saved tree rarely over
    10), a cumulative sum for anything deeper. About 1 ms for a 300 KB header of 2,100 tensors."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    count = data.count(b"[") + data.count(b"{")
    if count <= MAX_DEPTH:  # the common small case: no deeper than that anyway
        return count
    # Strings out: with escaped backslashes and quotes removed first, every string runs from one quote to the next,
    # so the text outside them is every other piece of a split on quotes (twice as fast as a regex over the
    # escapes of a saved tree). Outside a string a backslash is invalid JSON, where json.loads stops before
    # nesting further, so for every prefix json.loads accepts this finds exactly its strings; an unterminated one
    # runs to the end (json.loads stops there too).
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    steps = b"".join(unescaped.split(b'"')[::2]).translate(_PARENS, _NOT_BRACKET)
    shallow = steps
    for depth in range(_PASSES):
        if not shallow:
            return depth
        shallow = shallow.replace(b"()", b"")  # every innermost pair: one level less
    deepest, level = 0, 0
    for start in range(0, len(steps), _SCAN_CHUNK):  # bounded memory for a 100 MB header
        part = torch.frombuffer(bytearray(steps[start:start + _SCAN_CHUNK].translate(_STEPS)), dtype=torch.int8)
        sums = part.cumsum(0, dtype=torch.int64) + level
        deepest, level = max(deepest, int(sums.max())), int(sums[-1])
    return deepest


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {brief(duplicate)} appears twice in one object")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes | str) -> Any:
    """Parse JSON read from a file, as strictly as the safetensors library and within fixed bounds.

    Bytes must be UTF-8 (not UTF-16/32, which `json.loads` would guess); nesting deeper than `MAX_DEPTH` is refused
    *before* parsing (`json.loads` recurses once per level: 100,000 levels are a ``RecursionError``, or a crashed
    interpreter where the recursion limit was raised); a key twice in one object (two readers would see two
    different files), ``NaN``/``Infinity`` and lone surrogates (``"\\ud800"``, not Unicode) are refused.

    Raises:
        ValueError: naming what is wrong (``UnicodeDecodeError`` for bytes that are not UTF-8).
    """
    if not isinstance(raw, (bytes, str)):
        raise ValueError(f"expected JSON text, found {brief(raw)}")
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # strict: invalid bytes raise
    depth = nesting(raw)
    if depth > MAX_DEPTH:
        raise ValueError(f"nested {depth} levels deep, over the limit of {MAX_DEPTH}")
    value = json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    if _ESCAPED_SURROGATE.search(text) is not None:  # rare: only then look for one that is not half of a pair
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate escape (\\ud800-\\udfff): not Unicode") from None
    return value


def shape_problem(shape: Any, itemsize: int = 1) -> str | None:
    """What makes ``shape`` (read from a file) unusable as a tensor's shape, or ``None``: it must be a list of at
    most `MAX_NDIM` non-negative ints whose product, zeros aside, fits torch's int64 sizes (a shape of zero
    elements costs no bytes in a file, so only this bound keeps ``[0, 10**30]`` from reaching ``torch.empty``)."""
    if not isinstance(shape, list) or not all(natural(d) for d in shape):
        return f"shape {brief(shape)} is not a list of non-negative ints"
    if len(shape) > MAX_NDIM:
        return f"shape has {len(shape)} dimensions, over the limit of {MAX_NDIM}"
    if math.prod(max(d, 1) for d in shape) * itemsize > _INT64:
        return f"shape {brief(shape)} is too large for a tensor (over 2**63 bytes)"
    return None
