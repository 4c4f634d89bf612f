"""distfn.rng: generator states captured, saved and restored exactly (one process, and per rank)."""

from __future__ import annotations

import pathlib
import random

import numpy as np
import pytest
import torch

from distfn import checkpoint
from distfn.errors import CheckpointError


def test_rng_state_round_trip_through_a_file(tmp_path: pathlib.Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    path = checkpoint.save({"rng": checkpoint.rng_state()}, tmp_path / "r.safetensors")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    checkpoint.set_rng_state(checkpoint.load_into(path, {})["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    # and via the stateful RNG stand-in
    torch.manual_seed(7)
    checkpoint.save({"rng": checkpoint.RNG}, tmp_path / "r2.safetensors")
    a = torch.rand(2)
    checkpoint.load_into(tmp_path / "r2.safetensors", {"rng": checkpoint.RNG})
    assert torch.equal(torch.rand(2), a)


def test_per_rank_rng_states(tmp_path: pathlib.Path) -> None:
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        states.append(checkpoint.rng_state())
    path = checkpoint.save({"rng": checkpoint.combine_rng_states(states), "step": 1}, tmp_path / "r.safetensors")
    entry = checkpoint.load_into(path, {})["rng"]
    assert entry["world_size"] == 2
    with pytest.raises(CheckpointError, match="holds the states of 2 ranks"):
        checkpoint.set_rng_state(entry)
    for rank, seed in ((0, 1), (1, 2)):
        checkpoint.set_rng_state(checkpoint.rng_state_for_rank(entry, rank, 2))
        got = torch.rand(3), random.random()
        torch.manual_seed(seed)
        random.seed(seed)
        assert torch.equal(got[0], torch.rand(3)) and got[1] == random.random()
    assert checkpoint.rng_state_for_rank(entry, 3, 4) is entry["ranks"][1]  # other world size: rank % saved
    single = checkpoint.rng_state()
    assert checkpoint.rng_state_for_rank(single, 1, 2) is single
    with pytest.raises(CheckpointError, match="not an RNG state"):
        checkpoint.set_rng_state({"model": 1})
