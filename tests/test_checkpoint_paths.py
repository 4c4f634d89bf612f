"""What a checkpoint path means, the same for save and load on every rank (issue 24 item 3, issue 31 items 2, 4).

Resolved once (`distfn.checkpoint.layout.resolve`): ``~`` is expanded before anything looks at the disk, a
trailing ``/`` names a directory, the path returned is the same absolute path on every rank; per-rank names, a
pickle-looking suffix and a parent that is a file are said so. Most checks run in this process (a one-rank
``Context``); the cross-rank ones run one 2-rank fsdp job (tests/scripts/ckpt_paths_job.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_helpers import Net

import distfn
from distfn import CheckpointError
from distfn.checkpoint import sharded
from distfn.context import Context

from conftest import SCRIPTS, clean_env, run_python


def _ctx(mode: str) -> Context:
    return Context(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   device=torch.device("cpu"), backend=None, mode=mode, launcher="local")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_a_sharded_directory_saved_under_tilde_loads_under_tilde(home: Path) -> None:
    """Issue 24 defect 3: the directory test ran on the raw path, before '~' was expanded."""
    model = Net()
    ctx = _ctx("fsdp")
    saved = ctx.save({"model": model, "step": 3}, "~/ck/ckpt-1")
    assert saved == home / "ck" / "ckpt-1" and (saved / sharded.INDEX).is_file()
    loaded = distfn.load("~/ck/ckpt-1", prefix="model")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    other = Net(width=8)
    assert ctx.load("~/ck/ckpt-1", into={"model": other, "step": 0})["step"] == 3
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())
    assert distfn.latest("~/ck") == saved
    assert _ctx("ddp").resume({"model": Net(), "step": 0}, "~/ck") == 1


@pytest.mark.parametrize("mode", ["ddp", "single"])
def test_a_trailing_slash_never_writes_a_file(tmp_path: Path, mode: str) -> None:
    """Issue 24 defect 3: ctx.save(model, "out/") silently wrote a file named out."""
    with pytest.raises(CheckpointError, match=r"trailing '/' names a directory.*out/model\.safetensors"):
        _ctx(mode).save(Net(), f"{tmp_path}/out/")
    with pytest.raises(CheckpointError, match="trailing '/' names a directory"):
        distfn.checkpoint.save(Net(), f"{tmp_path}/out/")
    assert not (tmp_path / "out").exists()
    # sharded=True (or fsdp mode without a suffix): the slash means what it says, a directory
    assert _ctx(mode).save(Net(), f"{tmp_path}/out/", sharded=True) == tmp_path / "out"
    assert (tmp_path / "out" / sharded.INDEX).is_file()


def test_a_parent_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=r"'.*afile' is a file, not a directory"):
        _ctx("ddp").save(Net(), tmp_path / "afile" / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"'.*afile' is a file, not a directory"):
        distfn.checkpoint.save(Net(), tmp_path / "afile" / "deeper" / "m.safetensors")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_pickle_suffix_warns_once(tmp_path: Path, warnings_seen: list[str]) -> None:
    for name in ("a.pt", "b.pt", "c.bin"):
        distfn.checkpoint.save(Net(), tmp_path / name)
    about = [w for w in warnings_seen if "safetensors" in w and "torch.load" in w]
    assert len(about) == 2 and "'.pt'" in about[0] and "'.bin'" in about[1]
    assert set(distfn.load(tmp_path / "a.pt")) == set(Net().state_dict())


def test_every_pickle_looking_suffix_warns_on_save_and_is_refused_on_a_bad_load(tmp_path: Path,
                                                                              warnings_seen: list[str]) -> None:
    """Issue 40 item 6: one list of pickle-looking suffixes (`checkpoint.names`): '.pickle' and '.tar' saved
    without the warning '.pt' gets, while the reader counted them as pickle-looking."""
    from distfn.checkpoint import api

    api._warn_suffix.cache_clear()
    for suffix in (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar"):
        distfn.checkpoint.save(Net(), tmp_path / f"x{suffix}")
        assert any(f"'{suffix}' file written now holds safetensors" in w for w in warnings_seen), suffix
        (tmp_path / f"bad{suffix}").write_bytes(b"\x80\x04not a safetensors file")
        with pytest.raises(CheckpointError, match=r"looks like a pickle-based torch\.save file"):
            distfn.load(tmp_path / f"bad{suffix}")


def test_consolidate_names_a_missing_path_and_a_single_file(tmp_path: Path) -> None:
    missing = run_python(["-m", "distfn", "consolidate", str(tmp_path / "nope"), str(tmp_path / "o.safetensors")])
    assert missing.returncode == 1 and missing.stderr.startswith("distfn consolidate: ")
    assert "does not exist" in missing.stderr
    one = distfn.checkpoint.save(Net(), tmp_path / "m.safetensors")
    done = run_python(["-m", "distfn", "consolidate", str(one), str(tmp_path / "o.safetensors")])
    assert done.returncode == 1 and "is already one file" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_failed_background_save_in_a_plain_script_fails_the_script(tmp_path: Path) -> None:
    """Issue 25 item 14: save_in_background, then exit: the failure was lost (status 0, nothing on stderr)."""
    code = textwrap.dedent(
        """
        import os, sys, torch
        from distfn import checkpoint

        def failing_disk(fd):
            raise OSError(5, "Input/output error")

        os.fsync = failing_disk  # the file's data never becomes durable
        checkpoint.save_in_background({"w": torch.ones(1000)}, sys.argv[1])
        print("script done")
        """
    )
    done = run_python(["-c", code, str(tmp_path / "bg.safetensors")])
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "script done" in done.stdout
    assert "background save of" in done.stderr and "Input/output error" in done.stderr
    assert not (tmp_path / "bg.safetensors").exists()
    fine = ("import sys, torch\nfrom distfn import checkpoint\n"
            "checkpoint.save_in_background({'w': torch.ones(3)}, sys.argv[1])")
    ok = run_python(["-c", fine, str(tmp_path / "ok.safetensors")])
    assert ok.returncode == 0 and (tmp_path / "ok.safetensors").is_file()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str, Path]:
    out = tmp_path_factory.mktemp("paths")
    (out / "home").mkdir()
    done = run_python([str(SCRIPTS / "ckpt_paths_job.py"), str(out)], env=clean_env(HOME=str(out / "home")),
                      timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)], done.stderr, out


@pytest.mark.slow
def test_fsdp_tilde_checkpoints_load_with_ctx_load_and_distfn_load(two_ranks) -> None:
    results, _, out = two_ranks
    for r in results:
        assert r["tilde_save"] == str(out / "home" / "ck" / "ckpt-1")
        assert r["tilde_ctx_load"] == 7
    assert results[0]["tilde_load_shapes"] == {"model.0.weight": [32, 8], "model.0.bias": [32],
                                               "model.2.weight": [4, 32], "model.2.bias": [4]}


@pytest.mark.slow
def test_ctx_save_returns_the_same_absolute_path_on_every_rank(two_ranks) -> None:
    results, _, out = two_ranks
    assert results[0]["one_file"] == results[1]["one_file"] == str(out / "rel" / "one.safetensors")
    assert results[0]["slash_dir"] == results[1]["slash_dir"] == str(out / "out")
    assert (out / "out" / sharded.INDEX).is_file()


@pytest.mark.slow
def test_per_rank_paths_are_an_error_where_ranks_meet_and_a_warning_elsewhere(two_ranks) -> None:
    results, stderr, out = two_ranks
    for r in results:  # every rank raises the same error: nothing half-written
        assert "different" in r["per_rank_sharded"] and "distfn.checkpoint.save" in r["per_rank_sharded"]
        assert "different paths" in r["per_rank_rng"] and "distfn.checkpoint.save" in r["per_rank_rng"]
    assert not list((out / "per").glob("t-rank*")) and not list((out / "per").glob("r-rank*"))
    assert results[1]["per_rank_file"] == str(out / "per" / "f-rank1.safetensors")  # rank 0 wrote f-rank0 only
    assert "per-rank name is never written" in stderr and "distfn.checkpoint.save" in stderr
    assert stderr.count("per-rank name is never written") == 1
