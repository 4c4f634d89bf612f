"""Property tests (issue 41 part B) for every parser of untrusted checkpoint input.

What a checkpoint file or directory holds is hostile (docs/threats.md): each property builds many hostile inputs
(headers, sharded indexes and weight maps, saved trees, shard metadata, paths) and checks the documented outcome:
the read succeeds, or ends in `CheckpointError`; never another exception, never an open outside the checkpoint's
directory, never more memory than the file holds, and within a few seconds. Each property keeps its examples few
(CI time is the scarce resource); hypothesis is in the ``test`` extra, so a bare install skips this module.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra: pip install 'distfn[test]')")

import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_checkpoint_damaged import B, W, _two_shards
from torch import nn

import distfn
from distfn import CheckpointError
from distfn import tree as walker
from distfn.checkpoint import consolidate, sharded, untrusted
from distfn.checkpoint import format as fmt
from distfn.checkpoint.layout import INDEX, resolve

#: The most one hostile input may take (a loaded 2-core CI machine; an honest parse takes milliseconds).
QUICK_S = 5.0
FEW = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
SHARD1, SHARD2 = (f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2))

# -- what the reads may open ---------------------------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # permanent, but a no-op outside `_opens`
_CODE = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, str(Path(distfn.__file__).parents[1])})


@contextlib.contextmanager
def _opens_only_inside(root: Path) -> Iterator[None]:
    """Fail if anything under the block opens a file outside ``root`` (imports of code aside)."""
    global _OPENED
    _OPENED = []
    try:
        yield
    finally:
        opened, _OPENED = _OPENED, None
    here = os.path.realpath(root)  # the directory itself too: a durable rename fsyncs it
    outside = [p for p in opened if p != here and not p.startswith(here + os.sep) and not p.startswith(_CODE)
               and not p.endswith((".py", ".pyc", ".so"))]
    assert not outside, f"opened outside {root}: {outside}"


def _settled(call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the `CheckpointError` it raised (any other exception fails the test), quickly."""
    start = time.perf_counter()
    try:
        return call()
    except CheckpointError as exc:
        return exc
    finally:
        assert time.perf_counter() - start < QUICK_S, "a hostile input took too long"


# -- strategies ----------------------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 64)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
#: Saved-tree nodes: JSON with distfn's tags mixed in, holding anything (a name, a list, junk).
tagged = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
                   | st.builds(lambda tag, value: {tag: value}, st.sampled_from(fmt.TAGS),
                               inner | st.sampled_from(["model.w", "model.b", "nan", "float32", "cpu", "load"])
                               | st.lists(st.lists(inner, min_size=2, max_size=2), max_size=3))),
    max_leaves=20)
dims = st.integers(0, 5) | st.integers(-2, 2**70) | st.sampled_from([True, 2.0, "3", None, 2**63, 2**64])
codes = st.sampled_from([*fmt.FROM_CODE, "F99", "f32", ""]) | json_values


def _deep(depth: int, inner: str = "0") -> str:
    return "[" * depth + inner + "]" * depth


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header's JSON bytes (hostile or not) and how many data bytes follow it."""
    n = draw(st.integers(0, 4))
    entries: dict[str, Any] = {}
    offset = 0
    for i in range(n):  # start from a consistent file, then break one thing (or not)
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = math.prod(shape) * 4
        entries[f"t{i}"] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    data = offset
    if entries and draw(st.booleans()):
        victim = entries[draw(st.sampled_from(sorted(entries)))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "all"]))
        if field == "dtype":
            victim["dtype"] = draw(codes)
        elif field == "shape":
            victim["shape"] = draw(st.lists(dims, max_size=70) | json_values)
        elif field == "data_offsets":
            victim["data_offsets"] = draw(st.lists(st.integers(-8, 2**64) | dims, max_size=3) | json_values)
        else:
            entries[draw(st.sampled_from(sorted(entries)))] = draw(json_values)
    if draw(st.booleans()):
        entries["__metadata__"] = draw(st.dictionaries(st.sampled_from(["distfn.tree", "distfn.aliases",
                                                                        "distfn.metadata", "x"]),
                                                       tagged.map(json.dumps) | st.text(max_size=10), max_size=3)
                                       | json_values)
    text = json.dumps(entries)
    attack = draw(st.sampled_from(["none", "deep", "duplicate", "bytes", "nan", "surrogate"]))
    if attack == "deep":
        text = text[:-1] + (", " if entries else "") + f'"deep": {_deep(draw(st.integers(100, 5000)))}' + "}"
    elif attack == "duplicate" and entries:
        text = text[:-1] + ", " + text[1:]  # every key twice
    elif attack == "nan":
        text = text[:-1] + (", " if entries else "") + '"n": NaN}'
    elif attack == "surrogate":
        text = text[:-1] + (", " if entries else "") + '"\\ud800": 1}'
    raw = text.encode()
    if attack == "bytes":
        raw = raw[:1] + draw(st.binary(min_size=1, max_size=8)) + raw[1:]
    return raw, data + draw(st.sampled_from([0, 0, 0, 1, -1]))


