"""Issue 41 items 16 and 17: the start-up fingerprint compares canonical forms and never fails a job; a data
loader's saved state is checked whole at the load, and a plain DataLoader refuses a saved position.

Property tests (Hypothesis, the ``test`` extra) for the canonical form and for the loader-state parser, which reads
untrusted input (a checkpoint's metadata tree).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distfn import CheckpointError, checkpoint
from distfn import data as ddata
from distfn import loader_state as ls
from distfn.checkpoint import sharded
from distfn.fingerprint import Unfingerprintable, _digest, canonical, cfg_items

from conftest import clean_env

# -- 16: the fingerprint's canonical form ---------------------------------------------------------------------------
_SEEDED = """
import json, sys
from distfn.fingerprint import _digest, cfg_items
tags = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"}
cfg = {"tags": tags, "nested": {"by": frozenset({("a", 1), ("b", 2), ("c", 3)})}, "wide": {str(i): set("xyzw")
       for i in range(70)}}
print(json.dumps({"repr": repr(tags), "digest": _digest(cfg_items(cfg))}))
"""


def test_a_set_is_the_same_input_under_every_hash_seed() -> None:
    """torchrun gives each process its own hash seed, which orders a set of strings differently: the same cfg
    was "different inputs" (its repr was compared). This process and one under another seed agree."""
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    other = json.loads(subprocess.run([sys.executable, "-c", _SEEDED], env=clean_env(PYTHONHASHSEED=seed),
                                      capture_output=True, text=True, timeout=120, check=True).stdout)
    here: dict[str, Any] = {}
    exec(_SEEDED.replace("print(json.dumps(", "here.update(("), {"here": here})
    assert here["repr"] != other["repr"]  # the two processes do order the set differently...
    assert here["digest"] == other["digest"]  # ... and their fingerprints agree


def _agree(cfgs: list[Any]) -> dict[int, BaseException]:
    """Run ``Agreement.check`` on one rank per cfg (threads over one store); the exception each rank raised."""
    import torch.distributed as dist

    from distfn.fingerprint import Agreement
    from distfn.rankstore import Channel

    store, world = dist.HashStore(), len(cfgs)
    ranks = [Agreement.start(Channel.open(store, r, world).child("fingerprint"), cfg, 5.0)
             for r, cfg in enumerate(cfgs)]
    errors: dict[int, BaseException] = {}

    def wrap(r: int) -> None:
        try:
            assert ranks[r] is not None
            ranks[r].check(nn.Linear(2, 2))
        except BaseException as exc:  # noqa: BLE001 - StopIteration was the defect
            errors[r] = exc

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


class _BadRepr:
    def __repr__(self) -> str:
        raise ValueError("no repr for you")


def _deep(n: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(n):
        value = [value]
    return value


def test_equal_dicts_in_another_order_and_hostile_items_pass_every_rank() -> None:
    """Equal dicts built in another order crashed ctx.wrap with StopIteration; an item whose repr raises, or a cfg
    nested 3,000 deep, failed every job. Now the first two are the same input and the hostile ones are left out
    with one line, while the rest of the cfg is still compared."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}", filter="distfn")
    logger.enable("distfn")
    try:
        cyclic: list[Any] = []
        cyclic.append(cyclic)
        hostile = {"bad": _BadRepr(), "deep": _deep(3000), "cyclic": cyclic, "huge": 10**5000}
        one = {"lr": 0.1, "opt": {"betas": (0.9, 0.99), "eps": 1e-8}, **hostile}
        other = {**hostile, "opt": {"eps": 1e-8, "betas": (0.9, 0.99)}, "lr": 0.1}
        assert _agree([one, other]) == {}
        assert sum("not compared between ranks" in line for line in lines) == 2  # one line per rank's cfg
        assert all(k in lines[-1] for k in ("cfg.bad", "cfg.deep", "cfg.cyclic")) and "cfg.huge" not in lines[-1]
        errors = _agree([one, {**other, "lr": 0.2}])  # what is left is still compared
        assert sorted(errors) == [0, 1] and "differs at 'cfg.lr': 0.1 on rank 0, 0.2 on rank 1" in str(errors[0])
        errors = _agree([one, {**other, "huge": 10**5000 + 1}])  # past the int-to-str limit: by its hex
        assert "differs at 'cfg.huge'" in str(errors[1])
    finally:
        logger.remove(sink)
        logger.disable("distfn")


hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_HASHABLE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                      st.binary(max_size=8))
_LEAVES = st.one_of(_HASHABLE, st.floats(), st.complex_numbers(allow_nan=False), st.integers(min_value=10**300))


