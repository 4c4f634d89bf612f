"""distfn.checkpoint.format: what a file holds (dtypes, alignment, values that cannot be stored)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from ckpt_helpers import Net
from safetensors import safe_open
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
