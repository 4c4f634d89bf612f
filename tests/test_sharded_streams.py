"""A sharded ``ctx.save`` brings every rank's random streams of its last ``ctx.step`` in its planning all-gather
(issue 45 item 5): one object collective before any shard is written, not a gather of the streams and then the
planning's. Checked on 2 and 4 gloo ranks in ``mode="fsdp"`` (DTensor state): what each rank's save makes (the
object collectives and the shard writes, in order), that the saved streams continue each rank's draws after its
last ``ctx.step`` exactly and the per-rank values are each rank's, and that a save before any ``ctx.step`` writes no
streams, says so once, and makes the same one collective."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from s3server import S3Server, needs_s3, s3, s3_module

from distfn import checkpoint
from distfn.checkpoint import sharded

from conftest import run_python

_FIXTURES = (s3, s3_module)  # pytest finds a fixture by its name in the test's module


def _streams(saved: dict[str, Any]) -> list[Any]:
    """The saved streams and per-rank values as lists (tensors' values), to compare two checkpoints'."""
    return [[{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in saved[e]["ranks"]]
            for e in ("rng", "per_rank")]


def _draw() -> list[object]:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]

_JOB = r'''
import json, random, sys
import numpy as np
import torch
import torch.distributed as dist
from loguru import logger
import distfn
from distfn import distributed
from distfn.checkpoint import storage

OUT = sys.argv[1]
TO = sys.argv[3] if len(sys.argv) > 3 else f"{OUT}/async-3"  # a directory or an s3:// URL


def draw():
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


def job(cfg, ctx):
    said = []
    logger.add(lambda m: said.append(str(m)), level="WARNING", format="{message}")
    events = []
    gather, broadcast, write = dist.all_gather_object, dist.broadcast_object_list, storage.write
    def counted_gather(*a, **k):
        events.append("all_gather_object")
        return gather(*a, **k)
    def counted_broadcast(*a, **k):
        events.append("broadcast_object_list")
        return broadcast(*a, **k)
    def counted_write(*a, **k):
        events.append("write")
        return write(*a, **k)
    dist.all_gather_object, dist.broadcast_object_list, storage.write = counted_gather, counted_broadcast, counted_write

    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx.save({"model": model, "optimizer": opt, "step": 0}, f"{OUT}/ckpt-0")  # no ctx.step yet: no streams
    before = list(events)
    events.clear()
    random.seed(ctx.rank)
    np.random.seed(ctx.rank)
    torch.manual_seed(100 + ctx.rank)  # each rank its own streams
    for step in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        ctx.step(opt, per_rank={"X": torch.tensor([ctx.rank, step])})
    expected = draw()  # what the streams saved at the last ctx.step give next
    draw()  # the streams move on (a prefetch) before the save
    ctx.save({"model": model, "optimizer": opt, "step": 3}, f"{OUT}/ckpt-3")
    after = list(events)
    events.clear()
    ctx.save({"model": model, "optimizer": opt, "step": 3}, TO, blocking=False)  # the same, in the background
    ctx.saves.wait()
    background = list(events)
    dist.all_gather_object, dist.broadcast_object_list, storage.write = gather, broadcast, write
    return ctx.gather_object({"before": before, "after": after, "background": background, "expected": expected,
                              "said": [s for s in said if "random streams" in s]})


if __name__ == "__main__":
    world = int(sys.argv[2])
    results = distributed(mode="fsdp", nprocs=world, seed=0, backend="gloo")(job)(None)
    print("RESULT", json.dumps(results))
'''


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_save_brings_the_streams_in_its_one_planning_gather(tmp_path: Path, world: int) -> None:
    script = tmp_path / "streams_job.py"
    script.write_text(_JOB)
    done = run_python([str(script), str(tmp_path), str(world)], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    ranks = json.loads(line.removeprefix("RESULT "))
    assert len(ranks) == world
    saved = checkpoint.load_into(tmp_path / "ckpt-3", {})
    assert saved["rng"]["world_size"] == world and saved["per_rank"]["world_size"] == world
    for rank, r in enumerate(ranks):
        for events in (r["before"], r["after"], r["background"]):
            # one object all-gather plans the save and brings the streams; then this rank's shard (if it writes
            # any); then the finish: a gather of the outcomes and rank 0's broadcast
            head = events[:events.index("write")] if "write" in events else events[:1]
            assert head == ["all_gather_object"], (rank, events)
            assert events.count("all_gather_object") == 2 and events[-1] == "broadcast_object_list", (rank, events)
        checkpoint.set_rng_state(saved["rng"]["ranks"][rank])  # the saved streams are this rank's at its last
        assert _draw() == r["expected"], rank  # ctx.step: they continue its draws bit for bit
        assert saved["per_rank"]["ranks"][rank]["X"].tolist() == [rank, 2]
        # the save before any ctx.step: one line, from rank 0 alone
        assert len(r["said"]) == (0 if rank else 1) and all("not saved" in s for s in r["said"]), r["said"]
    # every rank writes (each holds a shard of every DTensor): the planning gather came before every write
    assert all("write" in r["after"] for r in ranks)
    assert _streams(checkpoint.load_into(tmp_path / "async-3", {})) == _streams(saved)  # a background save's too
    first = checkpoint.load_into(tmp_path / "ckpt-0", {})
    assert first["step"] == 0 and "rng" not in first and "per_rank" not in first  # no streams: on every rank alike


_RANK0_ONLY = r'''
import sys
from distfn import distributed

@distributed(mode="ddp", nprocs=2, seed=0)
def job(cfg, ctx):
    if ctx.is_main:  # rank 1 returns at once: it will never call ctx.save
        ctx.save({"step": 1}, cfg["path"], sharded=True)
    return "finished"

if __name__ == "__main__":
    print(job({"path": sys.argv[1]}))
'''


@pytest.mark.slow
def test_a_sharded_save_on_rank0_alone_is_an_error_before_its_one_collective(tmp_path: Path) -> None:
    script = tmp_path / "rank0_only.py"
    script.write_text(_RANK0_ONLY)
    proc = run_python([str(script), str(tmp_path / "ckpt-1")], timeout=150)
    assert proc.returncode != 0, proc.stdout
    assert "CheckpointError" in proc.stderr and "rank 1 went on without calling it" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ckpt-1").exists()


def _state() -> dict[str, object]:
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "step": 7}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("resumed", [None, "kept", "replaced"])
def test_entries_a_rider_brings_are_written_as_if_they_were_in_the_state(tmp_path: Path, resumed: str | None) -> None:
    """The rider's entries spliced in after the planning gather give the bytes of one encoding of the whole state
    (the index's tree, names and shapes; the shard), in one process; a state's own ``per_rank`` (what a resume put
    there) is replaced when the rider brings entries and kept when it brings none."""
    entries = {"rng": {"world_size": 1, "ranks": [checkpoint.rng_state()]},
               "per_rank": {"world_size": 1, "ranks": [{"X": torch.arange(3)}]}}
    state = _state()
    if resumed:
        state["per_rank"] = {"X": torch.tensor([9])}
    given = None if resumed == "kept" else entries
    rider = sharded.write.Rider(own="mine", entries=lambda owns: given if owns == ["mine"] else None,
                                replaces=frozenset({"rng", "per_rank"}))
    sharded.save(state, tmp_path / "rider", rider=rider)
    own = {k: v for k, v in state.items() if k != "per_rank"}
    whole = own | (entries if given else {"per_rank": state["per_rank"]} if resumed else {})
    sharded.save(whole, tmp_path / "whole")
    assert _files(tmp_path / "rider") == _files(tmp_path / "whole")


@needs_s3
@pytest.mark.slow
def test_a_background_sharded_save_to_s3_brings_the_streams_in_its_one_planning_gather(s3: S3Server,
                                                                                         tmp_path: Path) -> None:
    script = tmp_path / "streams_job.py"
    script.write_text(_JOB)
    url = s3.url("streams", "ckpt-3")
    done = run_python([str(script), str(tmp_path), "2", url], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    for events in (r["background"] for r in ranks):
        head = events[:events.index("write")] if "write" in events else events[:1]
        assert head == ["all_gather_object"] and events.count("all_gather_object") == 2, events
    assert _streams(checkpoint.load_into(url, {})) == _streams(checkpoint.load_into(tmp_path / "ckpt-3", {}))


class _Hook:
    """A run's collective hook as the save sees it: it records its use, or raises on entry (as the run's does
    when another rank waits in a checkpoint call this rank skipped)."""

    def __init__(self, refuse: bool) -> None:
        self.refuse, self.seen = refuse, []

    def __enter__(self) -> None:
        self.seen.append("enter")
        if self.refuse:
            raise RuntimeError("rank 1 is in another checkpoint call")

    def __exit__(self, *exc: object) -> None:
        self.seen.append("exit")


def test_the_planning_gather_runs_inside_the_hook_and_one_that_raises_leaves_no_partial(tmp_path: Path) -> None:
    ok = _Hook(refuse=False)
    sharded.save(_state(), tmp_path / "ckpt-1", hook=ok)
    assert ok.seen == ["enter", "exit"]
    with pytest.raises(RuntimeError, match="another checkpoint call"):
        sharded.save(_state(), tmp_path / "ckpt-2", hook=_Hook(refuse=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]  # no hidden partial directory left