def _containers(children: Any) -> Any:
    return st.one_of(st.lists(children, max_size=5), st.lists(children, max_size=5).map(tuple),
                     st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), children, max_size=5),
                     st.sets(_HASHABLE, max_size=6), st.frozensets(_HASHABLE, max_size=6))


_VALUES = st.recursive(_LEAVES, _containers, max_leaves=40)


def _rebuilt(value: Any, rnd: random.Random) -> Any:
    """An equal copy of ``value`` whose dicts and sets were built in another (random) order."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _rebuilt(value[k], rnd) for k in keys}
    if isinstance(value, (set, frozenset)):
        items = list(value)
        rnd.shuffle(items)
        fresh: set[Any] = set()
        for item in items:
            fresh.add(item)
        return type(value)(fresh) if isinstance(value, frozenset) else fresh
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v, rnd) for v in value)
    return value


@settings(max_examples=150, deadline=None)
@given(value=_VALUES, seed=st.integers(0, 2**32))
def test_equal_values_have_equal_fingerprints_whatever_their_construction_order(value: Any, seed: int) -> None:
    copy = _rebuilt(value, random.Random(seed))
    assert canonical(copy) == canonical(value)
    assert _digest(cfg_items({"x": copy})) == _digest(cfg_items({"x": value}))


class _Hostile:
    """A cfg value whose repr raises, returns a non-string, or is fine (chosen by ``how``)."""

    def __init__(self, how: int) -> None:
        self.how = how

    def __repr__(self) -> Any:
        if self.how == 0:
            raise RuntimeError("repr raised")
        if self.how == 1:
            return 12  # type: ignore[return-value]
        if self.how == 2:
            raise RecursionError
        return f"Hostile({self.how})"


_HOSTILE = st.recursive(
    st.one_of(_LEAVES, st.integers(0, 3).map(_Hostile), st.integers(50, 400).map(_deep)),
    lambda children: st.one_of(_containers(children), st.dictionaries(st.integers(0, 3).map(_Hostile), children,
                                                                       max_size=3)),
    max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(value=_HOSTILE)
def test_hostile_values_never_raise(value: Any) -> None:
    items = cfg_items({"x": value, "lr": 0.1})
    assert items["cfg.lr"] == "0.1" and all(isinstance(k, str) and isinstance(v, str) for k, v in items.items())
    try:
        assert isinstance(canonical(value), str)
    except Unfingerprintable:
        pass


# -- 17: the loader state, checked whole at the load ----------------------------------------------------------------
def _loader(n: int, batch: int, world: int = 1, rank: int = 0, drop_last: bool = False) -> ddata.DistributedLoader:
    def make_sampler(ds: Any, shuffle: bool, drop_last: bool) -> DistributedSampler:
        return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last)

    return ddata.dataloader(TensorDataset(torch.arange(n)), batch, make_sampler, rank=rank, seed=0,
                            device=torch.device("cpu"), drop_last=drop_last)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("epoch", 2**70, "epoch=1180591620717411303424 (from 0 to 4611686018427387904)"),
    ("seed", 2**64, "seed=18446744073709551616 (from 0 to 9223372036854775807)"),
    ("world_size", 10**12, "world_size=1000000000000 (from 1 to 1048576)"),
    ("epoch_world_size", 10**12, "epoch_world_size=1000000000000"),
    ("global_batch", 10**12, "global_batch=1000000000000 (from 1 to 16777216)"),
    ("epoch", 10**400, "epoch=an int of 1329 bits"),
    ("epoch", 1.0, "epoch=1.0 (an int)"),
    ("shuffle", 1, "shuffle=1 (a bool)"),
    ("batches", 1, "batches=1 is not position 8 // global batch 4"),
    ("format", True, "format True"),
    ("extra", 1, "unknown field(s) extra"),
])
def test_a_state_no_dataset_can_mean_fails_at_the_load(field: str, value: Any, says: str) -> None:
    """It passed the load and failed at the first batch (OverflowError, MemoryError)."""
    loader = _loader(20, 4)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    fresh = _loader(20, 4)
    with pytest.raises(CheckpointError) as caught:
        fresh.load_state_dict({**state, field: value})
    assert says in str(caught.value)
    fresh.load_state_dict(state)  # nothing was changed by the refused load: the good state still applies
    assert next(iter(fresh))[0].tolist() == next(it)[0].tolist()


def test_the_largest_state_within_the_bounds_still_draws_its_first_batch() -> None:
    loader = _loader(10, 2)
    state = {**loader.state_dict(), "epoch": ls.MAX_EPOCH, "seed": ls.MAX_SEED, "world_size": ls.MAX_WORLD_SIZE,
             "epoch_world_size": ls.MAX_WORLD_SIZE, "global_batch": ls.MAX_WORLD_SIZE}
    loader.load_state_dict(state)  # saved by 2**20 ranks at one sample each: here one batch of the whole epoch
    assert sorted(next(iter(loader))[0].tolist()) == list(range(10))


def test_a_plain_dataloader_where_a_ctx_dataloader_was_saved_is_an_error(tmp_path: Path) -> None:
    """It silently took the saved dict in place of the loader, which restarted at batch 0."""
    loader = _loader(20, 4)
    next(iter(loader))
    path = checkpoint.save({"model": nn.Linear(2, 1), "loader": loader}, tmp_path / "ckpt-1.safetensors")
    plain = DataLoader(TensorDataset(torch.arange(20)), batch_size=4)
    for into in ({"loader": plain}, {"loader": [plain]}):
        target = dict(into)
        with pytest.raises(CheckpointError, match=r"torch DataLoader at 'loader'.*batch 0.*holds a ctx.dataloader's "
                                                  r"position.*ctx\.dataloader\(dataset, batch_size"):
            checkpoint.load_into(path, target)
        assert target == into  # nothing replaced
    assert "loader" not in checkpoint.load_into(path, {"loader": _loader(20, 4)})
    directory = sharded.save({"model": nn.Linear(2, 1), "loader": loader}, tmp_path / "ckpt-2")  # the same there
    with pytest.raises(CheckpointError, match=r"torch DataLoader at 'loader'.*holds a ctx.dataloader's position"):
        sharded.load_into(directory, {"loader": plain})


_FIELDS = (*ls._INT_FIELDS, *ls._BOOL_FIELDS, "format")
_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**60),
                              st.floats(), st.text(max_size=20)),
                    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
                    max_leaves=20)


@st.composite
def _states(draw: Any) -> dict[str, Any]:
    """A loader state as ``state_dict`` writes one (small sizes, so that its first batch is cheap to draw)."""
    n = draw(st.integers(1, 40))
    world = draw(st.integers(1, 8))
    drop_last = draw(st.booleans()) and n >= world
    end = ls._tail_size(n, world, drop_last)
    global_batch = world * draw(st.integers(1, 6))
    position = draw(st.integers(0, max(0, (end - 1) // global_batch))) * global_batch
    return {"format": 1, "epoch": draw(st.integers(0, ls.MAX_EPOCH)), "position": position,
            "batches": position // global_batch, "seed": draw(st.integers(0, ls.MAX_SEED)), "shuffle": draw(
                st.booleans()), "drop_last": drop_last, "global_batch": global_batch, "world_size": world,
            "epoch_world_size": world, "dataset_len": n}


@settings(max_examples=120, deadline=None)
@given(state=_states(), field=st.sampled_from(_FIELDS), value=_ANY, drop=st.booleans())
def test_the_loader_state_parser_accepts_or_refuses_and_what_it_accepts_runs(state: dict[str, Any], field: str,
                                                                            value: Any, drop: bool) -> None:
    """Any field replaced by any JSON-like value (huge ints, floats, nesting) or dropped: a `CheckpointError`, or a
    state whose first batch a loader over that dataset draws without an error."""
    hostile = dict(state)
    if drop:
        hostile.pop(field)
    else:
        hostile[field] = value
    for candidate in (state, hostile):
        try:
            parsed = ls.LoaderState.from_dict(candidate)
        except CheckpointError:
            assert candidate is hostile
            continue
        loader = _loader(parsed.dataset_len, 1, drop_last=parsed.drop_last)
        loader.sampler.shuffle = parsed.shuffle
        loader.load_state_dict(candidate)
        first = next(iter(loader), None)  # None: an epoch of no batch (drop_last with a batch over the dataset)
        assert first is not None or parsed.drop_last


@settings(max_examples=100, deadline=None)
@given(saved=st.one_of(_ANY, st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), _ANY, max_size=12)))
def test_arbitrary_input_to_the_loader_state_parser_is_a_checkpoint_error(saved: Any) -> None:
    with pytest.raises(CheckpointError):
        ls.LoaderState.from_dict(saved)


def test_a_deeply_nested_or_huge_field_is_refused_quickly() -> None:
    state = _loader(8, 2).state_dict()
    deep: Any = 0
    for _ in range(100_000):
        deep = {"x": deep}
    for value in (deep, [0] * 1_000_000, "x" * 10_000_000, 2**400_000):
        with pytest.raises(CheckpointError) as caught:
            ls.LoaderState.from_dict({**state, "epoch": value})
        assert len(str(caught.value)) < 300
    with pytest.raises(CheckpointError, match="keys are not all strings"):
        ls.LoaderState.from_dict({**state, 1: 2})