def _write_file(path: Path, raw: bytes, data: int) -> Path:
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(max(data, 0)))
    return path


# -- one file --------------------------------------------------------------------------------------------------------


@FEW
@given(headers())
def test_any_header_loads_or_is_a_checkpoint_error_never_more(case: tuple[bytes, int]) -> None:
    raw, data = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        good = distfn.checkpoint.save({"w": torch.ones(2)}, root / "ckpt-1.safetensors")
        path = _write_file(root / "ckpt-2.safetensors", raw, data)
        size = path.stat().st_size
        with _opens_only_inside(root):
            got = _settled(lambda: distfn.load(path))
            restored = _settled(lambda: distfn.checkpoint.load_into(path, {}))
            meta = _settled(lambda: distfn.checkpoint.read_metadata(path))
            newest = _settled(lambda: distfn.latest(root))
        assert newest in (path, good)  # a damaged newest file is skipped, never an error for the directory
        for result in (got, restored, meta):
            assert isinstance(result, (dict, CheckpointError))
            if isinstance(result, CheckpointError):
                assert "ckpt-2.safetensors" in str(result)
        if isinstance(got, dict):  # nothing claimed beyond the file: every tensor is bytes the file holds
            assert sum(t.numel() * t.element_size() for t in got.values()) <= size
        if b"[" * 129 in raw or b"NaN" in raw or b"\\ud800" in raw:
            assert isinstance(got, CheckpointError) and newest == good


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 2**64 - 1), st.sampled_from(["x.safetensors", "x.bin"]))
def test_any_bytes_with_any_length_prefix_are_refused_without_reading_what_they_claim(
        body: bytes, claimed: int, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(claimed.to_bytes(8, "little") + body)
        with _opens_only_inside(Path(tmp)):
            result = _settled(lambda: distfn.load(path))
        assert isinstance(result, (dict, CheckpointError))


@FEW
@given(st.integers(1, 4000), st.sampled_from(["header", "tree", "aliases", "metadata"]))
def test_nesting_over_the_limit_is_refused_before_parsing_at_any_depth(depth: int, where: str) -> None:
    """json.loads recurses once per level: each of these was a bare RecursionError (issue 41 item 19)."""
    meta = {"distfn.format": "1", "distfn.tree": "{}"}
    header: dict[str, Any] = {"__metadata__": meta}
    text = _deep(depth - 1 if where == "header" else depth)
    if where == "header":
        raw = json.dumps(header)[:-1].encode() + b', "x": ' + text.encode() + b"}"
    else:
        meta[{"tree": "distfn.tree", "aliases": "distfn.aliases", "metadata": "distfn.metadata"}[where]] = text
        raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_file(Path(tmp) / "ckpt-1.safetensors", raw, 0)
        results = [_settled(lambda: distfn.checkpoint.load_into(path, {})),
                   _settled(lambda: distfn.checkpoint.read_metadata(path)),
                   _settled(lambda: distfn.latest(tmp))]
    if depth > fmt.MAX_DEPTH:
        assert isinstance(results[0], CheckpointError) and results[2] is None
        assert f"over the limit of {fmt.MAX_DEPTH}" in str(results[0])


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\ab,:', max_size=12)
tricky_json = st.recursive(st.none() | st.integers() | tricky_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
                           max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(tricky_json, st.integers(0, 200))
def test_the_depth_scan_measures_exactly_the_nesting_json_parses(value: Any, wrap: int) -> None:
    """Strings full of brackets, quotes and backslashes never count; every real level does."""
    value = [value] if wrap == 0 else value
    for _ in range(wrap):
        value = {"k": value}
    text = json.dumps(value)
    assert untrusted.nesting(text) == _depth(value) or untrusted.nesting(text) == text.count("[") + text.count("{")
    assert untrusted.nesting(text.encode()) == untrusted.nesting(text)
    parsed = _settled(lambda: untrusted.strict_json(text)) if _depth(value) <= fmt.MAX_DEPTH else None
    assert parsed is None or parsed == value


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='[]{}"\\a,:0 ', max_size=300), st.integers(0, 2000))
def test_no_text_makes_the_parser_recurse_past_the_limit(text: str, depth: int) -> None:
    """Whatever the text (not JSON included), strict_json either parses it within the limit or raises ValueError
    before json.loads recurses: never a RecursionError."""
    for candidate in (text, "[" * depth + text, text + "[" * depth + '"' + text):
        try:
            untrusted.strict_json(candidate)
        except ValueError:
            pass


