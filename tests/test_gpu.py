"""CUDA and NCCL paths on real GPUs (skipped without them): device pinning with NCCL, checkpoints of GPU
tensors through the pinned staging buffer, the fork probe after a CUDA driver call, the issue-20 cases, and the
single-GPU variants of issue 42 (two gloo ranks sharing one GPU; no timing event under CUDA graph capture).

Run them, `distfn test --gpu` and the NCCL hang measurement with one command on the first machine that has
GPUs: `bash bench/gpu_check.sh` (under 8 minutes on one GPU; results under $OUT). Each test states the GPUs it
needs and skips with a reason on fewer. The fake-CUDA counterparts that run everywhere are in
tests/test_cuda_fakes.py. Append new GPU tests below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import clean_env, run_python

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs CUDA GPUs")]

_DDP = """
import sys, torch
from torch import nn
from distfn import distributed
from safetensors.torch import load_file

@distributed(seed=0)  # one process per visible GPU, NCCL
def f(cfg, ctx):
    model = ctx.wrap(nn.Linear(8, 4))
    out = model(torch.randn(16, 8, device=ctx.device)).sum()
    out.backward()
    ctx.save(model, cfg)
    ctx.barrier()
    w = ctx.unwrap(model).weight.detach().cpu()
    return (str(ctx.device), ctx.backend, ctx.world_size, torch.equal(load_file(cfg)["weight"], w),
            ctx.all_reduce(1.0, op="sum"), next(ctx.unwrap(model).parameters()).device.type)

if __name__ == "__main__":
    print("RESULT", f(sys.argv[1]))
"""


def test_ddp_on_gpus_pins_devices_and_saves_cpu_copies(tmp_path: Path) -> None:
    script = tmp_path / "gpu_ddp.py"
    script.write_text(_DDP)
    done = run_python([str(script), str(tmp_path / "m.safetensors")], timeout=300)
    assert done.returncode == 0, done.stderr
    world = torch.cuda.device_count()
    assert f"RESULT ('cuda:0', 'nccl', {world}, True, {float(world)}, 'cuda')" in done.stdout


def test_checkpoint_round_trip_of_gpu_training_state(tmp_path: Path) -> None:
    from distfn import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    path = checkpoint.save({"model": model, "optimizer": opt, "step": 1}, tmp_path / "g.safetensors")
    assert next(model.parameters()).device.type == "cuda"  # the live model never moves
    fresh = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    values = checkpoint.load_into(path, {"model": fresh, "optimizer": fresh_opt}, device=torch.device("cuda"))
    assert values["step"] == 1
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])


def test_fork_is_refused_after_cuda_is_available(tmp_path: Path) -> None:
    script = tmp_path / "poisoned.py"
    script.write_text(
        "import torch\nfrom distfn import distributed\n"
        "torch.cuda.is_available()  # calls into the CUDA driver: forked workers could not use CUDA\n"
        "@distributed(nprocs=2, backend='gloo')\ndef f(cfg, ctx):\n"
        "    return torch.ones(1, device=ctx.device).sum().item()\n"
        "if __name__ == '__main__':\n    print('RESULT', f())\n"
    )
    done = run_python([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr
    assert "start method forkserver" in done.stderr and "CUDA driver" in done.stderr
    assert "RESULT 1.0" in done.stdout


_FSDP_WRAP_MEMORY = """
import json, sys
import torch
from torch import nn
from distfn import distributed

@distributed(mode="fsdp", nprocs=2, fsdp={"module_classes": ["Linear"]})
def f(cfg, ctx):
    with torch.device(cfg):  # "cpu", or "meta": shapes only, materialised shard by shard by ctx.wrap
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(16)])  # ~4 GiB of fp32 parameters
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats(ctx.device)
    ctx.wrap(model)
    torch.cuda.synchronize(ctx.device)
    return ctx.gather_object(torch.cuda.max_memory_allocated(ctx.device) / size)

if __name__ == "__main__":
    print("RESULT", json.dumps(f(sys.argv[1])))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("built_on", ["cpu", "meta"])
