"""distfn.boundary (issue 43): every rank's generators at its last ctx.step, brought to a saving rank 0 over the
store with no collective; per-rank values; the one line for what cannot be captured; the payload decoder under
hostile input; ctx.resume's start= switch and line; per-rank seeds on another world size."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from loguru import logger

from distfn import CheckpointError, ConfigError, checkpoint
from distfn import boundary as bd
from distfn.checkpointing import load_state, resume_state, save_state
from distfn.options import Options
from distfn.rankstore import Channel
from distfn.rng import rng_state
from distfn.run import Run

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CPU = torch.device("cpu")


def _pair(wait_s: float = 5.0) -> tuple[bd.Boundaries, bd.Boundaries]:
    """Rank 0 and rank 1 of a 2-rank job in this process, on one in-process store."""
    store = dist.HashStore()
    zero, one = bd.Boundaries(0, 2, enabled=True), bd.Boundaries(1, 2, enabled=True)
    for b in (zero, one):
        b.connect(Channel.open(store, b.rank, 2).child("boundary"), wait_s=wait_s)
    return zero, one


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_tensors_travel_as_json_bytes_not_pickle(dtype: torch.dtype) -> None:
    for t in (torch.arange(12).reshape(3, 4).to(dtype), torch.empty(0, 2, dtype=dtype), torch.tensor(1).to(dtype)):
        again = bd.decode_tensor(json.loads(json.dumps(bd.encode_tensor(t))))
        assert again.dtype == t.dtype and again.shape == t.shape and torch.equal(again, t)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["dtype", "shape", "data", "x"]),
                       st.one_of(st.text(max_size=12), st.integers(), st.lists(st.integers(-3, 9), max_size=4),
                                 st.none(), st.binary(max_size=16).map(lambda b: __import__("base64").b64encode(b)
                                                                       .decode()))))
def test_a_hostile_tensor_payload_is_a_checkpoint_error_or_a_tensor(d: dict[str, Any]) -> None:
    try:
        out = bd.decode_tensor(d)
    except CheckpointError:
        return
    assert isinstance(out, torch.Tensor)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(
        st.sampled_from(["n", "python", "numpy", "torch", "cuda", "values", "missing", "dtype", "shape", "data"]),
        inner, max_size=5)), max_leaves=12).map(lambda v: json.dumps(v).encode())))
def test_a_hostile_answer_on_the_store_is_a_checkpoint_error_or_an_answer(raw: bytes) -> None:
    try:
        n, state, _values, why = bd.decode_answer(raw)
    except CheckpointError:
        return
    assert isinstance(n, int) and (why is not None or state is not None)


def test_rank0_alone_gets_every_ranks_streams_of_the_same_boundary() -> None:
    zero, one = _pair()
    try:
        torch.manual_seed(0)
        zero.mark()
        torch.manual_seed(1)  # rank 1's own stream
        one.mark(per_rank={"X": torch.tensor([1, 2])})
        expected_one = _draw()
        torch.manual_seed(1)
        random.seed(5)
        one.mark(per_rank={"X": torch.tensor([3])})  # rank 1 is one boundary ahead: boundary 1 is still kept
        found = zero.collect()
        assert found is not None
        streams, per_rank = found
        assert streams["world_size"] == 2 and per_rank is not None
        assert torch.equal(per_rank["ranks"][1]["X"], torch.tensor([1, 2])) and per_rank["ranks"][0] == {}
        checkpoint.set_rng_state(streams["ranks"][1])
        got = _draw()
        assert got[:2] == expected_one[:2] and torch.equal(got[2], expected_one[2])
    finally:
        one.close()


def test_a_rank_behind_is_waited_for_and_one_that_finished_left_its_last_snapshot() -> None:
    zero, one = _pair()
    try:
        zero.mark()
        zero.mark()
        one.mark()
        threading.Timer(0.3, one.mark).start()  # rank 1 reaches boundary 2 while rank 0 waits
        assert zero.collect() is not None
        one.close()  # rank 1 returned from its function: its thread is gone, its last snapshot stays
        zero.count = 2
        found = zero.collect()
        assert found is not None and found[0]["world_size"] == 2
    finally:
        one.close()


def test_what_cannot_be_captured_is_one_line_once(warnings_seen: list[str]) -> None:
    zero, one = _pair(wait_s=0.5)
    try:
        assert zero.collect() is None and zero.collect() is None  # before any ctx.step
        zero.mark()
        for _ in range(bd.RING + 2):
            one.mark()
        assert zero.collect() is None  # rank 1 ran further ahead than it keeps
        one._stop.set()  # rank 1 stops answering (and left no last snapshot)
        one._thread.join(2)  # type: ignore[union-attr]
        zero.mark()
        assert zero.collect() is None
        one.count = zero.count = 99
        assert zero.collect() is None  # not asked again (no second wait), nothing said again
    finally:
        one.close()
    assert len(warnings_seen) == 3, warnings_seen
    assert "no ctx.step or ctx.resume has run yet" in warnings_seen[0]
    assert "rank 1 (it was 17 ctx.step calls ahead of rank 0, more than the 16 it keeps)" in warnings_seen[1]
    assert "rank(s) [1] did not send" in warnings_seen[2]


def test_per_rank_values_must_be_named_tensors() -> None:
    with pytest.raises(ConfigError, match=r"per_rank=\{'X': X"):
        bd.Boundaries().mark(per_rank={"X": [1, 2]})  # type: ignore[dict-item]


def test_off_switch_and_explicit_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTFN_RNG_CAPTURE", "0")
    run = Run()
    assert not run.boundaries.enabled
    run.boundaries.mark()
    path = save_state({"step": 1}, tmp_path / "ckpt-1.safetensors", mode="single", rank=0, run=run)
    assert "rng" not in checkpoint.load_into(path, {})
    torch.manual_seed(3)
    snap = rng_state()
    save_state({"step": 2}, tmp_path / "ckpt-2.safetensors", mode="single", rank=0, run=run, rng=snap)
    torch.manual_seed(4)
    load_state(tmp_path / "ckpt-2.safetensors", {}, mode="single", rank=0, world_size=1, device=CPU, run=run,
               rng=True)
    a = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    with pytest.raises(ConfigError, match="rng takes None"):
        save_state({"step": 3}, tmp_path / "ckpt-3.safetensors", mode="single", rank=0, run=run, rng="yes")  # type: ignore[arg-type]


def test_one_process_save_and_resume_continue_the_stream_and_the_per_rank_values(tmp_path: Path) -> None:
    run = Run()
    torch.manual_seed(0)
    run.boundaries.mark(per_rank={"X": torch.tensor([7, 8])})  # ctx.step's boundary ...
    expected = torch.rand(4)  # ... what the loop draws after it
    torch.rand(9)  # draws between the boundary and the save (a rank-0 evaluation) are drawn again after a resume
    save_state({"step": 5, "per_rank": None}, tmp_path / "ckpt-5.safetensors", mode="single", rank=0, run=run)
    fresh = Run()
    state: dict[str, Any] = {"step": 0, "per_rank": None}
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}", filter=lambda r: "ctx.resume" in r["message"])
    logger.enable("distfn")
    try:
        assert resume_state(state, tmp_path, mode="single", rank=0, world_size=1, device=CPU, run=fresh) == 5
    finally:
        logger.disable("distfn")
        logger.remove(sink)
    assert torch.equal(torch.rand(4), expected)
    assert state["step"] == 5 and torch.equal(state["per_rank"]["X"], torch.tensor([7, 8]))
    assert lines == [f"ctx.resume: restored {tmp_path / 'ckpt-5.safetensors'} (step 5); every rank's random streams "
                     "restored\n"]
    # resume is a boundary: a save before the next ctx.step writes the restored streams and values again
    assert fresh.boundaries.count == 1
    again = save_state(dict(state), tmp_path / "ckpt-6.safetensors", mode="single", rank=0, run=fresh)
    entry = checkpoint.load_into(again, {})
    assert torch.equal(entry["per_rank"]["ranks"][0]["X"], torch.tensor([7, 8]))


def test_resume_start_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty, full = tmp_path / "empty", tmp_path / "full"
    run = Run()
    run.boundaries.mark()
    save_state({"step": 3}, full / "ckpt-3.safetensors", mode="single", rank=0, run=run)

    def resume(d: Path, **kw: Any) -> int:
        return resume_state({"step": 0}, d, mode="single", rank=0, world_size=1, device=CPU, run=Run(), **kw)

    assert resume(empty) == 0 and resume(full) == 3
    with pytest.raises(CheckpointError, match=r"start='resume'\): no complete checkpoint named ckpt-<step>"):
        resume(empty, start="resume")
    assert resume(full, start="resume") == 3
    assert resume(empty, start="fresh") == 0
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(the newest is ckpt-3.safetensors, step 3"):
        resume(full, start="fresh")
    assert resume(full, start="fresh", restart=1) == 3  # a restarted attempt continues its own checkpoints
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # and so does a requeued Slurm job
    assert resume(full, start="fresh") == 3
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    with pytest.raises(ConfigError, match="start takes 'auto'"):
        resume(full, start="again")


def test_rank_seeds_option_and_streams_on_another_world_size(tmp_path: Path, warnings_seen: list[str]) -> None:
    with pytest.raises(ConfigError, match="no seed= was given"):
        Options(rank_seeds=True)
    with pytest.raises(ConfigError, match="rank_seeds must be True or False"):
        Options(seed=1, rank_seeds=1)  # type: ignore[arg-type]
    assert Options(seed=1337, rank_seeds=True).rank_seeds
    states = []
    for r in range(2):
        torch.manual_seed(1337 + r)
        torch.rand(5)
        states.append(rng_state())
    path = checkpoint.save({"rng": checkpoint.combine_rng_states(states)}, tmp_path / "r.safetensors")

    def stream_of(rank: int, world: int) -> torch.Tensor:
        run = Run(rank_seed=1337 + rank)
        load_state(path, {}, mode="single", rank=rank, world_size=world, device=CPU, run=run, rng=True)
        return torch.rand(3)

    on_three = [stream_of(r, 3) for r in range(3)]
    for r in range(2):  # the saved ranks continue their own streams
        checkpoint.set_rng_state(states[r])
        assert torch.equal(on_three[r], torch.rand(3))
    torch.manual_seed(1339)  # the new rank 2 starts its own, seed + 2, not a copy of rank 0's
    assert torch.equal(on_three[2], torch.rand(3))
    assert stream_of(0, 1) is not None
    assert any("ranks 2..2 start their own streams" in w for w in warnings_seen)
    assert any("the streams of ranks 1..1 end here" in w for w in warnings_seen)