@settings(FEW, max_examples=60)
@given(tagged, st.sampled_from(["tree", "metadata", "aliases"]))
def test_any_saved_tree_restores_or_is_a_checkpoint_error_and_changes_nothing(node: Any, where: str) -> None:
    """A hostile tree over real tensors: restoring a model, an optimizer and a step from it either works or changes
    nothing (every target is checked before any is restored)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        path = distfn.checkpoint.save({"model": model, "opt": opt, "step": 3}, Path(tmp) / "ckpt-1.safetensors")
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        key = {"tree": "distfn.tree", "metadata": "distfn.metadata", "aliases": "distfn.aliases"}[where]
        header["__metadata__"][key] = json.dumps({"model": node} if where == "tree" else node)
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % 8)
        tensors = raw[8 + n:]
        path.write_bytes(len(text).to_bytes(8, "little") + text + tensors)
        fresh = nn.Linear(2, 2)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        into = {"model": fresh, "opt": torch.optim.SGD(fresh.parameters(), lr=0.1), "step": 0}
        result = _settled(lambda: distfn.checkpoint.load_into(path, into))
        _settled(lambda: distfn.checkpoint.read_metadata(path))
        _settled(lambda: distfn.load(path))
        if isinstance(result, CheckpointError):
            assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


keys = st.text(max_size=6) | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=3)) | st.none()
saveable = st.recursive(
    st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats() | st.text(max_size=10)
    | st.sampled_from([torch.float16, torch.bfloat16, torch.device("cpu")]),
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(keys, inner, max_size=4)),
    max_leaves=20)


@FEW
@given(saveable)
def test_json_like_values_round_trip(value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = distfn.checkpoint.save({"v": value, "w": torch.ones(1)}, Path(tmp) / "x.safetensors")
        assert _same(distfn.checkpoint.load_into(path, {})["v"], value)


@FEW
@given(st.lists(st.sampled_from(["list", "tuple", "dict", "keyed"]), min_size=1, max_size=300))
def test_a_value_nested_too_deep_to_read_back_is_refused_at_the_save(kinds: list[str]) -> None:
    """The encoder counts the JSON levels it writes: a save either round-trips or is refused with nothing
    written (a value nested 300 deep was a RecursionError, or a file no reader could open)."""
    value: Any = 1
    for kind in kinds:
        value = {"list": lambda v: [v], "tuple": lambda v: (v,), "dict": lambda v: {"k": v},
                 "keyed": lambda v: {1: v}}[kind](value)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "x.safetensors"
        saved = _settled(lambda: distfn.checkpoint.save({"v": value}, target))
        if isinstance(saved, CheckpointError):
            assert "nested deeper than 128" in str(saved) and not list(Path(tmp).iterdir())
            assert len(kinds) > fmt.MAX_DEPTH // 3
        else:
            assert _same(distfn.checkpoint.load_into(target, {})["v"], value)
    if len(kinds) < fmt.MAX_DEPTH // 3:
        assert not isinstance(saved, CheckpointError)


# -- sharded directories ------------------------------------------------------------------------------------------

_FILES = st.sampled_from(["../outside/victim.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ".", "",
                          "x\0.safetensors", SHARD1, SHARD2, "..\\x.safetensors", ".hidden.safetensors",
                          "%2e%2e/x.safetensors", "~/x.safetensors", "file:///etc/passwd", "x" * 300 + ".safetensors"])


@st.composite
def index_damage(draw: st.DrawFn) -> Callable[[dict[str, Any]], None]:
    kind = draw(st.sampled_from(["weight map", "tensors", "tree", "whole", "deep", "metadata"]))
    if kind == "weight map":
        names = st.sampled_from(["model.w", "model.b"]) | st.text(max_size=6)
        value = draw(st.dictionaries(names, _FILES | json_values, max_size=3) | json_values)
        return lambda i: i.update(weight_map=value)
    if kind == "tensors":
        spec = st.fixed_dictionaries({"dtype": codes, "shape": st.lists(dims, max_size=70) | json_values})
        table = draw(st.dictionaries(st.sampled_from(["model.w", "model.b", "other"]), spec | json_values,
                                     max_size=3))
        return lambda i: i["metadata"].update({"distfn.tensors": json.dumps(table)})
    if kind == "tree":
        node = draw(tagged)
        return lambda i: i["metadata"].update({"distfn.tree": json.dumps({"model": node, "step": 3})})
    if kind == "whole":
        value = draw(json_values)
        return lambda i: (i.clear(), i.update({"x": value}))
    if kind == "deep":
        depth = draw(st.integers(100, 3000))
        field = draw(st.sampled_from(["distfn.tensors", "distfn.tree", "distfn.aliases"]))
        return lambda i: i["metadata"].update({field: _deep(depth)})
    extra = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3))
    return lambda i: i["metadata"].update(extra)


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _two_shards(tmp_path_factory.mktemp("base") / "ckpt-3")


def _readers_settle(root: Path, d: Path) -> list[Any]:
    """Every reader of a sharded directory: load, load_into, consolidate (next to it), latest."""
    out = root / "out.safetensors"
    with _opens_only_inside(root):
        results = [_settled(lambda: distfn.load(d)),
                   _settled(lambda: sharded.load_into(d, {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}})),
                   _settled(lambda: consolidate(d, out)),
                   _settled(lambda: distfn.latest(d.parent))]
    if isinstance(results[2], CheckpointError):  # nothing written: no file, no temporary
        assert not [p for p in root.iterdir() if p.name.startswith(("out", ".out"))]
    assert results[3] in (None, d)
    for result in results[:3]:
        if isinstance(result, CheckpointError):
            assert "ckpt-3" in str(result) or "victim" in str(result)
    return results


@FEW
@given(index_damage())
def test_any_sharded_index_loads_or_is_a_checkpoint_error_never_reading_outside(
        two_shards: Path, damage: Callable[[dict[str, Any]], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        outside = root.parent / f"{root.name}-outside"  # a real shard-like file outside the checkpoint's tree
        outside.mkdir()
        try:
            save_file({"model.w": torch.full((2, 4), -41.5)}, str(outside / "victim.safetensors"))
            d = shutil.copytree(two_shards, root / "run" / "ckpt-3")
            (root / "run" / "outside").symlink_to(outside)  # "../outside/victim.safetensors" would reach it
            index = json.loads((d / INDEX).read_text())
            damage(index)
            (d / INDEX).write_text(json.dumps(index))
            got = _readers_settle(root, d)[0]
            if isinstance(got, dict):
                assert not any(bool((t == -41.5).any()) for t in got.values())  # never the victim's values
        finally:
            shutil.rmtree(outside)


@FEW
@given(json_values | st.lists(st.integers(-3, 2**64) | dims, max_size=4).map(lambda o: {"model.w": {
    "saved_offsets": o}}), st.sampled_from([SHARD1, SHARD2]))
def test_any_shard_sharding_info_loads_or_is_a_checkpoint_error(two_shards: Path, info: Any, shard: str) -> None:
    """The offsets of each piece come from the shard's own metadata: hostile ones must never place a piece outside
    its tensor, leave elements no file provided, or escape as IndexError/TypeError."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        d = shutil.copytree(two_shards, root / "run" / "ckpt-3")
        rows = slice(0, 2) if shard == SHARD1 else slice(2, 4)
        tensors = {"model.w": W[rows].clone(), **({"model.b": B.clone()} if shard == SHARD1 else {})}
        save_file(tensors, str(d / shard), metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps(info)})
        got = _readers_settle(root, d)[0]
        if isinstance(got, dict):
            assert torch.equal(got["model.w"], W) and torch.equal(got["model.b"], B)


