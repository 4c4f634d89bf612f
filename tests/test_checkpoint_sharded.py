"""Sharded checkpoints (distfn.checkpoint.sharded): every rank writes its own safetensors shards plus one JSON
index; loads reshard onto any world size and mode; consolidate makes one file; atomic under kill -9; no pickle.

The multi-rank part is one script run (tests/scripts/sharded_job.py: fsdp saves on 4 and 2 ranks, loads on 2 fsdp
and 2 ddp ranks) checked from several sides, and two kill -9 runs. The rest runs in this process, without a
process group (one shard)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import distfn
from distfn import CheckpointError
from distfn.checkpoint import background, consolidate, layout, sharded, storage

from conftest import SCRIPTS, run_python

JOB = SCRIPTS / "sharded_job.py"
sys.path.insert(0, str(SCRIPTS))
from sharded_job import SAVE_AT, STEPS, Net, train  # noqa: E402


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _model_and_opt(seed: int = 7) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


# -- 4 and 2 fsdp ranks save; 2 fsdp, 2 ddp and 1 bare process load ------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("sharded")
    done = run_python([str(JOB), str(out), "reshard"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_writes_only_its_own_shards(job: tuple[dict, Path], world: int) -> None:
    result, out = job
    d = out / f"w{world}" / "ckpt-5"
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) == world  # one file per rank, written by that rank
    local = result["save"][str(world)]["local"]
    assert local["mid.weight"] == [64 // world, 64]  # fsdp really sharded the model
    for shard in shards:  # each file holds this rank's slice of every sharded tensor, not the full tensor
        with safe_open(str(shard), framework="pt") as f:
            assert list(f.get_slice("model.mid.weight").get_shape()) == [64 // world, 64]
            assert list(f.get_slice("optimizer.state.2.exp_avg").get_shape()) == [64 // world, 64]
    index = json.loads((d / sharded.INDEX).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(s.stat().st_size for s in shards) - sum(
        8 + int.from_bytes(s.read_bytes()[:8], "little") for s in shards)


@pytest.mark.slow
def test_a_same_size_fsdp_load_continues_bit_exactly(job: tuple[dict, Path]) -> None:
    result, _ = job
    straight = result["save"]["2"]["losses"][SAVE_AT:]
    assert result["fsdp2"]["fsdp2-w2-ckpt-5"]["losses"] == straight


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["fsdp2", "ddp2"])
@pytest.mark.parametrize("world", [2, 4])
def test_reshard_loads_equal_loads_of_the_gathered_file(job: tuple[dict, Path], loader: str, world: int) -> None:
    result, out = job
    sharded_run, file_run = result[loader][f"{loader}-w{world}-ckpt-5"], result[loader][f"{loader}-w{world}-full-5"]
    # What the loader holds right after loading (model and Adam moments, gathered to one file) is bit-identical.
    _equal(distfn.load(out / f"check-{loader}-w{world}-ckpt-5.safetensors"),
           distfn.load(out / f"check-{loader}-w{world}-full-5.safetensors"))
    _equal(distfn.load(out / f"check-{loader}-w{world}-ckpt-5.safetensors"),
           distfn.load(out / f"w{world}" / "full-5.safetensors"))
    # ... and so is the training that continues from it.
    assert sharded_run["losses"] == file_run["losses"]
    _equal(distfn.load(out / f"final-{loader}-w{world}-ckpt-5.safetensors"),
           distfn.load(out / f"final-{loader}-w{world}-full-5.safetensors"))
    assert sharded_run["rest"] == {"step": SAVE_AT} and sharded_run["step"] == SAVE_AT


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_bare_model_in_one_process_loads_and_continues_bit_exactly(job: tuple[dict, Path], world: int) -> None:
    _, out = job
    d, full = out / f"w{world}" / "ckpt-5", out / f"w{world}" / "full-5.safetensors"
    bare = Net()
    bare.load_state_dict(distfn.load(d, prefix="model"))  # distfn.load of a directory: whole tensors
    _equal(bare.state_dict(), distfn.load(full, prefix="model"))

    runs = []
    for load in (lambda s: sharded.load_into(d, s), lambda s: distfn.checkpoint.load_into(full, s)):
        model, opt = _model_and_opt()
        state = {"model": model, "optimizer": opt, "step": 0}
        assert load(state) == {"step": SAVE_AT}
        assert state["step"] == SAVE_AT
        losses = train(model, opt, SAVE_AT + 1, STEPS)
        runs.append((losses, model.state_dict(), opt.state_dict()))
    assert runs[0][0] == runs[1][0]
    _equal(runs[0][1], runs[1][1])
    for i in runs[1][2]["state"]:
        _equal(runs[0][2]["state"][i], runs[1][2]["state"][i])


@pytest.mark.slow
def test_consolidate_streams_one_file_equal_to_the_gathered_one(job: tuple[dict, Path], tmp_path: Path) -> None:
    _, out = job
    one = consolidate(out / "w4" / "ckpt-5", tmp_path / "one.safetensors")
    _equal(load_file(str(one)), load_file(str(out / "w4" / "full-5.safetensors")))
    merged, gathered = (distfn.checkpoint.load_into(p, {}) for p in (one, out / "w4" / "full-5.safetensors"))
    assert merged["step"] == gathered["step"] == SAVE_AT  # the same tree: plain values and hyper-parameters too
    assert merged["optimizer"]["param_groups"] == gathered["optimizer"]["param_groups"]
    done = subprocess.run([sys.executable, "-m", "distfn", "consolidate", str(out / "w2" / "ckpt-5"),
                           str(tmp_path / "cli.safetensors")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _equal(load_file(str(tmp_path / "cli.safetensors")), load_file(str(out / "w2" / "full-5.safetensors")))
    bad = subprocess.run([sys.executable, "-m", "distfn", "consolidate", str(tmp_path),
                          str(tmp_path / "x.safetensors")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "no model.safetensors.index.json" in bad.stderr


@pytest.mark.slow
def test_index_and_shards_open_with_safetensors(job: tuple[dict, Path]) -> None:
    _, out = job
    d = out / "w4" / "ckpt-5"
    index = json.loads((d / "model.safetensors.index.json").read_text())  # the Hugging Face index layout
    assert isinstance(index["metadata"]["total_size"], int)
    for name, file in index["weight_map"].items():
        with safe_open(str(d / file), framework="pt") as f:
            assert name in f.keys()
            assert f.metadata()["format"] == "pt"


def _refuse_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.slow
def test_no_pickle_is_written_or_read(job: tuple[dict, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, out = job
    for d in (out / "w2" / "ckpt-5", out / "w4" / "ckpt-5"):
        names = sorted(p.name for p in d.iterdir())
        assert names == [sharded.INDEX, *(f"shard-{r:05d}-model-00001-of-00001.safetensors"
                                          for r in range(1, len(names)))]  # no .metadata, nothing else
        json.loads((d / sharded.INDEX).read_text())
        for shard in d.glob("*.safetensors"):
            head = shard.read_bytes()[:9]
            assert head[8:9] == b"{" and not head.startswith(b"\x80")  # a JSON header, not a pickle
    _refuse_pickle(monkeypatch)
    model, opt = _model_and_opt()
    sharded.load_into(out / "w4" / "ckpt-5", {"model": model, "optimizer": opt})
    distfn.load(out / "w2" / "ckpt-5")


# -- kill -9 of a rank in the middle of a sharded save ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_mid_save_keeps_the_previous_checkpoint_and_the_partial_is_ignored_then_cleaned(
    tmp_path: Path, victim: int
) -> None:
    done = run_python([str(JOB), str(tmp_path), "kill", str(victim)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert f"rank {victim} " in result["error"] and "SIGKILL" in result["error"]
    assert not (tmp_path / "ckpt-2").exists()
    assert distfn.latest(tmp_path) == tmp_path / "ckpt-1"  # the partial save is never a candidate
    model, opt = _model_and_opt()
    assert sharded.load_into(tmp_path / "ckpt-1", {"model": model, "optimizer": opt}) == {"step": 2}
    # A killed rank 0 leaves its hidden directory (killed rank 1: rank 0 removes it as it fails).
    partials = list(tmp_path.glob(".ckpt-2.*.distfn-partial"))
    assert len(partials) == (1 if victim == 0 else 0)
    sharded.save({"model": model}, tmp_path / "ckpt-3")  # the next save cleans what the killed one left
    assert not list(tmp_path.glob(".*distfn-partial")) and distfn.latest(tmp_path) == tmp_path / "ckpt-3"


# -- one process, no process group -------------------------------------------------------------------------------
def test_the_default_rule_sharded_in_fsdp_mode_without_the_suffix() -> None:
    assert layout.wants_sharded("ckpt/step-1200", "fsdp", None)
    assert not layout.wants_sharded("ckpt/step-1200.safetensors", "fsdp", None)
    assert not layout.wants_sharded("ckpt/step-1200", "ddp", None)
    assert layout.wants_sharded("ckpt/step-1200", "ddp", True)
    assert not layout.wants_sharded("ckpt/step-1200", "fsdp", False)


def test_latest_and_keep_understand_directories(tmp_path: Path) -> None:
    model, _ = _model_and_opt()
    for step in (1, 2, 3):
        sharded.save({"model": model, "step": step}, tmp_path / f"ckpt-{step}", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "ckpt-3"]
    (tmp_path / ".ckpt-9.vm.1.00000000.distfn-partial").mkdir()  # a partial save: hidden, never a candidate
    (tmp_path / "ckpt-8").mkdir()  # no index: incomplete, skipped
    distfn.checkpoint.save(model, tmp_path / "ckpt-2.safetensors")
    assert distfn.latest(tmp_path) == tmp_path / "ckpt-3"
    with pytest.raises(CheckpointError, match="step-numbered"):
        sharded.save({"model": model}, tmp_path / "final", keep=2)


def test_save_refuses_a_safetensors_name_and_a_failed_save_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _model_and_opt()
    with pytest.raises(CheckpointError, match="is a directory"):
        sharded.save(model, tmp_path / "m.safetensors")
    sharded.save({"model": model, "step": 1}, tmp_path / "ckpt")
    before = distfn.load(tmp_path / "ckpt")

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    with torch.no_grad():
        model.inp.weight.add_(1)
    # the disk fills while a shard is written, or while the index is written: both leave the previous one
    for where in (storage, sharded.write._ShardJob):
        with monkeypatch.context() as m:
            m.setattr(where, "write" if where is storage else "_write_index", full_disk)
            with pytest.raises(CheckpointError, match=r"cannot save .*ckpt.*No space left.*previous checkpoint"):
                sharded.save({"model": model, "step": 2}, tmp_path / "ckpt")
        _equal(distfn.load(tmp_path / "ckpt"), before)
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the partial directory is gone


def test_load_checks_everything_before_changing_anything(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    sharded.save({"model": model, "optimizer": opt}, tmp_path / "ckpt")
    other = nn.Sequential(nn.Linear(16, 64))
    with pytest.raises(CheckpointError, match="missing keys"):
        sharded.load_into(tmp_path / "ckpt", {"model": other})
    wide = Net()
    wide.out = nn.Linear(64, 5)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"holds shape \(4,\), the live tensor has \(5,\)"):
        sharded.load_into(tmp_path / "ckpt", {"model": wide})
    _equal(wide.state_dict(), before)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json"):
        sharded.load_into(tmp_path, {"model": model})


def test_tied_weights_schedulers_and_plain_values_round_trip(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    train(model, opt, 1, 3)
    sched.step()
    sharded.save({"model": model, "optimizer": opt, "scheduler": sched, "step": 3, "best": (0.5, "x")},
                 tmp_path / "ckpt", metadata={"note": "hi"})
    model2, opt2 = _model_and_opt(seed=99)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 5)
    state = {"model": model2, "optimizer": opt2, "scheduler": sched2, "step": 0}
    assert sharded.load_into(tmp_path / "ckpt", state) == {"step": 3, "best": (0.5, "x")}
    assert state["step"] == 3 and sched2.state_dict() == sched.state_dict()
    _equal(model2.state_dict(), model.state_dict())
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    index = json.loads((tmp_path / "ckpt" / sharded.INDEX).read_text())
    assert index["metadata"]["note"] == "hi"


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    return model


def test_tied_weights_are_stored_once_and_tied_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _tied()
    sharded.save(model, tmp_path / "tied")
    assert list(distfn.load(tmp_path / "tied")) == ["0.weight", "1.weight"]
    with safe_open(str(next((tmp_path / "tied").glob("*.safetensors"))), framework="pt") as f:
        assert list(f.keys()) == ["0.weight"]
    torch.manual_seed(1)
    again = _tied()
    sharded.load_into(tmp_path / "tied", again)
    _equal(again.state_dict(), model.state_dict())
    assert again[1].weight is again[0].weight


# -- asynchronous saves (ctx.save(..., blocking=False)) ----------------------------------------------------------
@pytest.mark.slow
def test_async_saves_hold_the_state_of_the_call_and_complete_before_the_group_goes(tmp_path: Path) -> None:
    done = run_python([str(JOB), str(tmp_path), "async"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for mode in ("ddp", "fsdp"):
        assert result[mode] == {"returned": True, "allocated": 0}  # the second sharded save reused its buffers
        d = tmp_path / mode
        # one file: written in the background while training changed the live tensors; holds the state of the call
        _equal(distfn.load(d / "async-3.safetensors"), distfn.load(d / "ref-3.safetensors"))
        for step in (4, 5):  # sharded; step 5 was still pending when the function returned
            one = consolidate(d / f"ckpt-{step}", tmp_path / f"{mode}-{step}.safetensors")
            _equal(distfn.load(one), distfn.load(d / f"ref-{step}.safetensors"))
            assert distfn.checkpoint.load_into(one, {})["step"] == step
        assert not list(d.glob(".*"))  # no partial directory or temporary file left
    # ddp: every tensor is replicated; each is written once, and both ranks write about half of the bytes
    shards = sorted((tmp_path / "ddp" / "ckpt-5").glob("shard-*.safetensors"))
    assert len(shards) == 2
    names = [set(load_file(s)) for s in shards]
    assert not names[0] & names[1] and names[0] | names[1] == set(distfn.load(tmp_path / "ddp" / "ckpt-5"))
    sizes = [sum(t.numel() * t.element_size() for t in load_file(s).values()) for s in shards]
    assert min(sizes) > 0.3 * sum(sizes), sizes


@pytest.mark.slow
def test_a_remembered_save_plan_writes_the_bytes_of_a_fresh_one_and_a_new_layout_plans_again(tmp_path: Path) -> None:
    done = run_python([str(JOB), str(tmp_path), "replan"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["memo"] > 0  # the fresh save filled the memo, which the second save used
    fresh, warm = tmp_path / "fresh" / "ckpt-2", tmp_path / "warm" / "ckpt-2"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in warm.iterdir()) and len(names) == 3  # two shards and the index
    for name in names:
        assert (fresh / name).read_bytes() == (warm / name).read_bytes(), name
    # the same names with other shapes: new offsets were planned (the memo grew) and both ranks' pieces are right
    assert result["sizes"]["96"] > result["sizes"]["64"]
    for width in (64, 96):
        d = tmp_path / f"w{width}"
        _equal(distfn.load(d / "ckpt-1"), distfn.load(d / "ref.safetensors"))
        assert distfn.load(d / "ckpt-1")["model.0.weight"].shape == (width, 16)


@pytest.mark.slow
def test_kill_9_during_an_async_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    done = run_python([str(JOB), str(tmp_path), "async-kill"], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "rank 0 " in result["error"] and "SIGKILL" in result["error"]
    assert distfn.latest(tmp_path) == tmp_path / "ckpt-1"
    model, opt = _model_and_opt()
    assert sharded.load_into(tmp_path / "ckpt-1", {"model": model, "optimizer": opt}) == {"step": 2}
    sharded.save({"model": model}, tmp_path / "ckpt-3")
    assert not list(tmp_path.glob(".*"))


def test_a_background_save_copies_first_checks_early_and_reports_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _model_and_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    distfn.checkpoint.save_in_background({"model": model, "step": 1}, tmp_path / "a.safetensors")
    with torch.no_grad():
        model.inp.weight.add_(1)  # after the call: not in the file
    background.DEFAULT.wait()
    _equal(distfn.load(tmp_path / "a.safetensors", prefix="model"), before)
    with pytest.raises(CheckpointError, match="cannot save the value at"):  # raised in the caller, not later
        distfn.checkpoint.save_in_background({"f": lambda: 0}, tmp_path / "b.safetensors")

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(distfn.checkpoint.storage, "write", full_disk)
    distfn.checkpoint.save_in_background({"model": model}, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match=r"background save of .*c\.safetensors failed.*No space left"):
        background.DEFAULT.wait()
    assert not background.DEFAULT.pending() and not (tmp_path / "c.safetensors").exists()


def test_a_sharded_background_save_in_one_process(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    train(model, opt, 1, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sharded.save({"model": model, "optimizer": opt, "step": 2}, tmp_path / "ckpt-2", blocking=False)
    train(model, opt, 3, 3)
    background.DEFAULT.wait()
    _equal(distfn.load(tmp_path / "ckpt-2", prefix="model"), before)
    # the next save of the same state copies into the same host buffers, and still holds the state of its call
    first = background.DEFAULT.buffers.allocated
    assert first >= sum(v.numel() * v.element_size() for v in before.values())
    after = {k: v.clone() for k, v in model.state_dict().items()}
    sharded.save({"model": model, "optimizer": opt, "step": 3}, tmp_path / "ckpt-3", blocking=False)
    assert background.DEFAULT.buffers.allocated == 0
    train(model, opt, 4, 4)
    background.DEFAULT.wait()
    _equal(distfn.load(tmp_path / "ckpt-3", prefix="model"), after)
    _equal(distfn.load(tmp_path / "ckpt-2", prefix="model"), before)


def _direct_io_works(where: Path) -> bool:
    import os

    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    (where / "probe").unlink()
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("refused", [False, True], ids=["direct", "file-system-refuses-direct-io"])
def test_a_background_sharded_save_writes_the_bytes_of_a_blocking_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """The staged image (header and tensors laid out like the file, written with O_DIRECT where the file system
    has it) is byte for byte the file a blocking save streams from the tensors, and so is the fallback."""
    from distfn.checkpoint import fs

    torch.manual_seed(3)
    # 2 MiB + 12 bytes of float32 (the direct path's aligned bulk and a tail), mixed element sizes, a 0-d tensor
    state = {"big": torch.randn(524_291), "half": torch.randn(33, 7).half(), "flags": torch.rand(5) > 0.5,
             "count": torch.tensor(7), "empty": torch.zeros(0, 3), "step": 4}
    went: list[int] = []
    real = fs._LocalStream._write_direct

    def spy(self: fs._LocalStream, data: memoryview) -> memoryview:
        left = real(self, data)
        went.append(len(data) - len(left))
        return left

    monkeypatch.setattr(fs._LocalStream, "_write_direct", spy)
    if refused:  # what tmpfs and some network file systems say to O_DIRECT
        monkeypatch.setattr(fs, "_O_DIRECT", 0o40000000)  # not a flag fcntl accepts: F_SETFL raises EINVAL
        import fcntl

        real_fcntl = fcntl.fcntl

        def no_direct(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & 0o40000000:
                raise OSError(22, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", no_direct)
    sharded.save(state, tmp_path / "blocking")
    assert not went  # a blocking save streams from the tensors through the page cache
    saves = background.Saves()
    sharded.save(state, tmp_path / "async", saves=saves, blocking=False)
    state["big"].add_(1)  # after the call: not in the file
    saves.wait()
    names = sorted(p.name for p in (tmp_path / "blocking").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "async").iterdir())
    for name in names:
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "blocking" / name).read_bytes(), name
    direct = sum(went)
    if refused or not _direct_io_works(tmp_path):
        assert direct == 0
    else:  # the page-aligned bulk of the 2 MiB shard went around the page cache, the tail did not
        size = next((tmp_path / "async").glob("shard-*.safetensors")).stat().st_size
        assert direct == size - size % fs.DIRECT_ALIGN and direct >= 2 << 20
    # a second save reuses the image and still holds the state of its own call
    at_call = state["big"].clone()
    sharded.save(state, tmp_path / "again", saves=saves, blocking=False)
    assert saves.buffers.allocated == 0
    state["big"].add_(1)
    saves.wait()
    assert torch.equal(distfn.load(tmp_path / "again")["big"], at_call)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_background_writer_yields_the_cpu_to_training() -> None:
    import os
    import threading

    seen: list[int] = []
    background.DEFAULT.submit("probe", lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    background.DEFAULT.wait()
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(main + 10, 19)]  # the writer only: the training thread keeps its priority
    assert os.getpriority(os.PRIO_PROCESS, 0) == main

    def niced_training() -> None:  # a training thread under `nice -n 5` (nice() is per thread on Linux)
        os.nice(5)
        background.DEFAULT.submit("probe", lambda: seen.append(os.getpriority(os.PRIO_PROCESS,
                                                                               threading.get_native_id())))
        background.DEFAULT.wait()

    trainer = threading.Thread(target=niced_training)
    trainer.start()
    trainer.join()
    assert seen[1] == min(main + 15, 19)  # relative to the niced trainer: an absolute 10 would outrank it
    assert os.getpriority(os.PRIO_PROCESS, 0) == main
