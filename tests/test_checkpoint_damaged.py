"""Damaged or hostile sharded checkpoints (issue 25 items 1-5): checked as strictly as single files.

A two-shard directory is made by hand from a one-process save, exactly as two fsdp ranks lay it out (each shard
holds half the rows of ``w`` at its offsets in the sharding metadata), then damaged one way per test. Every damage
must be a `CheckpointError` naming the file, from `distfn.load`, ``sharded.load_into`` and `consolidate` alike,
with nothing written; `distfn.latest` skips the damaged directory with one warning.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import distfn
from distfn import CheckpointError
from distfn.checkpoint import consolidate, sharded
from distfn.checkpoint.layout import INDEX

from conftest import run_python

W = torch.arange(16, dtype=torch.float32).reshape(4, 4)
B = torch.tensor([1.0, 2.0, 3.0, 4.0])


def _two_shards(d: Path) -> Path:
    """``d`` as a 2-rank fsdp save of ``{"model": {"w", "b"}, "step": 3}`` would leave it: ``w`` split by rows."""
    sharded.save({"model": {"w": W, "b": B}, "step": 3}, d)
    (one,) = d.glob("shard-*.safetensors")
    one.unlink()
    for rank, rows in enumerate((slice(0, 2), slice(2, 4))):
        tensors = {"model.w": W[rows].clone()}
        info = {"model.w": {"saved_offsets": [rows.start, 0]}}
        if rank == 0:
            tensors["model.b"] = B.clone()
            info["model.b"] = {"saved_offsets": [0]}
        meta = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"}
        save_file(tensors, str(d / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"), metadata=meta)
    index = json.loads((d / INDEX).read_text())
    # as distfn's writer does: a split tensor is listed under the shard with its first piece only
    index["weight_map"] = {"model.b": "shard-00001-model-00001-of-00001.safetensors",
                           "model.w": "shard-00001-model-00001-of-00001.safetensors"}
    (d / INDEX).write_text(json.dumps(index))
    return d


def _edit_index(d: Path, edit) -> None:
    index = json.loads((d / INDEX).read_text())
    edit(index)
    (d / INDEX).write_text(json.dumps(index))


def _every_reader_refuses(d: Path, match: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=match):
        distfn.load(d)
    with pytest.raises(CheckpointError, match=match):
        sharded.load_into(d, {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}})
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=match):
        consolidate(d, out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_the_hand_made_two_shard_directory_is_a_good_checkpoint(tmp_path: Path) -> None:
    d = _two_shards(tmp_path / "ckpt-3")
    got = distfn.load(d)
    assert torch.equal(got["model.w"], W) and torch.equal(got["model.b"], B)
    assert distfn.latest(tmp_path) == d
    assert torch.equal(load_file(consolidate(d, tmp_path / "one.safetensors"))["model.w"], W)


def test_a_missing_shard_is_an_error_and_latest_skips_the_directory(tmp_path: Path, warnings_seen) -> None:
    older = _two_shards(tmp_path / "ckpt-2")
    d = _two_shards(tmp_path / "ckpt-3")
    (d / "shard-00002-model-00001-of-00001.safetensors").unlink()  # rows 2-3 of w; the index does not name it
    _every_reader_refuses(d, r"ckpt-3.*(incomplete|missing)", tmp_path)
    assert distfn.latest(tmp_path) == older
    assert sum("ckpt-3" in w for w in warnings_seen) == 1


def test_pieces_that_overlap_instead_of_covering_the_tensor_are_an_error(tmp_path: Path) -> None:
    d = _two_shards(tmp_path / "ckpt-3")
    shard = d / "shard-00002-model-00001-of-00001.safetensors"
    meta = {"format": "pt", "DCP_SHARDING_INFO": json.dumps({"model.w": {"saved_offsets": [1, 0]}}),
            "DCP_VERSION": "1.0"}
    save_file({"model.w": W[2:].clone()}, str(shard), metadata=meta)  # rows 1-2 instead of 2-3: row 3 from nowhere
    _every_reader_refuses(d, r"'model.w'.*overlapping", tmp_path)


def test_the_index_shapes_are_never_trusted_over_the_shards(tmp_path: Path) -> None:
    d = _two_shards(tmp_path / "ckpt-3")

    def bigger(index):
        shapes = json.loads(index["metadata"]["distfn.tensors"])
        shapes["model.w"]["shape"] = [8, 4]
        index["metadata"]["distfn.tensors"] = json.dumps(shapes)

    _edit_index(d, bigger)
    _every_reader_refuses(d, r"'model.w'", tmp_path)


@pytest.mark.parametrize("name", ["../outside/victim.safetensors", "/etc/passwd", "sub/x.safetensors", "..", 7])
def test_the_weight_map_names_only_plain_files_inside_the_directory(tmp_path: Path, name) -> None:
    victim = tmp_path / "outside" / "victim.safetensors"
    victim.parent.mkdir()
    save_file({"model.w": torch.full((2, 4), 9.0)}, str(victim))
    d = _two_shards(tmp_path / "run" / "ckpt-3")
    _edit_index(d, lambda i: i["weight_map"].update({"model.w": name}))
    _every_reader_refuses(d, r"weight map|plain", tmp_path)


def test_a_shard_symlinked_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim.safetensors"
    d = _two_shards(tmp_path / "run" / "ckpt-3")
    shard = d / "shard-00001-model-00001-of-00001.safetensors"
    shard.rename(victim)
    shard.symlink_to(victim)
    _every_reader_refuses(d, r"not a regular file inside the directory", tmp_path)


def test_a_truncated_shard_names_the_file_and_latest_skips_it(tmp_path: Path, warnings_seen) -> None:
    d = _two_shards(tmp_path / "ckpt-3")
    shard = d / "shard-00002-model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    _every_reader_refuses(d, r"shard-00002.*(incomplete|truncated)", tmp_path)
    assert distfn.latest(tmp_path) is None
    assert sum("ckpt-3" in w for w in warnings_seen) == 1


@pytest.mark.parametrize("tree", [
    '{"model": {"w": {"__tensor__": "model.w"}}, "dt": {"__dtype__": "os.system"}}',
    '{"model": {"w": {"__tensor__": "model.w"}}, "dev": {"__device__": 42}}',
    '{"model": {"w": {"__tensor__": "nowhere"}}}',
    "{not json",
])
def test_a_bad_tree_in_the_index_is_a_checkpoint_error(tmp_path: Path, tree: str) -> None:
    d = _two_shards(tmp_path / "ckpt-3")
    _edit_index(d, lambda i: i["metadata"].update({"distfn.tree": tree}))
    _every_reader_refuses(d, r"ckpt-3", tmp_path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_index_that_is_dev_zero_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    d = _two_shards(tmp_path / "ckpt-3")
    (d / INDEX).unlink()
    (d / INDEX).symlink_to("/dev/zero")
    assert distfn.latest(tmp_path) is None  # a warning, not a MemoryError
    _every_reader_refuses(d, r"index", tmp_path)


@pytest.mark.parametrize("damage", ["number in the weight map", "negative dimension", "dtype F99"])
def test_consolidate_on_hostile_input_prints_one_line_and_writes_nothing(tmp_path: Path, damage: str) -> None:
    d = _two_shards(tmp_path / "ckpt-3")

    def edit(index):
        shapes = json.loads(index["metadata"]["distfn.tensors"])
        if damage == "number in the weight map":
            index["weight_map"]["model.w"] = 12
        elif damage == "negative dimension":
            shapes["model.w"]["shape"] = [-4, 4]
        else:
            shapes["model.w"]["dtype"] = "F99"
        index["metadata"]["distfn.tensors"] = json.dumps(shapes)

    _edit_index(d, edit)
    out = tmp_path / "out.safetensors"
    done = run_python(["-m", "distfn", "consolidate", str(d), str(out)])
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distfn consolidate: "), done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-3"]


_DEEP = "[" * 100_000 + "]" * 100_000  # json.loads recurses once per level: a RecursionError before issue 41


@pytest.mark.parametrize("where", ["index", "tensors", "tree", "shard sharding info"])
def test_metadata_nested_100000_deep_is_a_checkpoint_error_and_latest_skips_it(tmp_path: Path, where: str,
                                                                              warnings_seen) -> None:
    """Issue 41 item 19: a bare RecursionError from distfn.load, load_into, consolidate and latest (so one such
    directory broke every resume from its parent)."""
    older = _two_shards(tmp_path / "ckpt-2")
    d = _two_shards(tmp_path / "ckpt-3")
    if where == "index":
        (d / INDEX).write_text('{"metadata": {}, "weight_map": {}, "x": ' + _DEEP + "}")
    elif where == "tensors":
        _edit_index(d, lambda i: i["metadata"].update({"distfn.tensors": _DEEP}))
    elif where == "tree":
        _edit_index(d, lambda i: i["metadata"].update({"distfn.tree": _DEEP}))
    else:
        shard = d / "shard-00002-model-00001-of-00001.safetensors"
        meta = {"format": "pt", "DCP_SHARDING_INFO": _DEEP, "DCP_VERSION": "1.0"}
        save_file({"model.w": W[2:].clone()}, str(shard), metadata=meta)
    _every_reader_refuses(d, r"ckpt-3.*(nested 100000 levels deep|over the limit of 128)", tmp_path)
    assert distfn.latest(tmp_path) == older
    assert sum("ckpt-3" in w and "nested" in w for w in warnings_seen) == 1


def test_consolidate_into_the_checkpoints_own_directory_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Issue 41 item 19: ``distfn consolidate ckpt ckpt/one.safetensors`` exited 0 and left the source unloadable
    (every .safetensors file in the directory is read as a shard). Refused, from the function and the CLI, for the
    directory itself, a shard's name, a new name in it, and the same place spelt with '..' or through a symlink."""
    d = _two_shards(tmp_path / "run" / "ckpt-3")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    (tmp_path / "alias").symlink_to(d)
    targets = [d / "one.safetensors", d, d / "shard-00002-model-00001-of-00001.safetensors",
               tmp_path / "run" / ".." / "run" / "ckpt-3" / "x.safetensors", tmp_path / "alias" / "y.safetensors"]
    for out in targets:
        with pytest.raises(CheckpointError, match=r"inside the checkpoint directory.*Nothing was written"):
            consolidate(d, out)
    done = run_python(["-m", "distfn", "consolidate", str(d), str(d / "one.safetensors")])
    assert done.returncode == 1 and "inside the checkpoint directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    got = distfn.load(d)
    assert torch.equal(got["model.w"], W) and torch.equal(got["model.b"], B)
    # next to it is fine, and through the same file:// store spelling too
    out = consolidate(d, tmp_path / "run" / "ckpt-3.safetensors")
    assert torch.equal(load_file(out)["model.w"], W)
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        consolidate(d, f"file://{d}/z.safetensors")