@FEW
@given(st.lists(st.sampled_from([".", "..", "run", "ckpt-3", "sub", "alias", "x.safetensors", SHARD1]), min_size=1,
                max_size=6))
@example(parts=["alias", "run", "..", ".."])  # CI: the parent made for the file went through the symlink into d
def test_consolidate_never_writes_inside_the_checkpoint_directory(two_shards: Path, parts: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        d = shutil.copytree(two_shards, root / "run" / "ckpt-3")
        (root / "alias").symlink_to(d)
        (root / "sub").mkdir()
        before = {p.name: p.read_bytes() for p in d.iterdir()}
        target = root.joinpath(*parts)
        real = os.path.realpath(target)
        assume(os.path.realpath(root) in (real, os.path.dirname(real)) or real.startswith(os.path.realpath(root)))
        result = _settled(lambda: consolidate(d, target))
        inside = real == os.path.realpath(d) or real.startswith(os.path.realpath(d) + os.sep)
        if inside:
            assert isinstance(result, CheckpointError) and "inside the checkpoint directory" in str(result)
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # the source is never changed
        assert torch.equal(distfn.load(d)["model.w"], W)


# -- the walker (distfn.tree) ----------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "a b")
containers = st.recursive(
    st.integers() | st.text(max_size=4) | st.none(),
    lambda inner: (st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3).map(collections.OrderedDict)
                   | st.builds(Pair, inner, inner)),
    max_leaves=24)


