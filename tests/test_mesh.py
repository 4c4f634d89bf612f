"""2-D parallelism (issue 45): the ``mesh=`` option, the layout of ranks on it, the tensor-parallel plan's checks,
and, at 4 gloo ranks, HSDP and TP x DP against hand-written references and the checkpoint reshard matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from s3server import S3Server, needs_s3, s3, s3_module
from safetensors import safe_open
from torch import nn

from distfn import ConfigError, distributed
from distfn.mesh import DIMS, DP_DIMS, Layout, MeshSpec, parse_text
from distfn.options import Options, with_env
from distfn.plan import plan_call
from distfn.tensor_parallel import check_plan, resolve

from conftest import SCRIPTS, run_python

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

__all__ = ["s3", "s3_module"]  # the fixtures, imported from tests/s3server.py


# -- the option, at decoration -------------------------------------------------------------------------------
def test_mesh_is_checked_at_decoration_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"mode='ddp'.*use mode='fsdp' or drop mesh="):
        distributed(mode="ddp", mesh={"dp_shard": -1})
    with pytest.raises(ConfigError, match=r"'dp_shrad'.*did you mean 'dp_shard'"):
        distributed(mode="fsdp", mesh={"dp_shrad": 2})
    with pytest.raises(ConfigError, match="at most one dimension may be -1"):
        distributed(mode="fsdp", mesh={"dp_shard": -1, "tp": -1})
    with pytest.raises(ConfigError, match="positive int, or -1"):
        distributed(mode="fsdp", mesh={"tp": 0})
    with pytest.raises(ConfigError, match=r"does not fit the job's 4 ranks.*multiply to 6"):
        distributed(mode="fsdp", nprocs=4, mesh={"dp_replicate": 2, "dp_shard": 3})
    with pytest.raises(ConfigError, match="'auto'"):
        distributed(mode="fsdp", mesh="fancy")
    with pytest.raises(ConfigError, match="names no dimension"):
        distributed(mode="fsdp", mesh={})
    job = distributed(mode="fsdp", mesh={"tp": 2, "dp_shard": -1})(lambda cfg, ctx: None)
    assert job.distfn_options.mesh.sizes == (("dp_shard", -1), ("tp", 2))  # outermost first, whatever the order
    with pytest.raises(ConfigError, match="does not fit"):
        job.options(nprocs=3)


def test_the_environment_overrides_mesh_and_the_plan_checks_it_against_the_world() -> None:
    opts = Options(mode="fsdp", nprocs=4)
    assert with_env(opts, {"DISTFN_MESH": "dp_replicate=2,dp_shard=-1"}).mesh == MeshSpec(
        sizes=(("dp_replicate", 2), ("dp_shard", -1)))
    assert with_env(opts, {"DISTFN_MESH": '{"tp": 2, "dp_shard": 2}'}).mesh.sizes == (("dp_shard", 2), ("tp", 2))
    assert with_env(opts, {"DISTFN_MESH": "AUTO"}).mesh == MeshSpec(auto=True)
    with pytest.raises(ConfigError, match="DISTFN_MESH='dp_shard=two'"):
        with_env(opts, {"DISTFN_MESH": "dp_shard=two"})
    with pytest.raises(ConfigError, match=r"DISTFN_MESH.*does not fit the job's 4 ranks"):
        with_env(opts, {"DISTFN_MESH": "dp_shard=3"})
    # torchrun's world (8 ranks, 2 nodes of 4): the plan resolves 'auto' to HSDP and refuses a mesh of 6
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    plan = plan_call(Options(mode="fsdp", mesh="auto"), env, [], lambda: 0, nested=False)
    assert plan.world_size == 8 and plan.opts.mesh.auto
    with pytest.raises(ConfigError, match="does not fit the job's 8 ranks"):
        plan_call(Options(mode="fsdp", mesh={"dp_shard": 3, "tp": 2}), env, [], lambda: 0, nested=False)


def test_distfn_env_shows_the_mesh_as_the_call_would_lay_it_out() -> None:
    from distfn.envreport import collect, render

    info = collect(env={"DISTFN_MESH": "dp_shard=-1,tp=2", "DISTFN_NPROCS": "4"})
    assert info["plan"]["mesh"] == ("dp_shard=-1 x tp=2 -> dp_shard=2 x tp=2 (2 data-parallel rank(s), tensor "
                                    "parallel 2)")
    assert "mesh (fsdp)" in render(info)
    bad = collect(env={"DISTFN_MESH": "dp_shard=3", "DISTFN_NPROCS": "4"})
    assert "does not fit the job's 4 ranks" in bad["plan"]["error"]


def test_auto_is_hsdp_over_the_nodes() -> None:
    assert MeshSpec(auto=True).resolve(8, num_nodes=2, local_world_size=4) == Layout(DP_DIMS, (2, 4))
    assert MeshSpec(auto=True).resolve(4, num_nodes=1) == Layout(("dp_shard",), (4,))
    with pytest.raises(ConfigError, match="not 2 nodes of 3"):
        MeshSpec(auto=True).resolve(8, num_nodes=2, local_world_size=3)


def test_the_layout_puts_tp_innermost_and_data_on_the_dp_dimensions() -> None:
    layout = MeshSpec.parse({"tp": 2, "dp_shard": 2, "dp_replicate": 2}).resolve(8)  # type: ignore[union-attr]
    assert layout.names == DIMS and layout.shape == (2, 2, 2)
    assert layout.coords(5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # a tp pair shares its batch
    assert layout.dp_size == 4 and layout.tp_size == 2
    assert layout.groups(DP_DIMS) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # one data-parallel group per tp index
    assert layout.groups(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@given(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3), st.integers(0, 2))
def test_any_resolved_layout_covers_every_rank_once(sizes: list[int], rest: int) -> None:
    names = DIMS[:len(sizes)]
    spec = MeshSpec.parse({n: (-1 if i == rest else s) for i, (n, s) in enumerate(zip(names, sizes, strict=False))})
    assert spec is not None
    world = 1
    for s in sizes:
        world *= s
    layout = spec.resolve(world)
    assert layout.world_size == world
    coords = {tuple(layout.coords(r).values()) for r in range(world)}
    assert len(coords) == world  # a bijection between ranks and mesh points
    assert sorted(layout.dp_rank(r) for r in range(world)) == sorted(list(range(layout.dp_size)) * layout.tp_size)


@given(st.text(max_size=40))
def test_mesh_text_from_the_environment_is_a_mesh_or_a_config_error(text: str) -> None:
    try:
        value = parse_text(text)
    except ValueError:
        return
    try:
        spec = MeshSpec.parse(value)
    except ConfigError:
        return
    assert spec is None or spec.auto or all(n in DIMS and (s > 0 or s == -1) for n, s in spec.sizes)


# -- the tensor-parallel plan, checked before any collective ---------------------------------------------------
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)) for _ in range(2)])
        self.norm = nn.LayerNorm(8)


def test_a_plan_is_checked_before_any_collective() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = Mlp()
    assert [n for n, _ in resolve(model, "blocks.*.0")] == ["blocks.0.0", "blocks.1.0"]
    check_plan(model, {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}, 2)
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.fc1' names no module of Mlp"):
        check_plan(model, {"blocks.*.fc1": ColwiseParallel()}, 2)
    with pytest.raises(ConfigError, match=r"dimension 0 of its weight \(12, 8\), which the tp size 5 does not divide"):
        check_plan(model, {"blocks.0.0": ColwiseParallel()}, 5)
    with pytest.raises(ConfigError, match=r"splits nn\.Linear and nn\.Embedding.*LayerNorm"):
        check_plan(model, {"norm": ColwiseParallel()}, 2)
    with pytest.raises(ConfigError, match="ParallelStyle"):
        check_plan(model, {"norm": "colwise"}, 2)


def test_parallelize_outside_fsdp_or_without_tp_is_a_config_error() -> None:
    from distfn import wrapping

    with pytest.raises(ConfigError, match="mode='fsdp'"):
        wrapping.wrap(Mlp(), mode="single", device=torch.device("cpu"), is_main=True, parallelize={})
    with pytest.raises(ConfigError, match="True or False"):
        wrapping.wrap(Mlp(), mode="single", device=torch.device("cpu"), is_main=True, compile="yes")


# -- 4 ranks, CPU, gloo: one script, every mesh ----------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("mesh")
    done = run_python([str(SCRIPTS / "mesh_job.py"), str(out)], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


def _close(a: dict, b: dict, tol: float) -> bool:
    return set(a) == set(b) and all(torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), atol=tol, rtol=0)
                                    for k in a)


@pytest.mark.slow
def test_hsdp_2x2_equals_hand_written_fsdp2_hsdp(job: tuple[dict, Path]) -> None:
    ranks = job[0]["hsdp"]
    assert [r["mesh"] for r in ranks] == [["dp_replicate", "dp_shard"]] * 4 and ranks[0]["shape"] == [2, 2]
    assert all(r["placements"]["fc1.weight"] == ["R", "S(0)"] for r in ranks)  # replicated x sharded
    for r in ranks:
        assert r["weights"] == r["reference"]  # bit-equal after the steps, fp32
        assert r["weights"] == ranks[0]["weights"]
    assert ranks[0]["losses"][0] != ranks[0]["losses"][-1]
    # data over the 4 data-parallel ranks: disjoint and covering
    assert [r["dp"] for r in ranks] == [[0, 4], [1, 4], [2, 4], [3, 4]]
    seen = [i for r in ranks for i in r["indices"]]
    assert sorted(seen) == list(range(64))


@pytest.mark.slow
def test_tp2_dp2_equals_one_process_training_and_tp_pairs_share_batches(job: tuple[dict, Path]) -> None:
    ranks = job[0]["tp"]
    assert ranks[0]["mesh"] == ["dp_shard", "tp"]
    assert ranks[0]["placements"]["fc2.weight"] == ["S(0)", "S(1)"]  # FSDP over dp x rowwise over tp
    assert torch.allclose(torch.tensor(ranks[0]["losses"]), torch.tensor(ranks[0]["single_losses"]), atol=1e-5)
    for r in ranks:
        assert _close(r["weights"], r["single"], 1e-5)
    assert [r["dp"] for r in ranks] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert ranks[0]["indices"] == ranks[1]["indices"] and ranks[2]["indices"] == ranks[3]["indices"]
    assert sorted(ranks[0]["indices"] + ranks[2]["indices"]) == list(range(64))
    # all_reduce over the data-parallel ranks by default (a tp pair counts once), over="world" over every rank
    assert [r["sums"] for r in ranks] == [[2, 4, 2], [2, 4, 3], [2, 4, 2], [2, 4, 3]]
    # gather_for_metrics over the data-parallel ranks only: each row once, in the sampler's order
    assert all(r["gathered"] == list(range(2 * 4)) for r in ranks)


@pytest.mark.slow
def test_a_2d_checkpoint_reshards_onto_every_mesh_and_one_process(job: tuple[dict, Path]) -> None:
    result, out = job
    saved = result["hsdp"][0]["weights"]
    assert all(r["rest"] == {"step": 4} for r in result["tp"])
    # HSDP's mid-run checkpoint (weights, momentum, loader) resumed on TP 2 x DP 2 continues the same run: the
    # saved global batch of 16 becomes 8 per data-parallel rank, the same samples, the same losses
    hsdp_losses = result["hsdp"][0]["losses"]
    for r in result["tp"]:
        assert r["start"] == 2 and r["per_rank_batch"] == 8
        assert torch.allclose(torch.tensor(r["continued"]), torch.tensor(hsdp_losses[2:]), atol=1e-5)
    for case in ("tp", "fsdp4", "hsdp14"):
        assert all(_close(r["loaded"], saved, 0.0) for r in result[case]), case
    assert all(_close(r["from_file"], saved, 0.0) for r in result["tp"])  # a one-file save of 2-D state too
    assert result["fsdp4"][0]["mesh"] == ["dp_shard"] and result["hsdp14"][0]["shape"] == [1, 4]
    assert all(_close(r["loaded"], result["tp"][0]["weights"], 0.0) for r in result["from_tp"])  # TP -> HSDP
    assert _close(result["one"], saved, 0.0) and _close(result["consolidated"], saved, 0.0)
    assert _close(result["async"], saved, 0.0)  # blocking=False writes the same 2-D checkpoint
    # replicated pieces are written once: the shards hold exactly the model's bytes
    directory = out / "hsdp-4"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    stored = 0
    for shard in directory.glob("shard-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored += sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    assert stored == int(index["metadata"]["total_size"])
    assert not list(directory.glob("*.pkl")) and not list(directory.glob("*.distcp"))


# -- a 2-D checkpoint's claims, checked before use (docs/threats.md, "2-D meshes") ------------------------------
def _rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_a_2d_checkpoint_whose_pieces_overlap_or_do_not_fit_is_refused(job: tuple[dict, Path],
                                                                       tmp_path: Path) -> None:
    import distfn
    from distfn import CheckpointError

    src = job[1] / "tp-4"  # TP x FSDP: column and row pieces of a 2-D mesh
    names = {}
    for shard in sorted(src.glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names[shard.name] = dict(json.loads(f.metadata()["DCP_SHARDING_INFO"]))
    file, info = next((f, i) for f, i in names.items() if "model.fc2.weight" in i)
    assert info["model.fc2.weight"]["saved_offsets"] != [0, 0] or len(names) > 1

    def shift(header: dict) -> None:  # claim another rank's box: two pieces overlap, one box stays empty
        meta = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        offsets = meta["model.fc2.weight"]["saved_offsets"]
        meta["model.fc2.weight"]["saved_offsets"] = [0, 0] if offsets != [0, 0] else [4, 0]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(meta)

    overlapping = _copy(src, tmp_path / "overlap")
    _rewrite_header(overlapping / file, shift)
    with pytest.raises(CheckpointError, match=r"model\.fc2\.weight"):
        distfn.load(overlapping)

    def outside(header: dict) -> None:  # a piece past the tensor's edge
        meta = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        meta["model.fc2.weight"]["saved_offsets"] = [8, 0]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(meta)

    past = _copy(src, tmp_path / "past")
    _rewrite_header(past / file, outside)
    with pytest.raises(CheckpointError, match="does not fit the index"):
        distfn.load(past)

    wrong = _copy(src, tmp_path / "shape")  # the index claims a shape the pieces do not tile
    index = json.loads((wrong / "model.safetensors.index.json").read_text())
    tensors = json.loads(index["metadata"]["distfn.tensors"])
    tensors["model.fc2.weight"]["shape"] = [8, 64]
    index["metadata"]["distfn.tensors"] = json.dumps(tensors)
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.fc2\.weight"):
        distfn.load(wrong)


@pytest.mark.slow
def test_compile_true_on_hsdp_and_tp_compiles_each_unit_keeps_keys_clean_and_reuses_the_cache(tmp_path: Path) -> None:
    """One script, three launches of 4 ranks (tests/scripts/mesh_compile_job.py): HSDP 2 x 2 and TP 2 x DP 2, each
    training a compiled and an eager copy of the same model on the same batches, then a second start (plain FSDP,
    the same unit graphs) in the same compile cache."""
    from distfn.checkpoint.names import INDEX

    done = run_python([str(SCRIPTS / "mesh_compile_job.py"), str(tmp_path)], timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for case, mesh in (("hsdp", ["dp_replicate", "dp_shard"]), ("tp", ["dp_shard", "tp"])):
        ranks = result[case]
        for r in ranks:
            assert r["mesh"] == mesh
            # every FSDP unit (the root too) runs its compiled forward: compiled before fully_shard wrapped it
            assert r["units"] == r["compiled_forwards"] == ["", "0", "1"], case
            # the only graph breaks are FSDP's own hooks (torch runs them under dynamo.disable) where the root's
            # compiled forward calls a unit: nothing of distfn's, TP's or DTensor's breaks a graph
            breaks = [k for k in r["cache"] if k.startswith("graph_break")]
            assert all("function `disable`" in k for k in breaks), (case, breaks)
            assert r["keys"] == r["eager_keys"] and not any("_orig_mod" in k for k in r["keys"])
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["eager_losses"]))
            for k in r["weights"]:  # fp32, torch's default tolerances for inductor's fused kernels vs eager
                torch.testing.assert_close(torch.tensor(r["weights"][k]), torch.tensor(r["eager_weights"][k]))
        # a cold cache: compiled here. Not "no rank found anything": the 4 ranks share the cache directory and compile
        # the same graphs at once, so a rank slower than its peer finds the graph the peer has just written (CI saw
        # rank 0 with 3 misses and 1 hit); and TP's launch may find a graph HSDP's wrote. Every rank looked each
        # graph up, and some rank compiled.
        assert sum(r["cache"].get("inductor.fxgraph_cache_miss", 0) for r in ranks) > 0, [r["cache"] for r in ranks]
        for r in ranks:
            looked_up = sum(r["cache"].get(f"inductor.fxgraph_cache_{k}", 0) for k in ("miss", "hit"))
            assert looked_up > 0, r["cache"]
        index = json.loads((tmp_path / case / INDEX).read_text())
        assert sorted(index["weight_map"]) == [f"model.{k}" for k in ranks[0]["keys"]]
    # the second start finds every graph the first compiled (the logs show the seconds each took)
    again = result["again"]
    assert all(r["cache"].get("inductor.fxgraph_cache_hit", 0) > 0 and "inductor.fxgraph_cache_miss" not in r["cache"]
               for r in again), again[0]["cache"]
    assert again[0]["losses"] == result["hsdp"][0]["losses"]  # plain FSDP 4 = HSDP 2 x 2 on the same batches


def test_a_tensor_parallel_group_is_not_a_straggler_of_itself() -> None:
    from distfn.stragglers import find_straggler, summarise

    def row(rank: int, compute: float) -> object:
        # (data, compute, comm, step) per step
        return summarise([(0.001, compute, 0.01, compute + 0.011)] * 5, rank=rank, host="h")

    # rank 2 computes slowly; rank 3, its tp peer, waits for it inside every forward (counted as compute too)
    rows = [row(0, 0.05), row(1, 0.05), row(2, 0.12), row(3, 0.11)]
    found = find_straggler(rows, [[0, 1], [2, 3]])  # compared with the other tp group only: still the straggler
    assert found is not None and found.rank == 2 and found.median == pytest.approx(0.05)
    assert find_straggler(rows) is not None  # without the groups too
    assert find_straggler(rows, [[0, 1, 2, 3]]) is None  # one tp group: nobody outside it to be slower than


# -- s3://, in the background ------------------------------------------------------------------------------------
@needs_s3
@pytest.mark.slow
def test_a_2d_checkpoint_goes_to_s3_in_the_background_and_reshards_back(s3: S3Server) -> None:
    import distfn

    url = s3.url("mesh", "hsdp-1")
    done = run_python([str(SCRIPTS / "mesh_s3_job.py"), url], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["saved_on"] == ["dp_replicate", "dp_shard"] and result["loaded_on"] == ["dp_shard", "tp"]
    assert _close(result["loaded"], result["saved"], 0.0)
    one = {k.removeprefix("model."): v.tolist() for k, v in distfn.load(url).items()}
    assert _close(one, result["saved"], 0.0)
