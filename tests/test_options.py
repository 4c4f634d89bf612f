"""The arguments of @distributed (distfn.options): every one is checked on construction with a ConfigError
naming the fix, the mode properties, and the process-count rule (nprocs=, DISTFN_NPROCS, devices=, GPUs)."""

from __future__ import annotations

import datetime

import pytest

from distfn import ConfigError
from distfn.options import Options, default_nprocs, make_options, requested_nprocs, restart_attempt, with_env


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "fancy"}, "valid modes are: 'ddp'"),
        ({"nprocs": 0}, "nprocs=0 must be at least 1"),
        ({"nprocs": "2"}, "nprocs must be a positive int"),
        ({"nprocs": True}, "nprocs must be a positive int"),
        ({"nprocs": 2.0}, "nprocs must be a positive int"),
        ({"backend": "bogus"}, "'bogus' is not a torch.distributed backend"),
        ({"seed": -1}, "seed must be a non-negative int"),
        ({"timeout": -5}, "timeout must be positive"),
        ({"timeout": "10s"}, "timeout must be seconds"),
        ({"devices": "0,x"}, "'x' is not a GPU index"),
        ({"devices": [1, 1]}, "names a GPU twice"),
        ({"devices": [-1]}, "GPU indices are >= 0"),
        ({"devices": ""}, "names no GPU"),
        ({"start_method": "teleport"}, "start_method='teleport' is not valid"),
        ({"launcher": "pbs"}, "launcher='pbs' is not valid"),
        ({"init_method": "http://x"}, "must start with env://, tcp:// or file://"),
        ({"mode": "single", "nprocs": 2}, "runs one process"),
        ({"mode": "dp", "nprocs": 4}, "runs one process"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        Options(**kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)  # catchable as the standard type too


def test_mode_properties() -> None:
    assert [Options(mode=m).one_process for m in ("single", "dp", "ddp", "fsdp")] == [True, True, False, False]
    assert [Options(mode=m).multi_rank for m in ("single", "dp", "ddp", "fsdp")] == [False, False, True, True]


def test_process_count_rule() -> None:
    def no_gpus() -> int:
        raise AssertionError("asked for the GPU count although the rule did not need it")

    assert requested_nprocs(Options(nprocs=3), {}) == 3
    assert requested_nprocs(Options(nprocs=3), {"DISTFN_NPROCS": " 4 "}) == 4  # the environment wins
    assert requested_nprocs(Options(), {"DISTFN_NPROCS": ""}) is None
    assert default_nprocs(Options(nprocs=3), {}, no_gpus) == 3
    assert default_nprocs(Options(mode="dp"), {}, no_gpus) == 1
    assert default_nprocs(Options(devices="0,5"), {}, no_gpus) == 2
    assert default_nprocs(Options(), {}, lambda: 0) == 1  # no GPU: one process
    assert default_nprocs(Options(), {}, lambda: 4) == 4
    with pytest.raises(ConfigError, match="DISTFN_NPROCS='two' is not an integer"):
        requested_nprocs(Options(), {"DISTFN_NPROCS": "two"})
    with pytest.raises(ConfigError, match="DISTFN_NPROCS=2 but mode='single' runs one process"):
        default_nprocs(Options(mode="single"), {"DISTFN_NPROCS": "2"}, no_gpus)


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("NCCL", "nccl"),
        (" Gloo ", "gloo"),
        ("cuda:nccl", "nccl"),  # torch's own device map of "nccl"
        ("CPU:gloo,CUDA:gloo", "gloo"),
        ("cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"),  # one canonical order
        ("cpu:gloo, cuda:NCCL", "cpu:gloo,cuda:nccl"),
        ("cpu:gloo", "cpu:gloo"),
    ],
)
def test_backend_is_stored_in_one_spelling(given: str, stored: str) -> None:
    """Issue 20 item 7: later tests of the backend (`== "nccl"`) must not depend on how the user typed it."""
    assert Options(backend=given).backend == stored


@pytest.mark.parametrize("bad", ["cuda:nccl,gloo", "cpu:gloo,cpu:gloo", "cuda:", ":nccl", "cuda:nccl:x"])
def test_malformed_per_device_backend_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="'device:backend' pair"):
        Options(backend=bad)


