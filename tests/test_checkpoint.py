"""distfn.checkpoint's public functions end to end: save / load / load_into round trips (no process group,
except the two-rank ctx.save test)."""

from __future__ import annotations

import json
import pathlib
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_helpers import Net, Tied, equal_state, repo_env, train
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from distfn import checkpoint
from distfn.errors import CheckpointError


def test_bare_module_round_trip_has_bare_keys(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = Net()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    path = checkpoint.save(model, tmp_path / "model.safetensors")
    assert path == tmp_path / "model.safetensors"
    stock = load_file(path)
    equal_state(stock, model.state_dict())
    equal_state(checkpoint.load(path), model.state_dict())
    fresh = Net()
    assert checkpoint.load_into(path, fresh) == {}
    equal_state(fresh.state_dict(), model.state_dict())


def test_live_model_is_not_moved_or_copied(tmp_path: pathlib.Path) -> None:
    model = Net()
    before = {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()}
    checkpoint.save({"model": model}, tmp_path / "s.safetensors")
    assert {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()} == before


def test_data_parallel_saves_bare_keys_and_loads_into_wrappers(tmp_path: pathlib.Path) -> None:
    model = Net()
    dp = nn.DataParallel(model)  # on CPU: a plain wrapper, which is what matters for the keys
    path = checkpoint.save(dp, tmp_path / "dp.safetensors")
    assert not any(k.startswith("module.") for k in load_file(path))
    equal_state(load_file(path), model.state_dict())
    target = nn.DataParallel(Net())
    checkpoint.load_into(path, target)
    equal_state(target.module.state_dict(), model.state_dict())
    # A training state with a wrapped module gets the bare keys under its prefix.
    path2 = checkpoint.save({"model": dp, "step": 1}, tmp_path / "state.safetensors")
    assert set(load_file(path2)) == {f"model.{k}" for k in model.state_dict()}


def test_torch_compile_wrapper_is_stripped(tmp_path: pathlib.Path) -> None:
    model = Net()
    try:
        compiled = torch.compile(model)  # wrapping only; nothing is compiled until it is called
    except Exception as exc:  # noqa: BLE001 - any failure means: not available in this build  # pragma: no cover
        pytest.skip(f"torch.compile unavailable: {exc}")
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert checkpoint.unwrap_module(compiled) is model
    assert checkpoint.unwrap_module(nn.DataParallel(compiled)) is model
    path = checkpoint.save(compiled, tmp_path / "c.safetensors")
    equal_state(load_file(path), model.state_dict())
    target = torch.compile(Net())
    checkpoint.load_into(path, target)
    equal_state(target._orig_mod.state_dict(), model.state_dict())


def test_tied_weights_stored_once_and_retied(tmp_path: pathlib.Path) -> None:
    model = Tied()
    path = checkpoint.save(model, tmp_path / "tied.safetensors")
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == {"embed.weight"}  # stored once
    loaded = checkpoint.load(path)
    assert set(loaded) == {"embed.weight", "head.weight"}
    assert loaded["head.weight"] is loaded["embed.weight"]
    fresh = Tied()
    checkpoint.load_into(path, fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    # Files of other tools that drop the tied copy still load strictly into a tied model.
    other = tmp_path / "other.safetensors"
    save_file({"embed.weight": model.embed.weight.detach().clone()}, str(other))
    fresh2 = Tied()
    checkpoint.load_into(other, fresh2)
    assert torch.equal(fresh2.head.weight, model.embed.weight)


def test_non_contiguous_and_overlapping_views(tmp_path: pathlib.Path) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "t": base.t(),  # transposed
        "strided": base[::2, 1::3],
        "row": base[2],  # overlaps base: stored separately, correct values
        "base": base,
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
        "neg": torch.tensor([1.0, -2.0])._neg_view(),
    }
    path = checkpoint.save(state, tmp_path / "views.safetensors")
    stock = load_file(path)
    for k, v in state.items():
        assert torch.equal(stock[k], v.resolve_conj().resolve_neg()), k
        assert stock[k].shape == v.shape


def test_no_pickle_in_files_or_code_paths(tmp_path: pathlib.Path, monkeypatch) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("dumps", "dump", "loads", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Pickler", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    path = checkpoint.save({"model": model, "optimizer": opt, "scheduler": sched, "rng": checkpoint.RNG, "step": 2},
                           tmp_path / "s.safetensors")
    model2 = Net()
    opt2 = torch.optim.Adam(model2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3)
    checkpoint.load_into(path, {"model": model2, "optimizer": opt2, "scheduler": sched2, "rng": checkpoint.RNG})
    checkpoint.load(path)
    monkeypatch.undo()
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{"
    json.loads(raw[8 : 8 + n])  # the whole header is JSON
    for marker in (b"\x80\x02", b"\x80\x04", b"\x80\x05", b"PK\x03\x04", b"c__builtin__", b"torch._utils"):
        assert marker not in raw[: 8 + n]
    expected_data = sum(t.numel() * t.element_size() for t in load_file(path).values())
    assert len(raw) == 8 + n + expected_data  # nothing but header and raw tensor bytes


def test_module_extra_state_round_trips(tmp_path: pathlib.Path) -> None:
    class WithExtra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.vocab = {"a": 1}

        def get_extra_state(self) -> dict:
            return {"vocab": self.vocab, "version": (1, 2)}

        def set_extra_state(self, state: dict) -> None:
            self.vocab = state["vocab"]

    model = WithExtra()
    model.vocab = {"a": 1, "b": 2}
    path = checkpoint.save({"model": model}, tmp_path / "x.safetensors")
    fresh = WithExtra()
    checkpoint.load_into(path, {"model": fresh})
    assert fresh.vocab == {"a": 1, "b": 2}
    assert torch.equal(fresh.fc.weight, model.fc.weight)


def test_load_with_prefix_gives_the_model_state_dict(tmp_path: pathlib.Path) -> None:
    model, tied = Net(), Tied()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1)
    path = checkpoint.save({"model": model, "lm": tied, "optimizer": opt, "step": 1}, tmp_path / "s.safetensors")
    equal_state(checkpoint.load(path, prefix="model"), model.state_dict())
    lm = checkpoint.load(path, prefix="lm.")
    assert set(lm) == {"embed.weight", "head.weight"} and lm["head.weight"] is lm["embed.weight"]
    fresh = Net()
    fresh.load_state_dict(checkpoint.load(path, prefix="model"))
    with pytest.raises(CheckpointError, match=r"no tensors under 'nothing'.*'lm', 'model', 'optimizer'"):
        checkpoint.load(path, prefix="nothing")


_TWO_RANKS = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    import distfn
    from distfn import checkpoint, distributed

    @distributed(mode="ddp", seed=0, nprocs=2)
    def job(cfg, ctx):
        calls = []
        real = checkpoint.save
        checkpoint.save = lambda *a, **k: (calls.append(ctx.rank), real(*a, **k))[1]  # count real writes
        model = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(ctx.rank))
        model(x).square().mean().backward()
        opt.step()
        # 1) called by every rank: only rank 0 writes, every rank gets the path back
        path = ctx.save({"model": model, "optimizer": opt, "step": 1}, os.path.join(cfg["dir"], "all.safetensors"))
        # 2) called under `if ctx.is_main:` only: must not hang (no collective inside)
        if ctx.is_main:
            ctx.save(model, os.path.join(cfg["dir"], "main.safetensors"))
        ctx.barrier()
        fresh = ctx.wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
        rest = ctx.load(path, into={"model": fresh, "optimizer": fresh_opt})
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        return ctx.gather_object({"rank": ctx.rank, "calls": calls, "path": str(path), "rest": rest,
                                  "same": same, "lr": fresh_opt.param_groups[0]["lr"]})

    if __name__ == "__main__":
        print("RESULT " + json.dumps(job({"dir": sys.argv[1]})))
    """
)


@pytest.mark.slow
def test_two_ranks_one_write_no_collective_and_ddp_round_trip(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(_TWO_RANKS)
    env = {k: v for k, v in repo_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("TORCHELASTIC_", "DISTFN_", "SLURM_", "OMPI_", "PMI_"))}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["calls"] == [0, 0] and results[1]["calls"] == []  # rank 0 wrote both files, rank 1 none
    assert {r["path"] for r in results} == {str(tmp_path / "all.safetensors")}
    assert all(r["same"] and r["rest"] == {"step": 1} and r["lr"] == 0.1 for r in results)
    for name in ("all.safetensors", "main.safetensors"):
        keys = set(load_file(tmp_path / name))
        assert not any("module." in k for k in keys)  # DDP's prefix never reaches the file
    assert set(load_file(tmp_path / "main.safetensors")) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.safetensors", "main.safetensors", "two.py"]


def test_single_stateful_objects_at_the_top(tmp_path: pathlib.Path) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 2)
    path = checkpoint.save(opt, tmp_path / "opt.safetensors")
    assert "state.0.exp_avg" in load_file(path)
    opt2 = torch.optim.Adam(Net().parameters())
    assert checkpoint.load_into(path, opt2) == {}
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(CheckpointError, match="into= must be"):
        checkpoint.load_into(path, 42)  # type: ignore[arg-type]


def test_save_and_load_work_without_numpy(tmp_path: pathlib.Path) -> None:
    """NumPy is not a dependency of distfn (nor of torch's CPU wheel): writing must not need it."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["numpy"] = None  # any `import numpy` now fails, as on a machine without it
        import torch
        from torch import nn
        from safetensors.torch import load_file
        from distfn import checkpoint
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        strided = torch.randn(6, 5).t()[1:]  # a non-contiguous view: written through a temporary copy
        path = checkpoint.save({{"model": model, "strided": strided, "step": 2}}, {str(tmp_path / "n.safetensors")!r})
        back = load_file(str(path))
        assert torch.equal(back["strided"], strided) and torch.equal(back["model.1.weight"], model[1].weight)
        assert torch.equal(checkpoint.load(path)["model.0.bias"], model[0].bias)
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_distfn_checkpoint_is_an_attribute_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    """`import distfn; distfn.checkpoint.load(...)` as the docs write it, with nothing else imported (issue 17)."""
    path = checkpoint.save({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    code = f"import distfn; print(distfn.checkpoint.load({str(path)!r})['w'].tolist())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=repo_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[1.0, 1.0]"


def test_top_level_load_and_latest_take_prefixes(tmp_path: pathlib.Path) -> None:
    """distfn.load / distfn.latest are as capable as the module's functions (issue 18 item 5)."""
    import distfn

    model = Net()
    path = checkpoint.save({"model": model, "step": 3}, tmp_path / "snapshot-3.safetensors")
    equal_state(distfn.load(path, prefix="model"), model.state_dict())
    assert distfn.load(path, "cpu", prefix="model.").keys() == model.state_dict().keys()
    assert distfn.latest(tmp_path, prefix="snapshot-") == path
    assert distfn.latest is checkpoint.latest and distfn.load is checkpoint.load


@pytest.mark.parametrize("url", ["gs://b/ckpt-1.safetensors", "https://example.com/ckpt-1.safetensors",
                                 "hdfs://nn/x/ckpt-1.safetensors"])
def test_urls_are_never_written_locally(tmp_path: pathlib.Path, monkeypatch, url: str) -> None:
    """A remote URL used to be written to ./s3:/bucket/... and then 'found' by latest (issue 18 item 6). URLs now go
    to fsspec (issue 28: tests/test_remote.py); one whose library is missing, or a store that cannot hold
    checkpoints, is a clear error, and nothing is ever written locally."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot (open|use)"):
        checkpoint.save({"w": torch.ones(1)}, url)
    with pytest.raises(CheckpointError, match=r"cannot (open|use)"):
        checkpoint.load(url)
    with pytest.raises(CheckpointError, match=r"cannot (open|use)"):
        checkpoint.load_into(url, {})
    with pytest.raises(CheckpointError, match=r"cannot (open|use)"):
        checkpoint.latest(url.rsplit("/", 1)[0])
    with pytest.raises(CheckpointError, match=r"cannot (open|use)"):
        checkpoint.read_metadata(url)
    assert list(tmp_path.iterdir()) == []  # nothing was written locally
