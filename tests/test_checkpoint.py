"""Tests of distfn.checkpoint: pure functions, no process group (multi-rank tests live with the core)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from distfn import checkpoint
from distfn.errors import CheckpointError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _equal_state(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
        assert v.dtype == b[k].dtype, k


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.bn = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, sched=None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


# ----------------------------------------------------------------------------------------------
# Modules


def test_bare_module_round_trip_has_bare_keys(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = Net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    path = checkpoint.save(model, tmp_path / "model.safetensors")
    assert path == tmp_path / "model.safetensors"
    stock = load_file(path)
    _equal_state(stock, model.state_dict())
    _equal_state(checkpoint.load(path), model.state_dict())
    fresh = Net()
    assert checkpoint.load_into(path, fresh) == {}
    _equal_state(fresh.state_dict(), model.state_dict())


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
    _equal_state(load_file(path), model.state_dict())
    target = nn.DataParallel(Net())
    checkpoint.load_into(path, target)
    _equal_state(target.module.state_dict(), model.state_dict())
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
    _equal_state(load_file(path), model.state_dict())
    target = torch.compile(Net())
    checkpoint.load_into(path, target)
    _equal_state(target._orig_mod.state_dict(), model.state_dict())


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_foreign_files_with_wrapper_prefixes_load(tmp_path: pathlib.Path, prefix: str) -> None:
    model = Net()
    path = tmp_path / "foreign.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    fresh = Net()
    checkpoint.load_into(path, fresh)
    _equal_state(fresh.state_dict(), model.state_dict())
    # and inside a training-state mapping (keys 'model.module.fc.weight' ...)
    path2 = tmp_path / "foreign_state.safetensors"
    save_file({f"model.{prefix}{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path2))
    fresh2 = Net()
    assert checkpoint.load_into(path2, {"model": fresh2}) == {}
    _equal_state(fresh2.state_dict(), model.state_dict())


def test_submodule_really_named_module_is_not_stripped(tmp_path: pathlib.Path) -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(3, 3)

    model = Holder()
    path = checkpoint.save(model, tmp_path / "h.safetensors")
    assert set(load_file(path)) == {"module.weight", "module.bias"}
    fresh = Holder()
    checkpoint.load_into(path, nn.DataParallel(fresh))
    _equal_state(fresh.state_dict(), model.state_dict())


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


def test_all_safetensors_dtypes_match_the_stock_library(tmp_path: pathlib.Path) -> None:
    state = {}
    for dtype in checkpoint._DTYPES:
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
            size = torch.empty(0, dtype=checkpoint._FROM_CODE[info["dtype"]]).element_size()
            assert info["data_offsets"][0] % size == 0, name
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["run"] == "abc"
        assert json.loads(meta["distfn.metadata"]) == {"run": "abc", "lr": 0.1}
        assert torch.equal(f.get_tensor("model.fc.weight"), model.fc.weight)
    assert checkpoint.read_metadata(path) == {"run": "abc", "lr": 0.1}


# ----------------------------------------------------------------------------------------------
# Optimizers, schedulers, scalers, training state


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    ],
    ids=["sgd-momentum", "adam", "adamw-amsgrad"],
)
def test_optimizer_state_round_trip_continues_identically(tmp_path: pathlib.Path, make_opt) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = make_opt(model.parameters())
    _train(model, opt, 3)
    path = checkpoint.save({"model": model, "optimizer": opt, "step": 3}, tmp_path / "ckpt-3.safetensors")
    names = set(load_file(path))
    assert any(n.startswith("optimizer.state.0.") for n in names)

    torch.manual_seed(1)
    model2 = Net()
    opt2 = make_opt(model2.parameters())
    rest = checkpoint.load_into(path, {"model": model2, "optimizer": opt2})
    assert rest == {"step": 3}
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    for i, s in sd1["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd2["state"][i][k])), (i, k)
    _train(model, opt, 3, seed=5)
    _train(model2, opt2, 3, seed=5)
    _equal_state(model.state_dict(), model2.state_dict())


def test_param_groups_structure_mismatch_is_reported(tmp_path: pathlib.Path) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    path = checkpoint.save({"optimizer": opt}, tmp_path / "o.safetensors")
    other = torch.optim.Adam([{"params": model.fc.parameters()}, {"params": model.out.parameters()}])
    with pytest.raises(CheckpointError, match=r"1 param group\(s\) with \[6\].*2 with \[2, 2\]"):
        checkpoint.load_into(path, {"optimizer": other})


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
            milestones=[2],
        ),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    ],
    ids=["step", "cosine", "onecycle", "lambda", "sequential", "plateau"],
)
def test_scheduler_round_trip(tmp_path: pathlib.Path, make_sched) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_sched(opt)
    for i in range(3):
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0 + i)
        else:
            sched.step()
    path = checkpoint.save({"optimizer": opt, "scheduler": sched}, tmp_path / "s.safetensors")
    opt2 = torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)
    sched2 = make_sched(opt2)
    checkpoint.load_into(path, {"optimizer": opt2, "scheduler": sched2})
    a, b = sched.state_dict(), sched2.state_dict()
    assert json.dumps(a, default=repr, sort_keys=True) == json.dumps(b, default=repr, sort_keys=True)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_grad_scaler_round_trip(tmp_path: pathlib.Path) -> None:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    except Exception as exc:  # noqa: BLE001 - older torch  # pragma: no cover
        pytest.skip(f"no CPU GradScaler: {exc}")
    if not scaler.is_enabled():  # pragma: no cover
        pytest.skip("GradScaler is disabled on CPU in this torch")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(5, 4)).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update(512.0)
    path = checkpoint.save({"scaler": scaler}, tmp_path / "g.safetensors")
    scaler2 = torch.amp.GradScaler("cpu")
    checkpoint.load_into(path, {"scaler": scaler2})
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2.get_scale() == 512.0


def test_training_state_values_and_nested_targets(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    g, d = Net(), Net(width=4)
    ema = {"fc.weight": g.fc.weight.detach().clone() * 2}
    state = {
        "models": {"g": g, "d": d},
        "ema": ema,
        "step": 1200,
        "epoch": 3,
        "best": 0.91,
        "worst": float("-inf"),
        "nan": float("nan"),
        "name": "run-1",
        "flags": [True, None, 2.5, (1, "a")],
        "hist": {1: 0.5, 2: 0.25},
        "dtype": torch.bfloat16,
        "dev": torch.device("cpu"),
        "np_scalar": np.float32(1.5),
        "array": np.arange(4, dtype=np.int16),
        "plain": torch.arange(3),
    }
    path = checkpoint.save(state, tmp_path / "ckpt-1200.safetensors")
    g2, d2 = Net(), Net(width=4)
    ema2 = {"fc.weight": torch.zeros_like(ema["fc.weight"])}
    rest = checkpoint.load_into(path, {"models": {"g": g2, "d": d2}, "ema": ema2})
    _equal_state(g2.state_dict(), g.state_dict())
    _equal_state(d2.state_dict(), d.state_dict())
    assert torch.equal(ema2["fc.weight"], ema["fc.weight"])
    assert rest["step"] == 1200 and isinstance(rest["step"], int)
    assert rest["epoch"] == 3 and rest["best"] == 0.91 and rest["name"] == "run-1"
    assert rest["worst"] == float("-inf") and math.isnan(rest["nan"])
    assert rest["flags"] == [True, None, 2.5, (1, "a")]
    assert rest["hist"] == {1: 0.5, 2: 0.25}
    assert rest["dtype"] is torch.bfloat16 and rest["dev"] == torch.device("cpu")
    assert rest["np_scalar"] == 1.5
    assert isinstance(rest["array"], np.ndarray) and rest["array"].tolist() == [0, 1, 2, 3]
    assert torch.equal(rest["plain"], torch.arange(3))
    # The flat view: every tensor under its dotted key path.
    flat = checkpoint.load(path)
    assert "models.g.fc.weight" in flat and "ema.fc.weight" in flat and "plain" in flat


def test_load_into_tensor_and_stateful_objects(tmp_path: pathlib.Path) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0
            self.buf = torch.zeros(2)

        def state_dict(self) -> dict:
            return {"n": self.n, "buf": self.buf}

        def load_state_dict(self, sd: dict) -> None:
            self.n, self.buf = sd["n"], sd["buf"]

    c = Counter()
    c.n, c.buf = 5, torch.tensor([1.0, 2.0])
    path = checkpoint.save({"c": c, "t": torch.ones(3)}, tmp_path / "c.safetensors")
    c2, t2 = Counter(), torch.zeros(3)
    assert checkpoint.load_into(path, {"c": c2, "t": t2}) == {}
    assert c2.n == 5 and torch.equal(c2.buf, c.buf) and torch.equal(t2, torch.ones(3))
    with pytest.raises(CheckpointError, match="shape mismatch at 't'.*\\[3\\].*\\[4\\]"):
        checkpoint.load_into(path, {"t": torch.zeros(4)})


# ----------------------------------------------------------------------------------------------
# Loading errors


def test_strict_reports_missing_and_unexpected_keys(tmp_path: pathlib.Path) -> None:
    path = checkpoint.save(Net(), tmp_path / "m.safetensors")

    class Other(Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"missing from the file: 'extra.weight', 'extra.bias'"):
        checkpoint.load_into(path, Other())
    fresh = Other()
    checkpoint.load_into(path, fresh, strict=False)
    assert torch.equal(fresh.fc.weight, load_file(path)["fc.weight"])

    small = nn.Sequential()
    small.fc = nn.Linear(4, 8)
    with pytest.raises(CheckpointError, match=r"unexpected in the file: .*'bn.weight'"):
        checkpoint.load_into(path, small)


def test_shape_mismatch_names_first_key_and_both_shapes(tmp_path: pathlib.Path) -> None:
    path = checkpoint.save({"model": Net(8)}, tmp_path / "m.safetensors")
    wider = Net(16)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"shape mismatch at 'model.fc.weight': the file has \[8, 4\], the "
                                              r"model has \[16, 4\]"):
        checkpoint.load_into(path, {"model": wider})
    _equal_state(wider.state_dict(), before)  # nothing restored


def test_validation_happens_before_anything_is_restored(tmp_path: pathlib.Path) -> None:
    model, opt = Net(), None
    path = checkpoint.save({"model": model, "t": torch.ones(2)}, tmp_path / "m.safetensors")
    fresh = Net()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError):
        checkpoint.load_into(path, {"model": fresh, "t": torch.zeros(5), "opt": opt})
    _equal_state(fresh.state_dict(), before)


def test_missing_entries_and_wrong_into(tmp_path: pathlib.Path) -> None:
    model = Net()
    path = checkpoint.save({"model": model, "step": 1}, tmp_path / "s.safetensors")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="no entry for 'optimizer'"):
        checkpoint.load_into(path, {"model": Net(), "optimizer": opt})
    assert checkpoint.load_into(path, {"model": Net(), "optimizer": opt}, strict=False) == {"step": 1}
    with pytest.raises(CheckpointError, match="holds a training state"):
        checkpoint.load_into(path, Net())
    bare = checkpoint.save(model, tmp_path / "bare.safetensors")
    with pytest.raises(CheckpointError, match="bare state dict; to load a module from it pass into=model"):
        checkpoint.load_into(bare, {"model": Net()})
    with pytest.raises(CheckpointError, match="cannot restore into int at 'step'"):
        checkpoint.load_into(path, {"step": 5})


@pytest.mark.parametrize("suffix", [".pt", ".bin"])
def test_pickle_files_are_refused_with_conversion(tmp_path: pathlib.Path, suffix: str) -> None:
    model = Net()
    path = tmp_path / f"model{suffix}"
    torch.save(model.state_dict(), path)
    with pytest.raises(CheckpointError, match="pickle") as info:
        checkpoint.load(path)
    message = str(info.value)
    assert "arbitrary code" in message and "weights_only=True" in message
    command = message.splitlines()[-1].strip()
    assert command.startswith("python -c ")
    # The one-line conversion really works and the result loads.
    subprocess.run(command, shell=True, check=True, env=_env(), cwd=tmp_path)
    converted = path.with_suffix(".safetensors")
    fresh = Net()
    checkpoint.load_into(converted, fresh)
    _equal_state(fresh.state_dict(), model.state_dict())
    # Legacy (non-zip) pickle files too.
    legacy = tmp_path / f"legacy{suffix}"
    torch.save(model.state_dict(), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="pickle"):
        checkpoint.load_into(legacy, Net())


def test_missing_truncated_and_garbage_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "nope.safetensors")
    path = checkpoint.save(Net(), tmp_path / "m.safetensors")
    data = path.read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        checkpoint.load(torn)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(CheckpointError):
        checkpoint.load(junk)
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.load(tmp_path)


# ----------------------------------------------------------------------------------------------
# Saving errors, atomicity, permissions, rotation


def test_unsupported_values_name_their_key_path_and_write_nothing(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"at 'extra.fn'.*function"):
        checkpoint.save({"model": Net(), "extra": {"fn": lambda x: x}}, target)
    with open(__file__) as handle, pytest.raises(CheckpointError, match=r"at 'log.1'.*TextIOWrapper"):
        checkpoint.save({"log": [1, handle]}, target)
    with pytest.raises(CheckpointError, match="same tensor name 'a.b'"):
        checkpoint.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, target)
    with pytest.raises(CheckpointError, match="meta tensor at 'm'"):
        checkpoint.save({"m": torch.empty(2, device="meta")}, target)
    with pytest.raises(CheckpointError, match="sparse_coo"):
        checkpoint.save({"s": torch.eye(2).to_sparse()}, target)
    with pytest.raises(CheckpointError, match="keep="):
        checkpoint.save(Net(), target, keep=2)  # not a step-numbered name
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_is_created(tmp_path: pathlib.Path) -> None:
    path = checkpoint.save(Net(), tmp_path / "a" / "b" / "m.safetensors")
    assert path.is_file()
    assert list(path.parent.iterdir()) == [path]


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path: pathlib.Path, monkeypatch) -> None:
    target = tmp_path / "m.safetensors"
    checkpoint.save({"v": torch.zeros(1 << 20)}, target)
    old = target.read_bytes()
    calls = {"n": 0}
    real = checkpoint._write_all

    def failing(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(checkpoint, "_write_all", failing)
    with pytest.raises(CheckpointError, match="previous file, if any, is intact"):
        checkpoint.save({"v": torch.ones(1 << 20)}, target)  # header first, then the 4 MiB tensor fails
    assert target.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002, 0o077])
def test_permissions_follow_the_umask(tmp_path: pathlib.Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        path = checkpoint.save(Net(), tmp_path / "m.safetensors")
        reference = tmp_path / "plain"
        reference.write_bytes(b"")
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~mask) == (reference.stat().st_mode & 0o777)


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


_WRITER = textwrap.dedent(
    """
    # Imports torch once, then forks one writer per line on stdin so every round is killed mid-work quickly.
    import os, sys, torch
    from distfn import checkpoint
    target, size = sys.argv[1], int(sys.argv[2])
    version = 0
    for _ in sys.stdin:
        version += 1000
        pid = os.fork()
        if pid == 0:
            try:
                v = version
                while True:
                    v += 1
                    checkpoint.save({"a": torch.full((size,), float(v)), "b": torch.full((size // 2,), -float(v)),
                                     "version": v}, target)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
    """
)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_torn_file(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "big.safetensors"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    size = 6 << 20  # 24 MiB + 12 MiB of float32 per version
    rng = random.Random(1234)
    seen: set[int] = set()
    killed_mid_write = 0
    proc = subprocess.Popen([sys.executable, str(script), str(target), str(size)], env=_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for _ in range(25):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid = int(proc.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            assert proc.stdout.readline().strip() == "reaped"
            killed_mid_write += any(p.name.endswith(".distfn-tmp") for p in tmp_path.iterdir())
            if not target.exists():
                continue  # killed before the first rename: no file at all is the "old version" here
            version = checkpoint.load_into(target, {})["version"]
            flat = checkpoint.load(target)
            assert torch.equal(flat["a"], torch.full((size,), float(version)))
            assert torch.equal(flat["b"], torch.full((size // 2,), -float(version)))
            assert load_file(target)["a"].shape == (size,)  # the stock library agrees
            seen.add(version)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert len(seen) >= 3, "too few completed saves: make the sleeps longer"
    assert killed_mid_write >= 5, "the kills never hit a save in progress: the test would prove nothing"
    # A normal save afterwards cleans up what the killed writers left.
    checkpoint.save({"a": torch.zeros(1)}, target)
    assert [p.name for p in tmp_path.iterdir() if p.name != "writer.py"] == ["big.safetensors"]


# ----------------------------------------------------------------------------------------------
# No pickle


def test_no_pickle_in_files_or_code_paths(tmp_path: pathlib.Path, monkeypatch) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 2)
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


# ----------------------------------------------------------------------------------------------
# RNG and exact resume


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


_RESUME = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    import torch
    from torch import nn
    from distfn import checkpoint

    mode, out = sys.argv[1], sys.argv[2]
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)

    def step():
        # Every step draws from torch, NumPy and Python RNGs, so all three must be restored exactly.
        x = torch.randn(16, 8) + float(np.random.rand()) + random.random()
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()

    start = 0
    if mode == "resume":
        state = checkpoint.load_into(out + ".ckpt.safetensors",
                                     {"model": model, "optimizer": opt, "scheduler": sched, "rng": checkpoint.RNG})
        start = state["step"]
    stop = 5 if mode == "first" else 10
    for _ in range(start, stop):
        step()
    if mode == "first":
        checkpoint.save({"model": model, "optimizer": opt, "scheduler": sched, "rng": checkpoint.RNG,
                         "step": stop}, out + ".ckpt.safetensors")
    else:
        checkpoint.save(model, out)
    """
)


@pytest.mark.slow
def test_resume_is_bit_for_bit(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    straight, resumed = tmp_path / "straight.safetensors", tmp_path / "resumed.safetensors"

    def run(mode: str, out: pathlib.Path) -> None:
        subprocess.run([sys.executable, str(script), mode, str(out)], check=True, env=_env(), timeout=120)

    run("straight", straight)
    run("first", resumed)
    run("resume", resumed)
    a, b = load_file(straight), load_file(resumed)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-for-bit, not allclose
    # Without the RNG state the resumed run diverges (dropout masks and data differ): the test has teeth.
    text = _RESUME.replace(', "rng": checkpoint.RNG}', "}")
    script.write_text(text)
    norng = tmp_path / "norng.safetensors"
    run("first", norng)
    run("resume", norng)
    c = load_file(norng)
    assert not all(torch.equal(a[k], c[k]) for k in a)


# ----------------------------------------------------------------------------------------------
# Internals worth pinning


def test_device_staging_copies_in_bounded_chunks(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "_WRITE_CHUNK", 64)
    t = torch.arange(100, dtype=torch.float32).reshape(10, 10).t()  # 400 bytes, non-contiguous
    staging = checkpoint._Staging()
    chunks = [bytes(c) for c in staging.chunks(t)]
    assert all(len(c) <= 64 for c in chunks)
    assert b"".join(chunks) == t.contiguous().numpy().tobytes()


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "m.safetensors"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    stale = checkpoint._tmp_name(target).name.split(".")
    stale_name = ".".join(stale[:-3] + [str(dead_pid)] + stale[-2:])
    (tmp_path / stale_name).write_bytes(b"partial")
    unrelated = tmp_path / ".other.safetensors.somehost.1.deadbeef.distfn-tmp"
    unrelated.write_bytes(b"x")
    checkpoint.save(Net(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, unrelated.name])


def test_loaded_tensors_are_independent_of_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    checkpoint.save({"w": torch.ones(1000), "v": torch.arange(10)}, path)
    loaded = checkpoint.load(path)
    loaded["w"].mul_(3)  # copy-on-write: the file is not changed
    assert torch.equal(checkpoint.load(path)["w"], torch.ones(1000))
    checkpoint.save({"w": torch.zeros(1000), "v": torch.arange(10)}, path)  # replace while still in use
    assert torch.equal(loaded["w"], torch.full((1000,), 3.0))
    assert torch.equal(checkpoint.load(path)["w"], torch.zeros(1000))
    assert loaded["w"].storage_offset() == 0 and loaded["w"].untyped_storage().nbytes() == 4000


def test_misaligned_foreign_file_loads(tmp_path: pathlib.Path) -> None:
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    raw = json.dumps(header).encode()
    data = bytes([1, 2, 3]) + np.array([1.5, -2.0], dtype="<f4").tobytes()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    stock = load_file(path)
    mine = checkpoint.load(path)
    assert torch.equal(mine["a"], stock["a"]) and torch.equal(mine["b"], torch.tensor([1.5, -2.0]))


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


def test_many_small_tensors_are_gathered_into_few_writes(tmp_path: pathlib.Path, monkeypatch) -> None:
    calls = []
    real = checkpoint._write_all
    monkeypatch.setattr(checkpoint, "_write_all", lambda fd, data: (calls.append(len(data)), real(fd, data)))
    state = {f"norm{i}.weight": torch.full((64,), float(i)) for i in range(500)}
    state["big"] = torch.ones(2 << 20)
    path = checkpoint.save(state, tmp_path / "many.safetensors")
    assert len(calls) <= 3  # small ones, then the 8 MiB tensor straight from its memory
    _equal_state(load_file(path), state)


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


def test_long_file_names_still_fit(tmp_path: pathlib.Path) -> None:
    name = "x" * 230 + ".safetensors"  # near NAME_MAX: the temporary name must not exceed it
    path = checkpoint.save(Net(), tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert set(checkpoint.load(path)) == set(Net().state_dict())


def test_load_with_prefix_gives_the_model_state_dict(tmp_path: pathlib.Path) -> None:
    model, tied = Net(), Tied()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    path = checkpoint.save({"model": model, "lm": tied, "optimizer": opt, "step": 1}, tmp_path / "s.safetensors")
    _equal_state(checkpoint.load(path, prefix="model"), model.state_dict())
    lm = checkpoint.load(path, prefix="lm.")
    assert set(lm) == {"embed.weight", "head.weight"} and lm["head.weight"] is lm["embed.weight"]
    fresh = Net()
    fresh.load_state_dict(checkpoint.load(path, prefix="model"))
    with pytest.raises(CheckpointError, match="no tensors under 'nothing'.*'lm', 'model', 'optimizer'"):
        checkpoint.load(path, prefix="nothing")


_ELASTIC = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    import distfn
    from distfn import distributed

    @distributed(mode="ddp", seed=0)
    def train(cfg, ctx):
        model = ctx.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        start = 0
        last = distfn.latest(cfg["dir"])
        if last is not None:
            start = ctx.load(last, into=state)["step"] + 1
            ctx.print(f"resumed after step {start - 1} from {os.path.basename(last)}")
        for step in range(start, cfg["steps"]):
            if step == cfg["crash_at"] and ctx.rank == 1 and not os.path.exists(cfg["marker"]):
                open(cfg["marker"], "w").close()
                os._exit(3)  # a hard crash of rank 1, once: torchrun restarts the whole group
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)  # this rank's batch of this step
            x = torch.randn(16, 8, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ctx.save({**state, "step": step}, os.path.join(cfg["dir"], f"ckpt-{step}.safetensors"), keep=2)
            ctx.barrier()  # the checkpoint is complete before any rank goes on (or crashes)
        if ctx.is_main:
            ctx.save(state, cfg["out"])

    if __name__ == "__main__":
        d, out, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
        train({"dir": d, "out": out, "steps": 8, "crash_at": crash_at, "marker": out + ".crashed"})
    """
)


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_latest_checkpoint(tmp_path: pathlib.Path) -> None:
    """torchrun --max-restarts=1, rank 1 dies once mid-training: the restarted group resumes from the newest
    checkpoint and ends bit-identical (weights, Adam moments, scheduler) to an uninterrupted run."""
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    script = tmp_path / "elastic.py"
    script.write_text(_ELASTIC)
    env = {k: v for k, v in _env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("TORCHELASTIC_", "DISTFN_", "SLURM_", "OMPI_", "PMI_"))}

    def run(name: str, crash_at: int) -> subprocess.CompletedProcess[str]:
        (tmp_path / name).mkdir()
        return subprocess.run(
            [str(torchrun), "--standalone", "--nproc_per_node=2", "--max-restarts=1", str(script),
             str(tmp_path / name), str(tmp_path / f"{name}.safetensors"), str(crash_at)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )

    crashed = run("crashed", crash_at=5)
    assert crashed.returncode == 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert (tmp_path / "crashed.safetensors.crashed").exists()  # the crash really happened
    assert "resumed after step 4 from ckpt-4.safetensors" in crashed.stdout + crashed.stderr
    straight = run("straight", crash_at=-1)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert "resumed" not in straight.stdout + straight.stderr
    a, b = load_file(tmp_path / "crashed.safetensors"), load_file(tmp_path / "straight.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert sorted(p.name for p in (tmp_path / "crashed").iterdir()) == ["ckpt-6.safetensors", "ckpt-7.safetensors"]


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
    env = {k: v for k, v in _env().items()
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
    _train(model, opt, 2)
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