def test_fsdp_wrap_never_holds_the_whole_model_on_a_gpu(tmp_path: Path, built_on: str) -> None:
    # issue 20: ctx.wrap used to call model.to(device) before fully_shard (a full replica per GPU); issue 14: a
    # meta-built model is materialised shard by shard.
    script = tmp_path / "fsdp_memory.py"
    script.write_text(_FSDP_WRAP_MEMORY)
    done = run_python([str(script), built_on], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.split("RESULT", 1)[1].strip())
    assert len(peaks) == 2 and all(p < 0.6 for p in peaks), peaks  # about half the model (+ one unit), not all


_DP_BF16 = """
import torch
from torch import nn
from distfn import distributed

@distributed(mode="dp", precision="bf16")
def f(cfg, ctx):
    model = ctx.wrap(nn.Linear(8, 4))
    with ctx.autocast():
        out = model(torch.randn(16, 8, device=ctx.device))  # one replica per GPU, each in its own thread
    return str(out.dtype)

if __name__ == "__main__":
    print("RESULT", f())
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dp_replicas_run_in_bf16(tmp_path: Path) -> None:
    # issue 20: DataParallel's replica threads re-entered autocast without a dtype and computed in fp16.
    script = tmp_path / "dp_bf16.py"
    script.write_text(_DP_BF16)
    done = run_python([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT torch.bfloat16" in done.stdout


# -- process group and devices on real GPUs (issue 20 items 3, 4, 8 and CUDA_DEVICE_ORDER) --------------------
_FAIL_IN_FLIGHT = """
import time, torch, torch.distributed as dist
from distfn import distributed

@distributed(nprocs=2, timeout=60)
def f(cfg, ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(2**26, device=ctx.device))  # rank 1 never joins: still in flight on rank 0
        raise ValueError("boom with a collective in flight")
    time.sleep(120)

if __name__ == "__main__":
    t0 = time.monotonic()
    try:
        f()
    except Exception as exc:
        print("RAISED", type(exc).__name__, round(time.monotonic() - t0), str(exc).splitlines()[0])
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_failure_with_a_collective_in_flight_is_reported_at_once(tmp_path: Path) -> None:
    """The rank reports, then aborts its NCCL group; destroying it would wait for the watchdog (60 s here)."""
    script = tmp_path / "in_flight.py"
    script.write_text(_FAIL_IN_FLIGHT)
    done = run_python([str(script)], timeout=240)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RAISED"))
    _, kind, seconds, *_ = line.split(maxsplit=3)
    assert kind == "WorkerError" and "ValueError" in line and "boom with a collective in flight" in line, done.stderr
    assert int(seconds) < 45, line  # well before the 60 s watchdog


_BOUND = """
import warnings, torch, torch.distributed as dist
from distfn import distributed

@distributed(nprocs=1, backend="nccl")
def f(cfg, ctx):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx.barrier()
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    return str(bound), str(ctx.device), [str(w.message) for w in caught if "barrier" in str(w.message)]

if __name__ == "__main__":
    print("RESULT", f())
"""


def test_the_rank_device_is_bound_to_the_process_group(tmp_path: Path) -> None:
    """init_process_group(device_id=...): barrier() uses the rank's GPU, not global_rank % device_count."""
    script = tmp_path / "bound.py"
    script.write_text(_BOUND)
    done = run_python([str(script)], timeout=180)
    assert done.returncode == 0, done.stderr
    assert "RESULT ('cuda:0', 'cuda:0', [])" in done.stdout


