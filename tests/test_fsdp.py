"""mode="fsdp": options and wrap policy (pure), then one 2-rank CPU/gloo script run checked from several sides:
sharding really happens, losses match DDP, the full file loads into a bare model, resume from fsdp and ddp
files, and ctx.save on rank 0 only is reported as an error instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from distfn import ConfigError, distributed
from distfn.fsdp import FsdpOptions, MixedPrecision, parse_options, plan_units, required_backend
from distfn.options import Options

from conftest import SCRIPTS, run_python

JOB = SCRIPTS / "fsdp_job.py"


# -- options (validated at decoration time) ------------------------------------------------------------------
def test_unknown_option_is_a_decoration_time_error_naming_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        distributed(mode="fsdp", fsdp={"min_param": 10, "offload": True})
    msg = str(err.value)
    assert "'min_param'" in msg and "'offload'" in msg
    for key in ("min_params", "module_classes", "mixed_precision", "cpu_offload", "reshard_after_forward",
                "save_timeout"):
        assert key in msg
    with pytest.raises(ConfigError, match="mode='ddp'"):
        distributed(mode="ddp", fsdp={"min_params": 10})
    for bad in ({"min_params": 0}, {"min_params": "big"}, {"module_classes": [int]}, {"save_timeout": -1},
                {"mixed_precision": "int8"}, {"mixed_precision": {"param": "bf16"}}, {"cpu_offload": "yes"},
                {"reshard_after_forward": 0}):
        with pytest.raises(ConfigError):
            Options(mode="fsdp", fsdp=bad)


def test_option_forms_pass_through() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    opts = Options(mode="fsdp", fsdp={"min_params": 1e4, "mixed_precision": "bf16", "cpu_offload": True}).fsdp
    assert opts.min_params == 10_000
    assert opts.mixed_precision == MixedPrecision(torch.bfloat16, torch.float32)
    assert opts.cpu_offload and opts.pin_memory
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    opts = parse_options({"mixed_precision": policy, "cpu_offload": CPUOffloadPolicy(pin_memory=False)})
    kwargs = opts.fully_shard_kwargs(torch.device("cpu"))
    assert kwargs["mp_policy"] == policy
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy) and not kwargs["offload_policy"].pin_memory
    # ctx.wrap(model, **overrides) goes through the same validation on top of the decorator's options
    assert parse_options(opts, min_params=7).min_params == 7 and parse_options(opts, min_params=7).cpu_offload
    with pytest.raises(ConfigError, match="valid keys"):
        parse_options(opts, find_unused_parameters=True)
    assert Options(mode="fsdp").fsdp is None and parse_options(None) is None


def test_cpu_offload_on_gpus_gets_gloo_beside_nccl() -> None:
    # Offloaded gradients are CPU tensors: clipping and fp16 scaling all-reduce them, which NCCL alone cannot.
    offload = parse_options({"cpu_offload": True})
    for backend in ("nccl", "NCCL", "cuda:nccl"):
        assert required_backend(offload, backend) == "cuda:nccl,cpu:gloo"
    for backend in ("gloo", "cuda:nccl,cpu:gloo"):
        assert required_backend(offload, backend) == backend
    assert required_backend(parse_options({"min_params": 5}), "nccl") == "nccl"
    assert required_backend(None, "nccl") == "nccl"


def test_the_worker_starts_an_offloading_gpu_run_with_the_per_device_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from distfn import devices, rendezvous, worker
    from distfn.topology import Topology

    chosen: list[str] = []

    class Stop(Exception):
        pass

    def init_process_group(topology, backend, *args, **kwargs):
        chosen.append(backend)
        raise Stop

    monkeypatch.setattr(devices, "default_backend", lambda device: "nccl")  # CUDA faked: what a GPU rank gets
    monkeypatch.setattr(rendezvous, "init_process_group", init_process_group)
    for fsdp_options, expected in (({"cpu_offload": True}, "cuda:nccl,cpu:gloo"), (None, "nccl")):
        with pytest.raises(Stop):
            worker.run(lambda cfg, ctx: None, None, Options(mode="fsdp", fsdp=fsdp_options), Topology.local())
        assert chosen.pop() == expected


# -- wrap policy (pure: no process group) ---------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)  # 1088 parameters
        self.blocks = nn.Sequential(Block(64), Block(64))  # 4160 each
        self.out = nn.Linear(64, 4)  # 260


def _names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(u)] for u in units]


def test_size_policy_is_bottom_up_and_leaves_the_rest_to_the_root() -> None:
    net = Net()
    assert _names(net, plan_units(net, FsdpOptions(min_params=1000))) == ["inp", "blocks.0.fc", "blocks.1.fc"]
    # Blocks below the threshold are gathered by the first ancestor that reaches it; small leftovers -> root.
    assert _names(net, plan_units(net, FsdpOptions(min_params=5000))) == ["blocks"]
    assert plan_units(net, FsdpOptions(min_params=10**9)) == []


def test_class_policy_by_class_or_name() -> None:
    net = Net()
    assert _names(net, plan_units(net, FsdpOptions(module_classes=(Block,)))) == ["blocks.0", "blocks.1"]
    assert _names(net, plan_units(net, FsdpOptions(module_classes=("Linear",)))) == [
        "inp", "blocks.0.fc", "blocks.1.fc", "out"]


def test_tied_weights_and_shared_modules_stay_with_an_enclosing_unit() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.body = nn.Linear(32, 32)
            self.head = nn.Linear(32, 100, bias=False)
            self.head.weight = self.emb.weight  # tied: must live in the root's unit
            shared = nn.Linear(32, 32)
            self.a = nn.Sequential(shared)
            self.b = nn.Sequential(shared)  # the same module twice

    model = Tied()
    assert _names(model, plan_units(model, FsdpOptions(min_params=100))) == ["body"]
    # A common ancestor of every use of the shared module may be a unit.
    outer = nn.Sequential(nn.Linear(4, 4), nn.Sequential(model.a, model.b))
    assert _names(outer, plan_units(outer, FsdpOptions(min_params=1000))) == ["1"]


# -- 2 ranks, CPU, gloo: one script run, checked from several sides ------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fsdp")
    done = run_python([str(JOB), str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


@pytest.mark.slow
def test_sharding_really_happens(job: tuple[dict, Path]) -> None:
    shards = job[0]["fsdp"]["shards"]
    assert len(shards) == 2
    total = shards[0]["total"]
    assert total == sum(p.numel() for p in Net().parameters())  # the job's Net has the same parameters
    assert sum(s["local"] for s in shards) == total  # every parameter lives on exactly one rank
    assert all(0.4 * total <= s["local"] <= 0.6 * total for s in shards)  # about half each
    assert all(s["dtensors"] for s in shards)
    assert shards[0]["units"] == ["", "blocks.0.fc", "blocks.1.fc", "inp"]  # min_params=1000: 3 units + root


@pytest.mark.slow
def test_losses_match_ddp_on_the_same_seed(job: tuple[dict, Path]) -> None:
    result = job[0]
    ddp, fsdp = result["ddp"]["losses"], result["fsdp"]["losses"]
    assert len(ddp) == len(fsdp) == 10
    assert fsdp[0] != fsdp[-1]  # it trained
    assert torch.allclose(torch.tensor(fsdp), torch.tensor(ddp), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_save_writes_one_full_file_that_loads_into_a_bare_model(job: tuple[dict, Path]) -> None:
    result, out = job
    assert result["fsdp"]["bare_equal"] is True  # rank 0: bare Net <- distfn.load(file) == gathered weights
    bare = Net().state_dict()
    with safe_open(str(out / "final.safetensors"), "pt") as f:  # the stock library reads it
        keys = set(f.keys())
        assert keys == set(bare) | {"scale"}
        assert all(list(f.get_slice(k).get_shape()) == list(bare[k].shape) for k in bare)
    # The training-state file has the same layout as DDP mode's: same names, full shapes, close values.
    with safe_open(str(out / "fsdp-5.safetensors"), "pt") as a, safe_open(str(out / "ddp-5.safetensors"), "pt") as b:
        names = set(a.keys())  # safe_open handles are not mappings
        assert names == set(b.keys())
        assert "optimizer.state.0.exp_avg" in names and "model.inp.weight" in names
        for k in names:
            assert torch.allclose(a.get_tensor(k), b.get_tensor(k), rtol=1e-4, atol=1e-6), k
        assert a.metadata()["distfn.tree"].count("param_groups") == 1
    assert not list(out.glob("never*")) and not list(out.glob(".*tmp"))
    with safe_open(str(out / "rng.safetensors"), "pt") as f:  # rng=True in fsdp mode: full model + RNG states
        names = set(f.keys())
        assert {f"model.{k}" for k in bare} <= names and any(k.startswith("rng.") for k in names)


@pytest.mark.slow
def test_resume_from_fsdp_and_ddp_files_continues_the_same_losses(job: tuple[dict, Path]) -> None:
    fsdp = job[0]["fsdp"]
    straight = torch.tensor(fsdp["losses"][5:])
    for name in ("fsdp-5", "ddp-5"):
        resumed = fsdp["resumed"][name]
        assert resumed["rest"] == {"step": 5}
        assert torch.allclose(torch.tensor(resumed["losses"]), straight, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
def test_save_on_rank0_only_is_an_error_not_a_hang(job: tuple[dict, Path]) -> None:
    result = job[0]
    forward, barrier = result["rank0_forward"], result["rank0_barrier"]
    # Rank 1 went on training: caught through the store at once, far below save_timeout (300 s) and the
    # collective timeout (30 min), by rank 1 itself or by rank 0, whichever looks second.
    assert forward["message"] is not None
    assert "must be called on every rank" in forward["message"] and "rank 1 went on" in forward["message"]
    assert forward["seconds"] < 60
    # that job ran with mixed_precision="bf16" and cpu_offload=True before its bad save
    assert json.loads((job[1] / "mixed.json").read_text()) == {"output": "torch.bfloat16", "params": ["torch.float32"]}
    # Rank 1 went on into ctx.barrier() (DDP mode's documented pattern): a distfn collective is a sync point too.
    assert barrier["message"] is not None and "rank 1 went on" in barrier["message"]
    assert barrier["seconds"] < 60
    # Rank 1 blocked in a raw torch.distributed barrier leaves no trace: save_timeout (1 s here) ends it.
    raw = result["rank0_raw"]
    assert raw["message"] is not None and raw["ranks"][0] == 0
    assert "must be called on every rank" in raw["message"] and "waited 1 s" in raw["message"]
    assert raw["seconds"] < 60
    # ctx.load has the same check-in: rank 0 alone would wait forever in the broadcast of the shards.
    load = result["rank0_load"]
    assert load["message"] is not None
    assert ("ctx.load in mode='fsdp' must be called on every rank" in load["message"]
            or "while another rank is in ctx.load" in load["message"])
    assert load["seconds"] < 60


# -- models built on the meta device (issue 14) --------------------------------------------------------------
@pytest.mark.slow
def test_a_meta_model_is_sharded_then_materialised_and_initialised(tmp_path: Path) -> None:
    done = run_python([str(SCRIPTS / "fsdp_meta_job.py"), str(tmp_path)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "meta.json").read_text())
    init = {k: torch.tensor(v) for k, v in result["init"].items()}
    assert set(init) == set(result["names"])
    # every parameter and buffer holds what reset_parameters() gives, not uninitialised memory
    for name, fan_in in (("a", 16), ("b", 32)):
        bound = 1 / fan_in**0.5
        for kind in ("weight", "bias"):
            t = init[f"{name}.{kind}"]
            assert t.abs().max() <= bound and (t.numel() < 8 or t.std() > bound / 4), name  # b.bias: 4 draws
    assert torch.isfinite(init["emb.weight"]).all() and 0.5 < init["emb.weight"].std() < 1.5
    for ones in ("norm.weight", "bn.weight", "bn.running_var"):
        assert torch.equal(init[ones], torch.ones(32)), ones
    for zeros in ("norm.bias", "bn.bias", "bn.running_mean", "bn.num_batches_tracked"):
        assert not init[zeros].any(), zeros
    # the two ranks' shards of a weight are drawn independently (not the same values twice)
    assert init["a.weight"][:16].tolist() != init["a.weight"][16:].tolist()
    assert len(result["local_a"]) == 16  # this rank held only its half
    # ... and together they are exactly what one process seeded alike draws (world-size independent)
    assert result["init_is_single_process"]
    # rank's device a GPU, shards offloaded to the CPU (issue 42, finding 1): distinct rows, a single process's values
    assert result["offload_local_rows"] == 32 and result["offload_local_device"] == "cpu"
    assert result["offload_rows_differ"] and result["offload_is_single_process"]
    # from the same checkpoint, a meta-built and a CPU-built model train to identical weights
    assert result["trained"] and result["trained_equal"]


def test_a_meta_model_outside_fsdp_is_an_error_saying_how_to_materialise() -> None:
    @distributed(mode="ddp", nprocs=1)
    def job(cfg, ctx):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        with pytest.raises(ConfigError, match=r"meta device.*to_empty\(device=ctx\.device\).*reset_parameters"):
            ctx.wrap(model)
        with pytest.raises(ConfigError, match="init="):
            ctx.wrap(nn.Linear(4, 4), init=lambda m: None)
        return True

    assert job()


def test_a_meta_model_without_reset_parameters_needs_init() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    @distributed(mode="fsdp", nprocs=1)
    def job(cfg, ctx):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), Scale())
        with pytest.raises(ConfigError, match=r"'1' hold\(s\) parameters.*init=fn"):
            ctx.wrap(model)

        def init(m: nn.Module) -> None:
            m[0].reset_parameters()
            m[1].gain.fill_(2.0)

        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), Scale())
        wrapped = ctx.wrap(model, init=init)
        return wrapped[1].gain.full_tensor().tolist()

    assert job() == [2.0] * 4


# -- timings under FSDP2 (issue 42, finding 2) ---------------------------------------------------------------------
class _Spin(nn.Module):
    """One FSDP unit (the root); ``spin`` seconds of extra compute in forward on the slow rank."""

    def __init__(self, spin: float) -> None:
        super().__init__()
        self.spin = spin
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        end = time.perf_counter() + self.spin
        while time.perf_counter() < end:
            pass
        return self.body(x)


@pytest.mark.slow
def test_the_fsdp_end_of_backward_wait_counts_as_comm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 computes 40 ms more per step; rank 0 then waits in FSDP's end-of-backward callback (the root group's
    # reduce-scatter on gloo; the wait on its event on GPUs), which runs before any callback of distfn's own.
    monkeypatch.setenv("DISTFN_TIMINGS_WINDOW", "4")

    @distributed(mode="fsdp", nprocs=2, seed=0, fsdp={"min_params": 10**9})
    def job(cfg, ctx):
        model = ctx.wrap(_Spin(0.04 if ctx.rank == 1 else 0.0))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(9):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        table = ctx.timings(whole_run=True)
        return None if table is None else [(r.rank, r.comm.mean, r.compute.mean) for r in table.ranks]

    rows = {rank: (comm, compute) for rank, comm, compute in job()}
    assert rows[0][0] >= 0.025, rows  # rank 0's wait for rank 1 is comm ...
    assert rows[0][1] < 0.02, rows  # ... not compute
    assert rows[1][1] >= 0.035 and rows[1][0] < rows[0][0], rows