@pytest.mark.parametrize("damage", ["groups not a list", "a group without params", "params out of range",
                                    "state for no parameter", "state keyed by a word"])
def test_a_hostile_optimizer_state_in_the_tree_changes_nothing(tmp_path: Path, damage: str) -> None:
    """Issue 41: each was a bare TypeError / ValueError / IndexError from sharded.load_into, the IndexError after
    the model had already been restored."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    d = sharded.save({"model": model, "opt": opt, "step": 3}, tmp_path / "ckpt-3")
    index = json.loads((d / INDEX).read_text())
    tree = json.loads(index["metadata"]["distfn.tree"])
    groups, state = tree["opt"]["param_groups"], tree["opt"]["state"]["__dict__"]
    if damage == "groups not a list":
        tree["opt"]["param_groups"] = 5
    elif damage == "a group without params":
        groups[0].pop("params")
    elif damage == "params out of range":
        groups[0]["params"] = [0, 7]
    elif damage == "state for no parameter":
        state.append([9, state[0][1]])
    else:
        state[0][0] = "x"
    index["metadata"]["distfn.tree"] = json.dumps(tree)
    (d / INDEX).write_text(json.dumps(index))
    fresh = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'opt'"):
        sharded.load_into(d, {"model": fresh, "opt": torch.optim.Adam(fresh.parameters()), "step": 0})
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
