"""Exact resume of the data position (issue 27): a ``ctx.dataloader`` is state.

In this process: the global order equals ``DistributedSampler``'s; loaders of 4 "ranks" (one process, one loader
per rank) stopped after every possible step and continued on 4, 2, 3 and 1 ranks draw exactly the uninterrupted
run's remaining global batches; the state is JSON in the file; the errors. Then real jobs (tests/scripts/
exact_resume_job.py): a 2-rank job SIGKILLed three times inside epochs 1 and 2 (once right after the last batch
of epoch 1) ends bit-identical to an uninterrupted run, with DataLoader workers, dropout and Adam; a 4-rank job
killed mid-epoch continues on 2 and on 3 ranks with the same global batches.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distfn
from distfn import CheckpointError, ConfigError, checkpoint
from distfn import data as ddata
from distfn.checkpoint import background, sharded
from distfn.loader_state import ResumableSampler, epoch_order

from conftest import SCRIPTS, clean_env, run_python

SEED = 7


def _loaders(n: int, world: int, batch: int, drop_last: bool = False, shuffle: bool = True,
             **kwargs: Any) -> list[ddata.DistributedLoader]:
    """One ``ctx.dataloader`` per rank of a ``world``-rank job, built in this process."""
    dataset = TensorDataset(torch.arange(n))
    loaders = []
    for rank in range(world):
        def make_sampler(ds: Any, shuffle: bool, drop_last: bool, rank: int = rank) -> DistributedSampler:
            return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=SEED,
                                      drop_last=drop_last)

        loaders.append(ddata.dataloader(dataset, batch, make_sampler, rank=rank, seed=0, device=torch.device("cpu"),
                                        shuffle=shuffle, drop_last=drop_last, **kwargs))
    return loaders


def _steps(loaders: list[ddata.DistributedLoader], upto: int | None = None) -> list[list[int]]:
    """The job's global batches (every rank's sample ids, sorted) of one epoch, or of its first ``upto`` steps."""
    if upto is None:  # every rank runs its iteration to the end, as a real job does
        per_rank = [[x.tolist() for (x,) in loader] for loader in loaders]
    else:
        iterators = [iter(loader) for loader in loaders]
        per_rank = [[next(it)[0].tolist() for _ in range(upto)] for it in iterators]
    return [sorted(i for batch in step for i in batch) for step in zip(*per_rank, strict=True)]


def _first_visits(steps: list[list[int]]) -> list[set[int]]:
    """Per step, the samples not seen before in the epoch (padding duplicates of the tail are seen twice)."""
    seen: set[int] = set()
    out = []
    for step in steps:
        out.append(set(step) - seen)
        seen |= set(step)
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_global_order_is_distributed_samplers(drop_last: bool, shuffle: bool) -> None:
    """Rank r reads positions r, r+W, ... of epoch_order: the order users get today, unchanged."""
    for n in (1, 12, 13, 31):
        for world in (1, 2, 3, 4, 5):
            for epoch in (0, 3):
                order = epoch_order(n, seed=SEED, epoch=epoch, shuffle=shuffle, world_size=world,
                                    drop_last=drop_last)
                for rank in range(world):
                    ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=SEED,
                                             drop_last=drop_last)
                    ref.set_epoch(epoch)
                    assert order[rank::world] == list(ref), (n, world, epoch, rank)
                    mine = ResumableSampler.like(ref)
                    mine.set_epoch(epoch)
                    assert list(mine) == list(ref) and len(mine) == len(ref)


@pytest.mark.parametrize(("n", "drop_last"), [(48, False), (50, False), (37, False), (50, True), (37, True)])
def test_stopped_after_any_step_the_rest_is_the_uninterrupted_runs(n: int, drop_last: bool) -> None:
    """4 ranks x 3 per rank (global batch 12), stopped after step k, continued on 4, 2, 3 and 1 ranks."""
    reference = _loaders(n, 4, 3, drop_last)
    epoch0, epoch1 = _steps(reference), _steps(reference)
    assert epoch0 != epoch1
    for k in range(1, len(epoch0) + 1):  # k == len: stopped right after the epoch's last batch
        first = _loaders(n, 4, 3, drop_last)
        done = _steps(first, upto=k)
        state = first[0].state_dict()
        assert all(loader.state_dict() == state for loader in first)  # one global position, the same everywhere
        assert json.loads(json.dumps(state)) == state
        assert (state["epoch"], state["batches"]) == ((0, k) if k < len(epoch0) else (1, 0))
        for world in (4, 2, 3, 1):
            resumed = _loaders(n, world, 5, drop_last)  # the per-rank batch becomes 12 / world
            for loader in resumed:
                loader.load_state_dict(state)
                assert loader.batch_size == 12 // world and loader.global_batch_size == 12
            rest, after = _steps(resumed), _steps(resumed)
            if k == len(epoch0):  # the epoch was over: the resumed job starts the next one
                assert _first_visits(rest) == _first_visits(epoch1) and (world != 4 or rest == epoch1)
                continue
            if world == 4:
                assert done + rest == epoch0 and after == epoch1, k  # the same batches, padding included
            assert _first_visits(done + rest) == _first_visits(epoch0), (k, world)
            if drop_last:  # no padding at all: the very same global batches
                assert done + rest == epoch0, (k, world)
            flat = [i for step in done + rest for i in step]
            assert set(flat) == set(epoch0[0]).union(*epoch0)  # every sample of the epoch, none skipped
            assert _first_visits(after) == _first_visits(epoch1)  # the next epoch is the seed's, as everywhere


def test_a_global_batch_that_does_not_divide_refuses_or_continues() -> None:
    first = _loaders(50, 4, 3)
    done = _steps(first, upto=2)
    state = first[0].state_dict()
    with pytest.raises(CheckpointError, match=r"global batch 12 .* does not divide over 5 ranks.*continue"):
        _loaders(50, 5, 3)[0].load_state_dict(state)
    resumed = _loaders(50, 5, 3, global_batch_change="continue")
    for loader in resumed:
        loader.load_state_dict(state)
    rest = _steps(resumed)
    assert resumed[0].global_batch_size == 15  # its own per-rank batch; the order goes on where it was
    order = epoch_order(50, seed=SEED, epoch=0, shuffle=True, world_size=4, drop_last=False)
    assert sorted(i for step in done for i in step) == sorted(order[:24])
    assert {i for step in rest for i in step} == set(order[24:])
    with pytest.raises(ConfigError, match="global_batch_change"):
        _loaders(10, 1, 2, global_batch_change="sometimes")


def test_a_resume_on_another_world_size_says_its_global_batch_in_one_line() -> None:
    """Saved on 2 ranks x 16 (global batch 32), resumed on 4 ranks built with 16 per rank: one line, by rank 0, at
    the first iteration, with the figures the loader really uses (not "global batch 64", then "keeps 32")."""
    from loguru import logger

    first = _loaders(96, 2, 16)
    _steps(first, upto=1)
    state = first[0].state_dict()
    lines: list[str] = []
    sink = logger.add(lines.append, filter=lambda r: "global batch" in r["message"], format="{message}")
    logger.enable("distfn")  # quiet outside a job
    try:
        resumed = _loaders(96, 4, 16)
        for loader in resumed:
            loader.load_state_dict(state)
        _steps(resumed)
        _steps(resumed)  # a second epoch: nothing more
        late = _loaders(96, 4, 16)  # iterated before the resume: a second line supersedes the first, consistently
        _steps(late, upto=1)
        for loader in late:
            loader.load_state_dict(state)
    finally:
        logger.disable("distfn")
        logger.remove(sink)
    assert lines[0] == ("dataloader: batch_size 8 per rank x 4 rank(s) = global batch 32; 3 batches per epoch per "
                        "rank (96 samples); resumed from 2 rank(s): 8 per rank instead of the 16 asked keeps the "
                        "saved global batch 32\n")
    assert lines[1].startswith("dataloader: batch_size 16 per rank x 4 rank(s) = global batch 64; 2 batches")
    assert lines[2] == ("dataloader resumed from 2 rank(s): batch_size 8 per rank x 4 rank(s) = global batch 32 as "
                        "saved, instead of the 16 per rank asked\n")
    assert len(lines) == 3


def test_workers_peeks_set_epoch_and_gather_positions_in_a_resumed_epoch() -> None:
    first = _loaders(31, 2, 3, num_workers=2)
    _steps(first)
    _steps(first, upto=3)  # epoch 1, 3 steps in
    state = first[0].state_dict()
    assert (state["epoch"], state["position"]) == (1, 18)
    [loader] = _loaders(31, 1, 4, num_workers=2)
    loader.load_state_dict(state)
    assert loader.state_dict()["position"] == 18  # before any iteration: the restored position
    assert len(loader) == 3  # the resumed epoch's remaining batches, already before the iteration
    peek = next(iter(loader))[0].tolist()  # a peek uses up nothing, not even the restored position
    batches = [x for (x,) in loader]
    assert batches[0].tolist() == peek and len(batches) == len(loader) == 3  # 14 left: 6, 6, 2
    order = epoch_order(31, seed=SEED, epoch=1, shuffle=True, world_size=2, drop_last=False)
    assert len(order) == 32 and torch.cat(batches).tolist() == order[18:]  # the 2-rank order's padding too
    positions = loader.positions(14)  # gather_for_metrics' positions: those of the epoch's order ...
    assert [order[p] for p in positions.tolist()] == torch.cat(batches).tolist()
    assert positions.tolist()[-1] == 31  # ... so the padding duplicate (position >= 31) is recognised
    assert loader.next_epoch == 2 and loader.state_dict()["position"] == 0
    loader.set_epoch(1)  # an explicit epoch starts at its beginning
    assert len(loader) == 6 and torch.cat([x for (x,) in loader]).tolist() == order[:31]


def test_the_state_is_json_in_the_file_and_reads_in_a_plain_process(tmp_path: Path) -> None:
    [loader] = _loaders(20, 1, 4)
    it = iter(loader)
    next(it), next(it)
    model = nn.Linear(2, 1)
    path = checkpoint.save({"model": model, "loader": loader, "step": 2}, tmp_path / "ckpt-2.safetensors")
    assert set(distfn.load(path)) == {"model.weight", "model.bias"}  # no tensor for the loader: JSON metadata
    saved = checkpoint.load_into(path, {})["loader"]
    assert saved["epoch"] == 0 and saved["position"] == 8 and saved["global_batch"] == 4
    [again] = _loaders(20, 1, 4)
    checkpoint.load_into(path, {"model": model, "loader": again})
    assert next(iter(again))[0].tolist() == next(it)[0].tolist()


@pytest.mark.parametrize("kind", ["background file", "sharded", "sharded background"])
def test_asynchronous_and_sharded_saves_carry_the_position_taken_at_the_call(tmp_path: Path, kind: str) -> None:
    [loader] = _loaders(20, 1, 4)
    it = iter(loader)
    next(it)
    model = nn.Linear(2, 1)
    state = {"model": model, "loader": loader}
    saves = background.Saves()
    if kind == "background file":
        path = saves.save_file(state, tmp_path / "ckpt-1.safetensors", save=checkpoint.save).path
    else:
        path = sharded.save(state, tmp_path / "ckpt-1", saves=saves, blocking=kind == "sharded")
    want = next(it)[0].tolist()  # the loop goes on while the write runs: the saved position is the call's
    next(it)
    saves.wait()
    assert checkpoint.load_into(path, {})["loader"]["position"] == 4
    assert set(distfn.load(path)) == {"model.weight", "model.bias"}  # a plain process reads it as usual
    [again] = _loaders(20, 1, 4)
    checkpoint.load_into(path, {"model": model, "loader": again})
    assert next(iter(again))[0].tolist() == want


def test_the_errors_name_what_is_wrong(tmp_path: Path) -> None:
    plain = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    with pytest.raises(CheckpointError, match=r"'loader'.*torch DataLoader has no position.*ctx.dataloader"):
        checkpoint.save({"loader": plain}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    [loader] = _loaders(20, 1, 4)
    state = loader.state_dict()
    with pytest.raises(CheckpointError, match="dataset of 20 samples, this one has 21"):
        _loaders(21, 1, 4)[0].load_state_dict(state)
    with pytest.raises(CheckpointError, match="drop_last=False, this one with drop_last=True"):
        _loaders(20, 1, 4, drop_last=True)[0].load_state_dict(state)
    with pytest.raises(CheckpointError, match="not a data loader state: position missing"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(CheckpointError, match="malformed data loader state: epoch"):
        loader.load_state_dict({**state, "epoch": -1})
    with pytest.raises(CheckpointError, match="past the end of epoch 0"):
        loader.load_state_dict({**state, "position": 20})


# -- real jobs ------------------------------------------------------------------------------------------------
def _job(out: Path, world: int, **config: Any) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return run_python([str(SCRIPTS / "exact_resume_job.py"), str(out), json.dumps(config)],
                      env=clean_env(DISTFN_NPROCS=str(world), PYTHONPATH=os.pathsep.join(
                          [str(SCRIPTS.parent.parent), os.environ.get("PYTHONPATH", "")])), timeout=300)


def _log(out: Path) -> dict[int, dict[str, Any]]:
    """Step -> that step's record; a step trained again after a kill keeps its last record."""
    steps: dict[int, dict[str, Any]] = {}
    for line in (out / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record
    return steps


def _samples(record: dict[str, Any]) -> list[int]:
    """The sample ids of one logged global batch, over every rank, sorted."""
    return sorted(i for rank in record["ids"] for i in rank)


def _result(out: Path) -> dict[str, Any]:
    return json.loads((out / "result.json").read_text())


_SAME = {"n": 31, "batch": 3, "epochs": 3, "workers": 2, "dropout": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize(("drop_last", "kills", "save"), [
    (False, [8, 12, 15], {}),  # 6 steps an epoch (the last one has 1 sample per rank): 12 ends epoch 1
    (True, [7, 10, 13], {"sharded": True, "async": True}),  # 5 steps an epoch: 10 ends epoch 1
    # issue 43: no rng= at all, ctx.save on rank 0 alone: the streams of every rank's last ctx.step, by default
    (False, [8, 12, 15], {"ctx_step": True, "rng": "default", "main_only": True}),
    # the same default in a sharded save, which every rank calls: the snapshots travel in the save's own gather
    (True, [7, 10, 13], {"ctx_step": True, "rng": "default", "sharded": True}),
])
def test_sigkill_mid_epoch_resumes_bit_identically(tmp_path: Path, drop_last: bool, kills: list[int],
                                                   save: dict[str, Any]) -> None:
    straight = _job(tmp_path / "straight", 2, **_SAME, drop_last=drop_last, kills=[])
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = tmp_path / "crashed"
    for attempt in range(len(kills) + 1):  # the same command again after each kill (as a requeue does)
        done = _job(crashed, 2, **_SAME, drop_last=drop_last, kills=kills, **save)
        assert (done.returncode == 0) == (attempt == len(kills)), done.stderr[-3000:]
    resumed_at = sorted(int(p.stem.split("-")[-1]) for p in crashed.glob("first-batch-*.json"))[1:]
    # from the step before each kill; an asynchronous save may still have been in flight: then the one before
    assert all(k - at in ((1, 2) if save.get("async") else (1,)) for k, at in zip(kills, resumed_at, strict=True)), \
        resumed_at
    a, b = _log(tmp_path / "straight"), _log(crashed)
    assert a.keys() == b.keys() and len(a) == 3 * (5 if drop_last else 6)
    for step in a:  # the same samples, on the same ranks, in the same order, at every step
        assert (b[step]["epoch"], b[step]["ids"]) == (a[step]["epoch"], a[step]["ids"]), step
    assert _result(crashed)["params"] == _result(tmp_path / "straight")["params"]  # bit for bit
    newest = checkpoint.latest(crashed / "ckpt")
    assert newest is not None
    assert distfn.load(newest)  # a plain process reads the checkpoint (sharded or not) ...
    position = checkpoint.load_into(newest, {})["loader"]  # ... and the position is readable metadata
    assert position["epoch"] == 3 and position["position"] == 0 and position["world_size"] == 2


@pytest.mark.slow
def test_saved_on_4_ranks_resumed_on_2_and_3(tmp_path: Path) -> None:
    """Global batch 12 (3 per rank on 4 ranks, 6 on 2, 4 on 3), 48 samples: 4 steps an epoch, 2 epochs; the
    4-rank job is killed during step 6 (epoch 1), its newest checkpoint is step 5."""
    config = {"n": 48, "batch": 3, "epochs": 2, "workers": 0, "dropout": 0.0, "drop_last": False}
    straight = _job(tmp_path / "straight", 4, **config, kills=[])
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _job(tmp_path / "killed", 4, **config, kills=[6])
    assert killed.returncode != 0
    reference, ref_params = _log(tmp_path / "straight"), torch.tensor(_result(tmp_path / "straight")["params"])
    started = time.perf_counter()
    for world in (2, 3):
        out = tmp_path / f"on{world}"
        shutil.copytree(tmp_path / "killed", out)
        done = _job(out, world, **config, kills=[])
        assert done.returncode == 0, done.stderr[-3000:]
        log, result = _log(out), _result(out)
        assert result["first"] == 5 and result["world"] == world
        assert [log[s]["world"] for s in sorted(log)] == [4] * 5 + [world] * 3  # step 6 again, on the new world
        for epoch in (0, 1):  # every sample of each epoch exactly once across the whole run
            ids = [i for s in log if log[s]["epoch"] == epoch for rank in log[s]["ids"] for i in rank]
            assert sorted(ids) == list(range(48)), epoch
        for step in range(6, 9):  # the remaining global batches are the uninterrupted 4-rank run's
            assert _samples(log[step]) == _samples(reference[step]), step
            assert [len(r) for r in log[step]["ids"]] == [12 // world] * world
        diff = (torch.tensor(result["params"]) - ref_params).abs().max().item()
        print(f"saved on 4 ranks, resumed on {world}: max abs weight difference {diff:.3g}")
        assert diff < 1e-5  # the same training up to the order of the floating-point reduction
    assert time.perf_counter() - started < 300


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", ["before_step", "after_step"])
def test_a_nanogpt_shaped_loop_resumes_bit_identically(tmp_path: Path, prefetch: str) -> None:
    """Issue 43: per-rank seeds (1337 + rank), torch.randint batches prefetched (nanoGPT's, before ctx.step: the
    batch goes in per_rank=; or after it: nothing to keep), evaluation and ctx.save on rank 0 alone, model_args
    read from the checkpoint's metadata before the model is built, no rng=: SIGKILLed at iterations 6 and 11
    (checkpoints every 4), rerun each time, the final weights equal an uninterrupted run's bit for bit."""
    def job(out: Path, kills: list[int], world: int = 2, **more: Any) -> Any:
        out.mkdir(parents=True, exist_ok=True)
        return run_python([str(SCRIPTS / "nanogpt_resume_job.py"), str(out),
                           json.dumps({"iters": 14, "prefetch": prefetch, "kills": kills, **more})],
                          env=clean_env(DISTFN_NPROCS=str(world), PYTHONPATH=os.pathsep.join(
                              [str(SCRIPTS.parent.parent), os.environ.get("PYTHONPATH", "")])), timeout=300)

    straight = job(tmp_path / "straight", [])
    assert straight.returncode == 0, straight.stderr[-3000:]
    for attempt in range(3):
        done = job(tmp_path / "crashed", [6, 11])
        assert (done.returncode == 0) == (attempt == 2), done.stderr[-3000:]
        if attempt:
            assert f"ctx.resume: restored {tmp_path / 'crashed' / 'ckpt'}" in done.stderr
            assert "every rank's random streams restored" in done.stderr, done.stderr[-3000:]
    assert _result(tmp_path / "crashed")["first"] == 8
    assert _result(tmp_path / "crashed")["params"] == _result(tmp_path / "straight")["params"]  # bit for bit
    fresh = job(tmp_path / "crashed", [], world=1, start="fresh")  # init_from="scratch" on an old directory
    assert fresh.returncode != 0 and "already holds checkpoints (the newest is ckpt-12.safetensors" in fresh.stderr
