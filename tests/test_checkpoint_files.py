"""keep= rotation (distfn.checkpoint.layout.rotate) and latest() (distfn.checkpoint.api)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from distfn import checkpoint
from distfn.errors import CheckpointError


def test_keep_rotation_and_latest(tmp_path: pathlib.Path) -> None:
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / "other-5.safetensors").write_bytes(b"")  # another prefix: never touched
    for step in (1, 2, 10, 3):
        checkpoint.save({"step": step, "w": torch.full((4,), float(step))}, tmp_path / f"ckpt-{step}.safetensors",
                        keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    # step 3 was written last and is always kept; with it, the newest other one (10).
    assert names == ["ckpt-10.safetensors", "ckpt-3.safetensors", "other-5.safetensors"]
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-10.safetensors"
    # A torn newest file (copied by some other tool) is skipped.
    torn = tmp_path / "ckpt-11.safetensors"
    torn.write_bytes((tmp_path / "ckpt-10.safetensors").read_bytes()[:-3])
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-10.safetensors"
    assert checkpoint.latest(tmp_path, prefix="nothing-") is None
    with pytest.raises(CheckpointError, match="keep= must be a positive int"):
        checkpoint.save({}, tmp_path / "ckpt-1.safetensors", keep=0)


def test_latest_says_what_it_skipped(tmp_path: pathlib.Path) -> None:
    """Other names used to be ignored silently, and the job trained from scratch (issue 18 item 5)."""
    from loguru import logger

    for name in ("snapshot.safetensors", "snapshot-3.safetensors"):
        checkpoint.save({"w": torch.ones(1)}, tmp_path / name)
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="DEBUG", format="{level} {message}")
    logger.enable("distfn")  # a library is quiet outside a job unless asked
    try:
        assert checkpoint.latest(tmp_path) is None
        assert checkpoint.latest(tmp_path, prefix="snapshot-") == tmp_path / "snapshot-3.safetensors"
    finally:
        logger.disable("distfn")
        logger.remove(sink)
    warning = next(m for m in messages if m.startswith("WARNING"))
    assert "snapshot-3.safetensors" in warning and "snapshot.safetensors" in warning and "prefix=" in warning
