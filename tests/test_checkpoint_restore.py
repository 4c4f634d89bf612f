"""distfn.checkpoint.restore: load_into validates every target, then restores in place."""

from __future__ import annotations

import json
import math
import pathlib
import types

import numpy as np
import pytest
import torch
from ckpt_helpers import Net, equal_state, train
from safetensors.torch import load_file, save_file
from torch import nn

from distfn import checkpoint
from distfn.errors import CheckpointError


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_foreign_files_with_wrapper_prefixes_load(tmp_path: pathlib.Path, prefix: str) -> None:
    model = Net()
    path = tmp_path / "foreign.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    fresh = Net()
    checkpoint.load_into(path, fresh)
    equal_state(fresh.state_dict(), model.state_dict())
    # and inside a training-state mapping (keys 'model.module.fc.weight' ...)
    path2 = tmp_path / "foreign_state.safetensors"
    save_file({f"model.{prefix}{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path2))
    fresh2 = Net()
    assert checkpoint.load_into(path2, {"model": fresh2}) == {}
    equal_state(fresh2.state_dict(), model.state_dict())


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
    equal_state(fresh.state_dict(), model.state_dict())


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
    train(model, opt, 3)
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
    train(model, opt, 3, seed=5)
    train(model2, opt2, 3, seed=5)
    equal_state(model.state_dict(), model2.state_dict())


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
    equal_state(g2.state_dict(), g.state_dict())
    equal_state(d2.state_dict(), d.state_dict())
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
    with pytest.raises(CheckpointError, match=r"shape mismatch at 't'.*\[3\].*\[4\]"):
        checkpoint.load_into(path, {"t": torch.zeros(4)})


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
    equal_state(wider.state_dict(), before)  # nothing restored


def test_validation_happens_before_anything_is_restored(tmp_path: pathlib.Path) -> None:
    model, opt = Net(), None
    path = checkpoint.save({"model": model, "t": torch.ones(2)}, tmp_path / "m.safetensors")
    fresh = Net()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError):
        checkpoint.load_into(path, {"model": fresh, "t": torch.zeros(5), "opt": opt})
    equal_state(fresh.state_dict(), before)


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
    with pytest.raises(CheckpointError, match="cannot restore into list at 'model'"):
        checkpoint.load_into(path, {"model": [Net()]})  # restorable objects inside a list are not plain values


def test_plain_values_in_into_are_replaced_by_the_saved_ones(tmp_path: pathlib.Path) -> None:
    """The README's resume block: `state` holds "step": step and is passed to load as it is (issue 17)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 1)
    path = checkpoint.save({"model": model, "optimizer": opt, "step": 7, "tag": "run1", "losses": [0.5, 0.25],
                            "meta": {"epoch": 2}}, tmp_path / "ckpt-7.safetensors")
    fresh = Net()
    state = {"model": fresh, "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1), "step": 0, "tag": "",
             "losses": [], "meta": {"epoch": 0}}
    rest = checkpoint.load_into(path, state)
    assert rest["step"] == 7 and rest["tag"] == "run1" and rest["losses"] == [0.5, 0.25]
    assert state["step"] == 7 and state["tag"] == "run1" and state["losses"] == [0.5, 0.25]
    assert state["meta"] == {"epoch": 2}  # nested plain values too
    assert state["model"] is fresh  # restored in place, not replaced
    equal_state(fresh.state_dict(), model.state_dict())
    frozen = types.MappingProxyType({"model": Net(), "step": 0})  # read-only: returned only
    assert checkpoint.load_into(path, frozen, strict=False)["step"] == 7 and frozen["step"] == 0