def test_environment_overrides_are_checked_like_arguments() -> None:
    opts = Options(precision="32", timeout=10)
    assert with_env(opts, {}) is opts
    got = with_env(opts, {"DISTFN_PRECISION": "bf16", "DISTFN_TIMEOUT": "2.5", "DISTFN_BACKEND": "GLOO",
                          "DISTFN_START_METHOD": " spawn", "DISTFN_PRECISION_X": "junk"})
    assert (got.precision, got.timeout, got.backend, got.start_method) == (
        "bf16", datetime.timedelta(seconds=2.5), "gloo", "spawn")
    assert with_env(opts, {"DISTFN_PRECISION": " "}) is opts  # empty: not set
    with pytest.raises(ConfigError, match=r"DISTFN_PRECISION=.fp8. \(overriding precision=\) is not valid"):
        with_env(opts, {"DISTFN_PRECISION": "fp8"})
    with pytest.raises(ConfigError, match="DISTFN_TIMEOUT='soon'"):
        with_env(opts, {"DISTFN_TIMEOUT": "soon"})


def test_changes_on_top_of_options_are_checked() -> None:
    base = Options(mode="ddp", precision="32", seed=1)
    assert make_options({"precision": 16}, base) == Options(mode="ddp", precision="16", seed=1)
    with pytest.raises(ConfigError, match="'procs' is not an option of @distributed; valid options are: mode"):
        make_options({"procs": 2}, base)
    with pytest.raises(ConfigError, match="runs one process"):
        make_options({"mode": "single"}, Options(nprocs=2))


def test_max_restarts_and_the_attempt_number() -> None:
    assert Options().max_restarts == 0 and Options(max_restarts=3).max_restarts == 3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="max_restarts must be a non-negative int"):
            Options(max_restarts=bad)
    assert with_env(Options(), {"DISTFN_MAX_RESTARTS": "2"}).max_restarts == 2
    with pytest.raises(ConfigError, match="DISTFN_MAX_RESTARTS='-1'"):
        with_env(Options(), {"DISTFN_MAX_RESTARTS": "-1"})
    assert restart_attempt({}) == 0
    assert restart_attempt({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2  # torchrun --max-restarts
    assert restart_attempt({"DISTFN_RESTART": "1", "TORCHELASTIC_RESTART_COUNT": "2"}) == 1


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"mode": "DDP"}, "(did you mean mode='ddp'?)"),
        ({"mode": "FSDP"}, "(did you mean mode='fsdp'?)"),
        ({"start_method": "Fork"}, "(did you mean start_method='fork'?)"),
        ({"launcher": "slrum"}, "(did you mean launcher='slurm'?)"),
        ({"precision": "BF16"}, "(did you mean precision='bf16'?)"),
        ({"precision": "bf16-mixed"}, "is a Lightning Fabric name, not distfn's; use one of '32', 'bf16', '16'"),
        ({"precision": "bf16-mixed"}, "(did you mean precision='bf16'?)"),
        ({"precision": "16-mixed"}, "(did you mean precision='16'?)"),
        ({"precision": "32-true"}, "(did you mean precision='32'?)"),
        ({"precision": "bf16-true"}, "(did you mean precision='bf16'?). distfn's 'bf16' is autocast with float32"),
        ({"precision": "16-true"}, "(did you mean precision='16'?)"),
        ({"nproc": 2}, "(did you mean nprocs= for nproc=?)"),
        ({"mdoe": "ddp", "nproc": 2}, "are not options of @distributed; valid options are: mode"),
        ({"mdoe": "ddp", "nproc": 2}, "(did you mean mode= for mdoe=, nprocs= for nproc=?)"),
    ],
)
def test_a_near_miss_gets_a_did_you_mean(kwargs: dict[str, object], hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_options(kwargs)
    assert hint in str(info.value)


def test_no_guess_when_nothing_is_close() -> None:
    with pytest.raises(ConfigError) as info:
        make_options({"mode": "teleport"})
    assert "did you mean" not in str(info.value)
