"""@distributed's contract in one process: validation at decoration time, clear call-time errors before any
worker starts, and the one-process modes (single, dp, ddp with nprocs=1) run in place."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import distfn
from distfn import ConfigError, Context, NestedLaunchError, distributed

from conftest import run_python


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "DISTFN_NPROCS") or \
                k.startswith(("SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(k)


def _fn(cfg, ctx):
    return cfg


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        # every argument's own check is in tests/test_options.py; here: they run at decoration time
        ({"mode": "fancy"}, "valid modes are: 'ddp'"),
        ({"mode": "single", "nprocs": 2}, "runs one process"),
    ],
)
def test_bad_arguments_fail_at_decoration_time(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        distributed(**kwargs)(_fn)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)  # catchable as the standard type too


def test_function_must_take_cfg_and_ctx() -> None:
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(cfg, ctx\)"):
        distributed(lambda ctx: None)
    with pytest.raises(ConfigError, match="decorates a function"):
        distributed(mode="single")(42)
    distributed(mode="single")(lambda cfg, ctx, extra=1: None)  # extra defaulted params are fine


def test_wraps_metadata_and_bare_form() -> None:
    def train(cfg, ctx):
        """Docstring kept."""
        return (cfg, ctx.world_size, ctx.launcher, type(ctx).__name__)

    bare = distributed(train)
    assert bare.__name__ == "train" and bare.__doc__ == "Docstring kept." and bare.__wrapped__ is train
    # Bare @distributed on a machine without GPUs: one process, run in place with a world of one.
    assert bare(5) == (5, 1, "local", "Context")
    assert distributed()(train)() == (None, 1, "local", "Context")


def test_timeout_accepts_seconds_and_timedelta() -> None:
    assert distributed(timeout=12)(_fn).distfn_options.timeout == datetime.timedelta(seconds=12)
    td = datetime.timedelta(minutes=2)
    assert distributed(timeout=td)(_fn).distfn_options.timeout == td
    assert distributed(_fn).distfn_options.timeout == datetime.timedelta(minutes=30)


def test_single_mode_runs_in_place_with_identity_collectives() -> None:
    @distributed(mode="single", seed=3)
    def f(cfg, ctx: Context):
        first = torch.rand(1).item()
        model = ctx.wrap(nn.Linear(3, 2))
        sampler = ctx.sampler(list(range(10)), shuffle=False)
        return {
            "wrapped": type(model).__name__, "device": str(ctx.device), "backend": ctx.backend,
            "sum": ctx.all_reduce(4.0, op="sum"), "tensor": ctx.all_reduce(torch.tensor([1, 3]), op="mean"),
            "gather": ctx.gather_object("x"), "bcast": ctx.broadcast_object(9), "indices": list(sampler),
            "main": ctx.is_main, "distributed": ctx.distributed, "first": first,
        }

    out = f()
    assert out["wrapped"] == "Linear" and out["device"] == "cpu" and out["backend"] is None
    assert out["sum"] == 4.0 and torch.equal(out["tensor"], torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert out["gather"] == ["x"] and out["bcast"] == 9 and out["indices"] == list(range(10))
    assert out["main"] and not out["distributed"]
    torch.manual_seed(3)
    assert out["first"] == torch.rand(1).item()  # seeded before the function ran


def test_dp_mode_wraps_in_data_parallel_and_runs_on_cpu() -> None:
    @distributed(mode="dp")
    def f(cfg, ctx):
        model = ctx.wrap(nn.Linear(3, 1))
        y = model(torch.ones(4, 3))
        return type(model).__name__, type(ctx.unwrap(model)).__name__, tuple(y.shape)

    assert f() == ("DataParallel", "Linear", (4, 1))


def test_ddp_with_one_process_runs_in_place_with_a_real_group(tmp_path: Path) -> None:
    @distributed(mode="ddp", nprocs=1)
    def f(cfg, ctx):
        model = ctx.wrap(nn.Linear(2, 2))
        ctx.save(model, tmp_path / "m.safetensors")
        return type(model).__name__, ctx.distributed, ctx.backend, ctx.all_reduce(2.5)

    assert f() == ("DistributedDataParallel", True, "gloo", 2.5)
    assert not torch.distributed.is_initialized()  # destroyed after the call
    assert sorted(distfn.load(tmp_path / "m.safetensors")) == ["bias", "weight"]


def test_process_group_destroyed_when_the_function_raises() -> None:
    @distributed(nprocs=1)
    def f(cfg, ctx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        f()
    assert not torch.distributed.is_initialized()


def test_passing_ctx_yourself_is_refused() -> None:
    f = distributed(mode="single")(_fn)
    with pytest.raises(ConfigError, match="distfn creates and passes ctx itself"):
        f(1, 2)
    with pytest.raises(ConfigError, match="takes one argument"):
        f(cfg=1)


def test_nested_launch_is_refused() -> None:
    inner = distributed(mode="single")(_fn)

    @distributed(mode="single")
    def outer(cfg, ctx):
        return inner(1)

    with pytest.raises(NestedLaunchError, match="inside a running distfn worker"):
        outer()


def test_call_time_errors_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only messages")
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        distributed(devices="0,5")(_fn)()
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        distributed(backend="nccl")(_fn)()
    monkeypatch.setenv("DISTFN_NPROCS", "two")
    with pytest.raises(ConfigError, match="DISTFN_NPROCS='two' is not an integer"):
        distributed(_fn)()


@distributed(nprocs=2, start_method="spawn")
def spawned(cfg, ctx):
    return cfg


def test_unpicklable_cfg_is_named_before_spawning() -> None:
    f = spawned
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        f({"lr": 0.1, "fn": lambda x: x})
    msg = str(info.value)
    assert "cfg['fn']" in msg and "a lambda defined at" in msg and "module level" in msg
    with pytest.raises(ConfigError, match=r"cfg\['log'\] \(an open file object"):
        f({"log": open(__file__)})
    assert time.monotonic() - t0 < 5  # refused up front, no worker was started


def test_local_function_is_refused_under_spawn() -> None:
    def local(cfg, ctx):
        return 1

    with pytest.raises(ConfigError, match="cannot be pickled"):
        distributed(nprocs=2, start_method="spawn")(local)()


def test_script_without_main_guard_is_explained(tmp_path: Path) -> None:
    script = tmp_path / "noguard.py"
    script.write_text(
        "from distfn import distributed\n"
        "@distributed(nprocs=2)\ndef f(cfg, ctx):\n    return ctx.rank\n"
        "print(f())\n"
    )
    done = run_python([str(script)], timeout=60)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "line 5" in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")
def test_devices_map_through_cuda_visible_devices_on_gpu(tmp_path: Path) -> None:
    script = tmp_path / "dev.py"
    script.write_text(
        "import os, torch\nfrom distfn import distributed\n"
        "@distributed(devices='0')\ndef f(cfg, ctx):\n"
        "    return os.environ['CUDA_VISIBLE_DEVICES'], str(ctx.device), ctx.backend\n"
        "if __name__ == '__main__':\n    print('RESULT', f())\n"
    )
    done = run_python([str(script)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RESULT ('0', 'cuda:0', 'nccl')" in done.stdout


def test_options_per_call_returns_a_checked_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    @distributed(mode="single", precision="32")
    def f(cfg, ctx):
        return ctx.precision

    bf16 = f.options(precision="bf16")
    assert bf16() == "bf16" and f() == "32"  # the original is unchanged
    assert bf16.distfn_options.precision == "bf16" and bf16.__wrapped__ is f.__wrapped__
    assert bf16.options(seed=3).distfn_options.precision == "bf16"  # changes stack
    with pytest.raises(ConfigError, match="precision='fp8' is not valid"):
        f.options(precision="fp8")
    with pytest.raises(ConfigError, match="'procs' is not an option"):
        f.options(procs=2)
    monkeypatch.setenv("DISTFN_PRECISION", "16")
    assert f() == "16" and bf16() == "16"  # the environment has the last word


def test_max_restarts_in_place_says_it_has_no_effect() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        assert distributed(mode="single", max_restarts=2)(_fn)(7) == 7
    finally:
        logger.remove(sink)
    assert any("max_restarts=2 has no effect here: one process runs in place" in line for line in lines)


def test_a_mode_passed_as_the_function_says_how_to_write_it() -> None:
    with pytest.raises(ConfigError, match=r"got the string 'ddp': write @distributed\(mode='ddp'\)"):
        distributed("ddp")  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match=r"options are keywords, e\.g\. @distributed\(mode='ddp'\)"):
        distributed("fast")  # type: ignore[call-overload]


def test_the_fork_server_is_started_early_by_the_plans_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40 item 6: "may this launch use the fork server" is asked once, of the plan's options, so
    ``DISTFN_START_METHOD=forkserver`` over a decorator's ``start_method="spawn"`` starts the server early too
    (the decorator's own value used to end the question first), and ``spawn`` alone does not."""
    import sys

    from distfn import decorator
    from distfn.launch import forkserver

    if sys.platform != "linux":
        pytest.skip("the fork server is Linux only")
    started: list[bool] = []
    monkeypatch.setattr(forkserver, "start_early", lambda idle=False: started.append(True))
    distributed(mode="ddp", nprocs=2, start_method="spawn")(_fn)
    assert started == []
    monkeypatch.setenv("DISTFN_START_METHOD", "forkserver")
    distributed(mode="ddp", nprocs=2, start_method="spawn")(_fn)
    assert started == [True]
    assert decorator._forkserver_expected("auto") and not decorator._forkserver_expected("fork")
