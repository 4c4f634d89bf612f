"""Issue 25 items 6, 7, 8, 13: a partly meta model keeps its real values in fsdp ``ctx.wrap``; ``ctx.progress``
iterates its iterable once; ``ctx.load(..., rng="if-present")``; a cfg nested deeper than the recursion limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from distfn import CheckpointError, ConfigError, distributed
from distfn.progress import Progress
from distfn.tree import tree_leaves, tree_map


# -- 25.6: a real layer next to a meta-device head -------------------------------------------------------------------
def _partly_meta() -> nn.Sequential:
    body = nn.Linear(8, 8)
    with torch.no_grad():
        body.weight.fill_(7.0)
        body.bias.fill_(7.0)
    with torch.device("meta"):
        head = nn.Linear(8, 4)
    return nn.Sequential(body, nn.ReLU(), head)


@distributed(mode="fsdp", nprocs=2, seed=0)
def _partly_meta_job(cfg, ctx):
    out = {}
    for name, options in (("one_group", {}), ("units", {"min_params": 10})):
        model = ctx.wrap(_partly_meta(), **options)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        out[name] = {n: t.tolist() for n, t in full.items()}
        loss = model(torch.ones(2, 8)).sum()  # it trains: the materialised shards are registered with FSDP
        loss.backward()
    mixed = nn.Linear(8, 8)
    mixed.bias = nn.Parameter(torch.empty(8, device="meta"))
    try:
        ctx.wrap(nn.Sequential(mixed))
    except ConfigError as exc:
        out["mixed"] = str(exc)
    return ctx.gather_object(out)


@pytest.mark.slow
def test_a_partly_meta_model_keeps_its_real_values_in_fsdp_wrap() -> None:
    r0, r1 = _partly_meta_job(None)
    for case in ("one_group", "units"):
        for result in (r0, r1):
            got = {n: torch.tensor(v) for n, v in result[case].items()}
            assert torch.equal(got["0.weight"], torch.full((8, 8), 7.0)), case
            assert torch.equal(got["0.bias"], torch.full((8,), 7.0)), case
            bound = 1 / 8**0.5  # nn.Linear(8, 4).reset_parameters()
            for kind in ("weight", "bias"):
                head = got[f"2.{kind}"]
                assert torch.isfinite(head).all() and head.abs().max() <= bound and head.std() > 0, (case, kind)
        assert r0[case] == r1[case]
    assert "'0'" in r0["mixed"] and "meta device" in r0["mixed"] and "wholly" in r0["mixed"]


# -- 25.7: the bar iterates nothing itself ---------------------------------------------------------------------------
class Counting:
    def __init__(self, n: int) -> None:
        self.n, self.iters = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.iters += 1
        return iter(range(self.n))


@pytest.mark.parametrize("kwargs", [{"disable": False}, {}])  # a drawn bar, and log lines off a terminal
def test_progress_iterates_its_iterable_once(kwargs) -> None:
    import io

    items = Counting(4)
    bar = Progress(items, enabled=True, desc="d", file=io.StringIO(), mininterval=0, **kwargs)
    assert items.iters == 0
    assert list(bar) == [0, 1, 2, 3] and items.iters == 1
    assert bar.total == 4


class _Items(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def _note_start(path: str):
    def init(worker_id: int) -> None:
        with open(path, "a") as f:
            f.write("start\n")
    return init


def test_progress_over_a_dataloader_starts_its_workers_once_and_leaves_the_rng_alone(tmp_path: Path) -> None:
    import io

    starts = tmp_path / "starts"
    loader = DataLoader(_Items(), batch_size=2, num_workers=1, worker_init_fn=_note_start(str(starts)))
    for _ in range(2):  # two epochs
        assert [b.tolist() for b in Progress(loader, enabled=True, file=io.StringIO())] == [[0, 1], [2, 3]]
    assert starts.read_text().count("start") == 2

    plain = DataLoader(_Items(), batch_size=2, shuffle=True)
    torch.manual_seed(0)
    through_bar = [b.tolist() for b in Progress(plain, enabled=True, file=io.StringIO())], torch.rand(3)
    torch.manual_seed(0)
    bare = [b.tolist() for b in plain], torch.rand(3)
    assert through_bar[0] == bare[0] and torch.equal(through_bar[1], bare[1])


# -- 25.8: ctx.load(..., rng="if-present") ---------------------------------------------------------------------------
@distributed(nprocs=1, seed=0)
def _load_rng_job(cfg, ctx):
    out = {}
    model = nn.Linear(2, 2)
    ctx.save({"model": model, "step": 1}, f"{cfg}/plain.safetensors")
    ctx.save({"model": model, "step": 2}, f"{cfg}/rng.safetensors", rng=True)
    after_save = torch.rand(3)
    try:
        ctx.load(f"{cfg}/plain.safetensors", into={"model": model}, rng=True)
    except CheckpointError as exc:
        out["strict"] = str(exc)
    state = torch.get_rng_state()
    out["plain"] = ctx.load(f"{cfg}/plain.safetensors", into={"model": model}, rng="if-present")
    out["untouched"] = torch.equal(state, torch.get_rng_state())
    out["saved"] = ctx.load(f"{cfg}/rng.safetensors", into={"model": model}, rng="if-present")
    out["restored"] = torch.equal(torch.rand(3), after_save)
    try:
        ctx.load(f"{cfg}/rng.safetensors", into={"model": model}, rng="if_present")
    except ConfigError as exc:
        out["typo"] = str(exc)
    return out


def test_load_restores_rng_states_if_present_and_stays_strict_with_true(tmp_path: Path) -> None:
    out = _load_rng_job(str(tmp_path))
    assert "holds no RNG states" in out["strict"] and "rng='if-present'" in out["strict"]
    assert out["plain"] == {"step": 1} and out["untouched"]
    assert out["saved"] == {"step": 2} and out["restored"]
    assert "'if_present'" in out["typo"] and "'if-present'" in out["typo"]


# -- 25.13: a cfg deeper than Python's recursion limit ---------------------------------------------------------------
def _nested(depth: int, leaf):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _depth(value) -> int:
    n = 0
    while isinstance(value, list):
        value, n = value[0], n + 1
    return n


def test_the_tree_walk_takes_any_depth_and_refuses_a_cycle() -> None:
    deep = _nested(5000, torch.ones(2))
    mapped = tree_map(lambda t: t * 2, deep)
    assert _depth(mapped) == 5000 and tree_leaves(mapped)[0].tolist() == [2.0, 2.0]
    assert tree_leaves({"a": [1, (2, {"b": 3})], "c": 4}) == [1, 2, 3, 4]
    shared = [1]
    assert tree_map(lambda v: v + 1, [shared, shared]) == [[2], [2]]  # the same list twice is not a cycle
    cyclic: list = [1]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="contains itself"):
        tree_map(lambda v: v, cyclic)
    with pytest.raises(ValueError, match="contains itself"):
        tree_leaves({"x": cyclic})


@distributed(nprocs=2, start_method="forkserver")
def _deep_cfg_job(cfg, ctx):
    return ctx.gather_object(_depth(cfg))


@pytest.mark.slow
def test_a_deep_cfg_reaches_the_ranks_under_the_fork_server() -> None:
    assert _deep_cfg_job(_nested(400, torch.ones(2)[:1])) == [400, 400]
