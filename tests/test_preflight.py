"""Checks before any worker starts (distfn.preflight): the start-method choice and its fork-safety probe, the
picklability of what spawn sends, and an explicit rendezvous port that is already taken."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import distfn
from distfn import ConfigError, distributed, preflight


# -- fork safety on CUDA builds (faked: the child of the probe inherits the patched functions) -----------------
def test_fork_refused_after_a_cuda_driver_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)  # NVML counted them (no driver call)
    monkeypatch.setattr(preflight, "BASELINE_THREADS", preflight.thread_ids())
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # what a child sees after is_available()
    method, reason = preflight.choose_start_method("auto")
    assert method == "forkserver" and "torch.cuda.is_available()" in reason and "device_count" in reason
    with pytest.raises(distfn.ConfigError, match="start_method='fork' cannot work here"):
        preflight.choose_start_method("fork")
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)  # only NVML was asked: fork is fine
    assert preflight.choose_start_method("auto")[0] == "fork"
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no GPU: nothing for the mark to break
    assert preflight.choose_start_method("auto")[0] == "fork"


def test_busy_explicit_port_is_refused_before_any_worker() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        f = distributed(nprocs=2, init_method=f"tcp://127.0.0.1:{port}")(_plain)
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            f()
        assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert f"127.0.0.1:{port} is already in use" in msg and "Leave init_method unset" in msg



def test_port_of_another_host_is_not_checked() -> None:
    preflight.check_port_free("tcp://192.0.2.1:29500")  # another host's address: not ours to check


def _plain(cfg, ctx):
    return cfg


_plain_job = distributed(nprocs=2, start_method="spawn")(_plain)


@distributed(nprocs=2, start_method="spawn")
def _decorated(cfg, ctx):
    return cfg


def test_spawn_sends_whichever_of_wrapper_and_function_pickle_can_find() -> None:
    # `job = distributed(...)(fn)`: the module-level name is the bare function, the wrapper cannot be pickled
    assert preflight.sendable(_plain_job) is _plain
    # `@distributed`: the name is the wrapper
    assert preflight.sendable(_decorated) is _decorated
    preflight.check_picklable(preflight.sendable(_plain_job), {"lr": 0.1}, "spawn")


_POOL_FIRST = """
import torch
x = torch.randn(1000, 1000)
x @ x @ x  # an OpenMP pool is running before distfn is imported
from distfn import distributed, preflight


@distributed(nprocs=2, backend="gloo")
def job(cfg, ctx):
    torch.set_num_threads(2)  # a parallel op in the rank: where a forked copy of that pool hangs
    a = torch.ones(512, 512)
    return float((a @ a).sum()) + ctx.all_reduce(float(ctx.rank), op="sum")

if __name__ == "__main__":
    print("METHOD", preflight._pool_before_import(), flush=True)  # the verdict decoration was given (kept)
    print("RESULT", job(None), flush=True)
"""


def test_a_torch_op_before_import_distfn_does_not_hang_forked_workers(tmp_path) -> None:
    """The thread baseline is taken at ``import distfn``: an OpenMP pool started before it looked like torch's
    own threads, the workers were forked from it and hung at their first parallel op (reproduced)."""
    import subprocess
    import sys

    from conftest import clean_env

    script = tmp_path / "pool_first.py"
    script.write_text(_POOL_FIRST)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("METHOD", "RESULT")))
    assert "before `import distfn`" in lines["METHOD"]
    assert float(lines["RESULT"]) == 512.0 ** 3 + 1.0  # rank 0's matmul sum + the ranks' sum 0 + 1


def test_a_clean_process_still_forks() -> None:
    method, why = preflight.choose_start_method("auto")
    assert method == "fork" or "thread" in why or "CUDA" in why  # this test process may have run torch ops