_DRIVER_BEFORE_FORK = """
import ctypes, os
ctypes.CDLL("libcuda.so.1").cuInit(0)  # what CuPy, JAX or Numba do: the driver runs, torch knows nothing of it
pid = os.fork()
if pid == 0:
    from distfn.devices import select_device
    from distfn.topology import Topology
    try:
        print("DEVICE", select_device("ddp", Topology.local(), None), flush=True)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc)[:200], flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_gpus_that_a_forked_rank_cannot_use_are_an_error(tmp_path: Path) -> None:
    """A fork after another library started the CUDA driver: a clear error, not a silent CPU run."""
    script = tmp_path / "driver_before_fork.py"
    script.write_text(_DRIVER_BEFORE_FORK)
    done = run_python([str(script)], timeout=120)
    assert "ERROR DistfnError NVML sees" in done.stdout, done.stdout + done.stderr


def test_devices_follow_nvidia_smi_numbering(tmp_path: Path) -> None:
    script = tmp_path / "order.py"
    script.write_text(
        "import os\nfrom distfn import distributed\n"
        "@distributed(mode='single', devices='0')\ndef f(cfg, ctx):\n"
        "    return os.environ.get('CUDA_DEVICE_ORDER'), str(ctx.device)\n"
        "if __name__ == '__main__':\n    print('RESULT', f())\n"
    )
    env = {k: v for k, v in clean_env().items() if k != "CUDA_DEVICE_ORDER"}
    done = run_python([str(script)], env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RESULT ('PCI_BUS_ID', 'cuda:0')" in done.stdout


_FSDP_OFFLOAD_CLIP = """
import torch
from torch import nn
from distfn import distributed

@distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"cpu_offload": True, "min_params": 10})
def f(cfg, ctx):
    model = ctx.wrap(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        ctx.backward(model(torch.randn(8, 64, device=ctx.device)).pow(2).mean())
        ctx.step(opt, max_grad_norm=0.5)  # the norm of CPU gradients is all-reduced: gloo beside NCCL
    return ctx.backend, next(model.parameters()).to_local().device.type

if __name__ == "__main__":
    print("RESULT", f())
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_cpu_offload_clips_gradients_on_nccl(tmp_path: Path) -> None:
    # issue 20: with NCCL alone, clipping offloaded (CPU) gradients failed: "No backend type associated with cpu".
    script = tmp_path / "offload_clip.py"
    script.write_text(_FSDP_OFFLOAD_CLIP)
    done = run_python([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT ('cuda:nccl,cpu:gloo', 'cpu')" in done.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_hang_is_reported_before_the_watchdog_aborts() -> None:
    # issue 26 item 4: under NCCL the group's timeout is distfn's + 15 s, and the rank's responder reports the
    # ctx.barrier still open after distfn's 10 s from its own thread, before the watchdog aborts the rank
    job = Path(__file__).resolve().parent / "scripts" / "hang_job.py"
    done = run_python([str(job), "sleep", "10"], timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "did not finish within the timeout of 10 s (distfn's deadline" in done.stderr, done.stderr[-3000:]
    assert "Rank 1 had not reached a collective: rank 1 was in sleepy" in done.stderr
    assert "SIGABRT" not in done.stderr.split("other rank(s) failed after it")[0]


# -- single-GPU variants (issue 42): two ranks sharing one GPU over gloo, CUDA graphs -----------------------------
# Two NCCL ranks cannot share a GPU ("Duplicate GPU detected"); gloo takes CUDA tensors, so two gloo ranks on cuda:0
# check the multi-rank paths that do not need NCCL. The NCCL hang itself is measured on one GPU by
# `bench/bench_gpu.py --gpu --only hang` (a world-1 NCCL job held up with torch.cuda._sleep).
_SHARED_GPU = """
import json, sys, threading, traceback
import torch
from torch import nn
from distfn import distributed

@distributed(mode="ddp", nprocs=2, backend="gloo", seed=0)
def f(cfg, ctx):
    out = {"device": str(ctx.device)}

    def part(name, fn):
        try:
            out[name] = fn()
        except Exception:
            out[name] = "ERROR " + traceback.format_exc()[-1500:]

    def meta_offload():
        # finding 1: the rank's device is a GPU, the shards live on the CPU (cpu_offload)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        from distfn import fsdp
        with torch.device("meta"):
            lin = nn.Linear(64, 256, bias=False)
        fully_shard(lin, mesh=init_device_mesh("cuda", (2,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
        state = torch.random.get_rng_state()
        fsdp.materialize(lin, ctx.device, offload=True)
        local = lin.weight.to_local()
        rows = ctx.gather_object(local.detach().cpu())
        torch.random.set_rng_state(state)
        single = nn.Linear(64, 256, bias=False).weight.detach()
        whole = torch.cat(rows)
        return {"local_device": str(local.device), "rows_differ": not torch.equal(rows[0], rows[1]),
                "single_process": torch.equal(whole, single)}

    def saves():
        # finding 4's control on one GPU: copies from GPU memory the GPU is still writing, from the main thread
        # (ctx.save) and from another thread (the host buffers), come out whole
        from distfn.checkpoint.background import HostBuffers
        x = torch.empty(2**24, device=ctx.device)
        torch.cuda._sleep(2 * 10**9)  # ~1 s of GPU work before the fill
        x.fill_(7.0)
        got = []
        def copy():
            buffers = HostBuffers()
            buffers.begin()
            y = torch.empty(2**24, device=ctx.device)
            torch.cuda._sleep(2 * 10**9)
            y.fill_(5.0)
            got.append(buffers.copy(y))
            buffers.end()
        worker = threading.Thread(target=copy)
        worker.start()
        worker.join()
        ctx.save({"x": x}, cfg + "/async.safetensors", blocking=False)
        ctx.saves.wait()
        ctx.barrier()  # rank 0 wrote it
        from safetensors.torch import load_file
        saved = load_file(cfg + "/async.safetensors")["x"]
        return {"async_save_whole": bool((saved == 7).all()), "thread_copy_whole": bool((got[0] == 5).all()),
                "pinned": got[0].is_pinned()}

    def timed():
        # CUDA-event timings over gloo: rank 1 computes 50 ms more per step; rank 0's wait is comm
        class Slow(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(32, 32)
            def forward(self, x):
                if ctx.rank == 1:
                    torch.cuda._sleep(10**8)  # ~50 ms of GPU time
                return self.lin(x)
        model = ctx.wrap(Slow())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(12):
            model(torch.randn(8, 32, device=ctx.device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        table = ctx.timings(whole_run=True)
        return None if table is None else {r.rank: [r.steps, r.comm.mean, r.step.mean] for r in table.ranks}

    part("meta_offload", meta_offload)
    part("saves", saves)
    part("timings", timed)
    return out

if __name__ == "__main__":
    print("RESULT", json.dumps(f(sys.argv[1])))
"""


def test_two_gloo_ranks_sharing_one_gpu(tmp_path: Path) -> None:
    script = tmp_path / "shared_gpu.py"
    script.write_text(_SHARED_GPU)
    done = run_python([str(script), str(tmp_path)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT", 1)[1].strip())
    assert out["device"] == "cuda:0", out
    # finding 1: distinct rows on the two ranks, together a single process's init
    assert out["meta_offload"] == {"local_device": "cpu", "rows_differ": True, "single_process": True}, out
    # finding 4 (control): asynchronous copies of GPU memory still being written come out whole
    assert out["saves"] == {"async_save_whole": True, "thread_copy_whole": True, "pinned": True}, out
    timings = out["timings"]
    assert isinstance(timings, dict), timings
    (steps0, comm0, step0), (steps1, comm1, _) = timings["0"], timings["1"]
    assert steps0 >= 10 and steps1 >= 10 and step0 > 0.03, timings
    assert comm0 > 0.02 and comm0 > comm1, timings  # rank 0 waits for rank 1's 50 ms


def test_no_timing_event_is_recorded_while_a_cuda_graph_is_captured() -> None:
    # issue 42 (minor): a training forward captured into a CUDA graph records no timing event
    from distfn import timings

    class Counting(timings.CudaClock):
        marks = 0

        def mark(self):  # type: ignore[no-untyped-def]
            Counting.marks += 1
            return super().mark()

    run = timings.Timings(enabled=True, window=100)
    recorder = run.start(0, 1, None, Counting())
    model = nn.Linear(8, 8).cuda()
    timings._ModelHooks(recorder).install(model, bracket=True)
    x = torch.randn(4, 8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    before = Counting.marks
    assert before >= 3  # the warm-up forwards were timed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = model(x)
    assert Counting.marks == before
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    model(x)  # outside the capture again: timed
    assert Counting.marks > before
