"""distfn.checkpoint.format: what a file holds (dtypes, alignment, values that cannot be stored)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from ckpt_helpers import Net
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from distfn import checkpoint
from distfn.checkpoint.format import DTYPES, FROM_CODE
from distfn.errors import CheckpointError


def test_all_safetensors_dtypes_match_the_stock_library(tmp_path: pathlib.Path) -> None:
    state = {}
    for dtype in DTYPES:
        raw = torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)
        if dtype.is_floating_point or dtype.is_complex:
            t = raw.to(torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = raw > 2
        elif str(dtype).startswith("torch.uint"):
            t = raw.abs().to(dtype)
        else:
            t = raw.to(dtype)
        state[str(dtype).removeprefix("torch.")] = t
    path = checkpoint.save(state, tmp_path / "dtypes.safetensors")
    stock = load_file(path)
    mine = checkpoint.load(path)
    for k, v in state.items():
        assert stock[k].dtype == v.dtype and mine[k].dtype == v.dtype, k
        assert torch.equal(stock[k].view(torch.uint8), v.view(torch.uint8)), k
        assert torch.equal(mine[k].view(torch.uint8), v.view(torch.uint8)), k
    # The stock writer's file loads the same through distfn.
    stock_path = tmp_path / "stock.safetensors"
    save_file(state, str(stock_path))
    theirs = checkpoint.load(stock_path)
    for k, v in state.items():
        assert torch.equal(theirs[k].view(torch.uint8), v.view(torch.uint8)), k


def test_file_is_aligned_and_opens_with_safe_open(tmp_path: pathlib.Path) -> None:
    model = Net()
    path = checkpoint.save({"model": model, "step": 7}, tmp_path / "s.safetensors", metadata={"run": "abc", "lr": 0.1})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    for name, info in header.items():
        if name != "__metadata__":
            size = torch.empty(0, dtype=FROM_CODE[info["dtype"]]).element_size()
            assert info["data_offsets"][0] % size == 0, name
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["run"] == "abc"
        assert json.loads(meta["distfn.metadata"]) == {"run": "abc", "lr": 0.1}
        assert torch.equal(f.get_tensor("model.fc.weight"), model.fc.weight)
    assert checkpoint.read_metadata(path) == {"run": "abc", "lr": 0.1}


def test_unsupported_values_name_their_key_path_and_write_nothing(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"at 'extra.fn'.*function"):
        checkpoint.save({"model": Net(), "extra": {"fn": lambda x: x}}, target)
    with open(__file__) as handle, pytest.raises(CheckpointError, match=r"at 'log.1'.*TextIOWrapper"):
        checkpoint.save({"log": [1, handle]}, target)
    with pytest.raises(CheckpointError, match=r"same tensor name 'a.b'"):
        checkpoint.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, target)
    with pytest.raises(CheckpointError, match="meta tensor at 'm'"):
        checkpoint.save({"m": torch.empty(2, device="meta")}, target)
    with pytest.raises(CheckpointError, match="sparse_coo"):
        checkpoint.save({"s": torch.eye(2).to_sparse()}, target)
    with pytest.raises(CheckpointError, match="keep="):
        checkpoint.save(Net(), target, keep=2)  # not a step-numbered name
    assert list(tmp_path.iterdir()) == []


def _write_raw(path: pathlib.Path, header: dict, data: bytes) -> pathlib.Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def _f32(shape: list, begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


_TREE = {"__metadata__": {"distfn.format": "1"}}


@pytest.mark.parametrize(
    ("case", "header", "data", "message"),
    [
        ("overlap", {"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12), "overlaps"),
        ("hole", {"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, bytes(12), "hole of 4 bytes"),
        ("hole at start", {"a": _f32([1], 4, 8)}, bytes(8), "hole of 4 bytes"),
        ("negative shape", {"a": _f32([-1], 0, 4)}, bytes(4), "not a list of non-negative ints"),
        ("float shape", {"a": _f32([2.5], 0, 4)}, bytes(4), "not a list of non-negative ints"),
        ("shape not a list", {"a": _f32(3, 0, 12)}, bytes(12), "not a list of non-negative ints"),
        ("size mismatch", {"a": _f32([3], 0, 8)}, bytes(8), "needs 12"),
        ("bad offsets", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4), "data_offsets"),
        ("entry not a map", {"a": [1, 2]}, bytes(4), "needs dtype, shape and data_offsets"),
        ("metadata not a map", {"__metadata__": [1, 2], "a": _f32([1], 0, 4)}, bytes(4), "__metadata__ must map"),
        ("metadata values", {"__metadata__": {"k": 3}, "a": _f32([1], 0, 4)}, bytes(4), "__metadata__ must map"),
        ("unknown device", {"__metadata__": {"distfn.tree": '{"d": {"__device__": "warp:9"}}'}}, b"",
         "'warp:9' is not a device"),
        ("dtype tag naming a function", {"__metadata__": {"distfn.tree": '{"x": {"__dtype__": "load"}}'}}, b"",
         "'load' is not a dtype"),
        ("float tag", {"__metadata__": {"distfn.tree": '{"x": {"__float__": "1e400"}}'}}, b"", "not nan/inf/-inf"),
        ("dangling tensor", {"__metadata__": {"distfn.tree": '{"x": {"__tensor__": "nope"}}'}}, b"",
         "names no stored tensor"),
        ("tuple tag", {"__metadata__": {"distfn.tree": '{"x": {"__tuple__": 3}}'}}, b"", "not a list"),
        ("aliases", {"__metadata__": {"distfn.tree": "{}", "distfn.aliases": "[1]"}}, b"", "distfn.aliases"),
        ("metadata tree", {"__metadata__": {"distfn.tree": "{}", "distfn.metadata": '{"a": {"__dtype__": "load"}}'}},
         b"", "'load' is not a dtype"),
    ],
)
def test_malformed_headers_are_checkpoint_errors_naming_the_file(
    tmp_path: pathlib.Path, case: str, header: dict, data: bytes, message: str
) -> None:
    """Issue 16 item 6: each of these was accepted, or escaped as a bare RuntimeError/ValueError/TypeError, or
    (``__dtype__: load``) decoded to the torch.load function."""
    path = _write_raw(tmp_path / "ckpt-5.safetensors", header, data)
    with pytest.raises(CheckpointError, match=r"ckpt-5\.safetensors") as info:
        checkpoint.load_into(path, {})
    assert message in str(info.value)
    good = checkpoint.save({"w": torch.ones(1)}, tmp_path / "ckpt-1.safetensors")
    assert checkpoint.latest(tmp_path) == good  # the malformed newer file is skipped as incomplete


@pytest.mark.parametrize(("header", "data"), [({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)),
                                              ({"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, bytes(12))])
def test_offsets_rejected_exactly_like_the_safetensors_library(tmp_path: pathlib.Path, header: dict,
                                                               data: bytes) -> None:
    path = _write_raw(tmp_path / "x.safetensors", header, data)
    with pytest.raises(SafetensorError):
        load_file(path)
    with pytest.raises(CheckpointError):
        checkpoint.load(path)


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "not a list of non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [1], "data_offsets": {"0": 4}}, "not two non-negative ints"),
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, "unknown to this torch"),
    ({"dtype": None, "shape": [1], "data_offsets": [0, 4]}, "unknown to this torch"),
    ({"shape": [1], "data_offsets": [0, 4]}, "needs dtype, shape and data_offsets"),
    ({"dtype": "F32", "shape": [1], "data_offsets": None}, "not two non-negative ints"),
    ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]}, "not a list of non-negative ints"),
])
def test_every_entry_check_holds_on_the_fast_path(tmp_path: pathlib.Path, entry: dict, message: str) -> None:
    """The header check tests well-formed entries with exact type tests in one pass (a 64 MiB load is ~10 %
    header work): each value a looser test would let through (JSON ``true`` for 1, ``0.0`` for 0, an unhashable
    dtype, a negative start whose span still has the right length) is refused with the same message as before."""
    path = _write_raw(tmp_path / "x.safetensors", {"a": entry}, bytes(8))
    with pytest.raises(CheckpointError, match=r"x\.safetensors") as info:
        checkpoint.load(path)
    assert message in str(info.value)


def test_extra_keys_in_an_entry_are_allowed_like_the_stock_library(tmp_path: pathlib.Path) -> None:
    path = _write_raw(tmp_path / "x.safetensors", {"a": {**_f32([2], 0, 8), "note": 1}}, bytes(8))
    assert torch.equal(load_file(path)["a"], torch.zeros(2))
    loaded = checkpoint.load(path)["a"]
    assert torch.equal(loaded, torch.zeros(2)) and loaded.shape == (2,)


def test_loaded_tensors_own_exactly_their_bytes_of_the_map(tmp_path: pathlib.Path) -> None:
    """1-d tensors come straight from frombuffer (no view on top), n-d ones are a view of it: either way a tensor's
    storage holds its own bytes only, so torch.save of one loaded tensor writes that tensor, not the file."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3.0), "s": torch.tensor(5.0),
             "e": torch.empty(0, 4)}
    loaded = checkpoint.load(checkpoint.save(state, tmp_path / "x.safetensors"))
    for name, value in state.items():
        t = loaded[name]
        assert t.shape == value.shape and torch.equal(t, value), name
        assert t.untyped_storage().nbytes() == value.numel() * 4, name


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(("case", "raw", "message"), [
    ("header 100,000 deep", b'{"x": ' + _DEEP.encode() + b"}", "nested 100001 levels deep"),
    ("tree 100,000 deep", json.dumps({"__metadata__": {"distfn.tree": _DEEP}}).encode(), "nested 100000 levels deep"),
    ("metadata 100,000 deep", json.dumps({"__metadata__": {"distfn.tree": "{}", "distfn.metadata": _DEEP}}).encode(),
     "nested 100000 levels deep"),
    ("129 deep", b'{"x": ' + ("[" * 128 + "]" * 128).encode() + b"}", "over the limit of 128"),
    ("UTF-16", '{"a": 1}'.encode("utf-16-le"), "corrupt safetensors header"),
    ("not UTF-8", b'{"\xff": 1}', "can't decode byte 0xff"),
    ("duplicate tensor", b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": 1}', "appears twice"),
    ("NaN", b'{"__metadata__": {}, "a": NaN}', "NaN is not JSON"),
    ("lone surrogate", b'{"\\ud800": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}', "lone surrogate"),
    ("zero elements, huge dims", b'{"a": {"dtype": "F32", "shape": [0, 1267650600228229401496703205376], '
     b'"data_offsets": [0, 0]}}', "too large for a tensor"),
    ("65 dimensions", json.dumps({"a": _f32([1] * 65, 0, 4)}).encode(), "over the limit of 64"),
    ("a __dict__ key that is a list", json.dumps({"__metadata__": {"distfn.tree": '{"d": {"__dict__": [[[1], 2]]}}'}}
                                                 ).encode(), "cannot be a mapping key"),
])
def test_hostile_headers_are_checkpoint_errors_and_latest_skips_them(tmp_path: pathlib.Path, case: str, raw: bytes,
                                                                     message: str) -> None:
    """Issue 41: each was a bare RecursionError (depth: from load, load_into and latest, so one such file broke every
    resume from its directory), TypeError/RuntimeError at the first use, or accepted where the safetensors library
    refuses it (UTF-16, duplicate keys: two readers seeing two files; NaN; lone surrogates)."""
    raw += b" " * (-(8 + len(raw)) % 8)
    data = bytes(4) if case == "65 dimensions" else b""
    path = tmp_path / "ckpt-5.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    readers = [lambda p: checkpoint.load_into(p, {})]  # reads all of it; the others what they need
    if "metadata" in case:
        readers.append(checkpoint.read_metadata)
    elif "tree" not in case and "key" not in case:
        readers += [checkpoint.load, checkpoint.read_metadata]
    for read in readers:
        with pytest.raises(CheckpointError, match=r"ckpt-5\.safetensors") as info:
            read(path)
        assert message in str(info.value), (case, str(info.value)[:300])
    good = checkpoint.save({"w": torch.ones(1)}, tmp_path / "ckpt-1.safetensors")
    assert checkpoint.latest(tmp_path) == good


def test_a_value_nested_deeper_than_a_file_may_hold_is_refused_at_the_save(tmp_path: pathlib.Path) -> None:
    """Issue 41: the encoder recursed without bound (a RecursionError at 1,000 levels, a cycle likewise) and wrote
    files up to that depth which no reader (distfn's now, or safetensors') could open."""
    deep: object = 1
    for _ in range(127):
        deep = [deep]
    path = checkpoint.save({"v": deep}, tmp_path / "ok.safetensors")  # 128 levels with the top-level mapping
    assert checkpoint.load_into(path, {})["v"] == deep
    for value in ([deep], {"k": deep}, (deep,)):
        with pytest.raises(CheckpointError, match=r"at 'v\.0.*nested deeper than 128|at 'v.*nested deeper than 128"):
            checkpoint.save({"v": value}, tmp_path / "x.safetensors")
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(CheckpointError, match="contain itself"):
        checkpoint.save({"v": cycle}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_deep_header_in_a_pickle_suffixed_file_is_a_checkpoint_error(tmp_path: pathlib.Path) -> None:
    raw = b'{"x": ' + _DEEP.encode() + b"}"
    raw += b" " * (-(8 + len(raw)) % 8)
    path = tmp_path / "model.pt"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(CheckpointError, match=r"model\.pt"):
        checkpoint.load(path)