@settings(max_examples=60, deadline=None)
@given(containers, st.integers(0, 3000))
def test_the_walker_round_trips_any_nesting_at_any_depth(value: Any, depth: int) -> None:
    for _ in range(depth):  # deeper than the recursion limit: the walker keeps its own stack
        value = [value]
    leaves = walker.tree_leaves(value)
    rebuilt = walker.tree_unflatten(value, leaves)
    for _ in range(depth):
        assert type(rebuilt) is list and len(rebuilt) == 1
        rebuilt, value = rebuilt[0], value[0]
    assert rebuilt == value and type(rebuilt) is type(value)
    assert walker.tree_leaves(walker.tree_map(repr, value)) == [repr(x) for x in walker.tree_leaves(value)]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 50), st.sampled_from(["list", "dict"]))
def test_a_container_that_contains_itself_is_a_value_error(depth: int, kind: str) -> None:
    root: Any = [] if kind == "list" else {}
    node = root
    for _ in range(depth):
        child: Any = [] if kind == "list" else {}
        node.append(child) if isinstance(node, list) else node.update(k=child)
        node = child
    node.append(root) if isinstance(node, list) else node.update(k=root)
    with pytest.raises(ValueError, match="contains itself"):
        walker.tree_leaves(root)
    with pytest.raises(ValueError, match="contains itself"):
        walker.tree_map(lambda x: x, root)
    with tempfile.TemporaryDirectory() as tmp:  # and a save of it is an error naming the depth, not a RecursionError
        saved = _settled(lambda: distfn.checkpoint.save({"v": root}, Path(tmp) / "x.safetensors"))
        assert isinstance(saved, CheckpointError) and "contain itself" in str(saved)


# -- paths (distfn.checkpoint.layout.resolve: parsing only; layout.py itself belongs to another change) -----------

local_text = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=40)


@FEW
@given(local_text.filter(lambda t: "://" not in t and not t.startswith("~")))
def test_a_local_path_resolves_to_one_absolute_place(text: str) -> None:
    loc = resolve(text)
    assert loc.path.is_absolute() and resolve(text) == loc and resolve(loc) is loc
    assert loc.names_directory == (text.endswith("/") and text.strip("/") != "")
    assert loc.path == Path(text).absolute()


@FEW
@given(local_text.filter(lambda t: "://" not in t and not t.startswith("~")))
def test_a_leading_tilde_is_the_home_directory(text: str) -> None:
    assert resolve("~/" + text).path == Path.home() / Path("./" + text)


@FEW
@given(st.text(st.characters(whitelist_categories=("Ll", "Nd"), whitelist_characters="-_./"), max_size=30))
def test_a_memory_url_is_never_a_local_path(key: str) -> None:
    loc = _settled(lambda: resolve(f"memory://{key}"))
    if not isinstance(loc, CheckpointError):
        assert str(loc.path).startswith("memory://") and not isinstance(loc.path, Path)


@pytest.mark.parametrize("text", [
    "a\0b",
    "~no-such-user-41/x",
    "foo://bar",
    "",
])
def test_a_path_that_names_nothing_is_a_checkpoint_error(text: str) -> None:
    with pytest.raises(CheckpointError):
        resolve(text)
