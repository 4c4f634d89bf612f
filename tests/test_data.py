"""ctx.dataloader and ctx.gather_for_metrics: one 2-rank CPU run checks sharding, automatic epochs, exact
resume, per-rank worker seeding and exact metric gathering; the rest runs in this process."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from loguru import logger
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, TensorDataset

from distfn import ConfigError, distributed
from distfn import data as ddata

SEED = 5


class Noisy(Dataset):
    """Each item: its index and three random draws (torch, random, NumPy) plus the DataLoader worker id."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([i, torch.rand(()).item(), random.random(), float(np.random.rand()),
                             -1 if info is None else info.id], dtype=torch.float64)


def _indices(loader) -> list[int]:
    return [int(i) for (x,) in loader for i in x]


@distributed(nprocs=2, seed=SEED)
def _data_job(cfg, ctx):
    messages: list[str] = []
    sink = logger.add(messages.append, filter=lambda r: "global batch" in r["message"], format="{message}")
    out: dict = {"rank": ctx.rank}

    # Training loader: 12 samples, 4 per rank per batch; epochs advance by themselves, set_epoch replays.
    train = ctx.dataloader(TensorDataset(torch.arange(12)), 4)
    out["epoch0"], out["epoch1"] = _indices(train), _indices(train)
    out["epochs_seen"] = [train.epoch, train.next_epoch]
    train.set_epoch(0)
    out["replay0"] = _indices(train)
    out["pin_memory"], out["global_batch"], out["len"] = train.pin_memory, train.global_batch_size, len(train)

    # Evaluation over 11 samples (not divisible by 2): per batch, after the loop, nested, and shuffled.
    values = torch.arange(11) * 10
    evaluation = ctx.dataloader(TensorDataset(torch.arange(11), values), 4, shuffle=False)
    per_batch, seen = [], []
    for idx, val in evaluation:
        seen.append(idx)
        got = ctx.gather_for_metrics({"idx": idx, "pair": (val, val + 1)})
        per_batch.append(got)
    out["per_batch_idx"] = torch.cat([g["idx"] for g in per_batch]).tolist()
    out["per_batch_pair"] = [torch.cat([g["pair"][k] for g in per_batch]).tolist() for k in range(2)]
    out["local_rows"] = int(sum(len(s) for s in seen))
    out["after_loop"] = ctx.gather_for_metrics(torch.cat(seen)).tolist()
    shuffled = ctx.dataloader(TensorDataset(torch.arange(11)), 3, shuffle=True)
    shuffled.set_epoch(2)
    out["shuffled"] = torch.cat([ctx.gather_for_metrics(x) for (x,) in shuffled]).tolist()
    try:
        ctx.gather_for_metrics(torch.zeros(5))  # neither the current batch (2 rows) nor the epoch (6 rows)
    except ConfigError as exc:
        out["wrong_rows"] = str(exc)

    # DataLoader workers: distinct per rank and per worker, the same again when an epoch is replayed.
    noisy = ctx.dataloader(Noisy(), 2, shuffle=False, num_workers=2)
    out["noisy0"] = torch.cat(list(noisy)).tolist()
    out["noisy1"] = torch.cat(list(noisy)).tolist()
    noisy.set_epoch(0)
    out["noisy0_again"] = torch.cat(list(noisy)).tolist()

    logger.remove(sink)
    out["messages"] = messages
    return ctx.gather_object(out)


def test_dataloader_and_gather_for_metrics_on_two_ranks() -> None:
    r0, r1 = _data_job()
    # Sharding: disjoint shares covering the dataset, in the order DistributedSampler's seeded shuffle gives.
    for key in ("epoch0", "epoch1"):
        assert len(r0[key]) == len(r1[key]) == 6
        assert sorted(r0[key] + r1[key]) == list(range(12))
    for epoch, key in ((0, "epoch0"), (1, "epoch1")):
        perm = torch.randperm(12, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert r0[key] == perm[0::2] and r1[key] == perm[1::2]
    assert r0["epoch0"] != r0["epoch1"]  # the epoch advanced without set_epoch
    assert r0["epochs_seen"] == [1, 2]
    assert r0["replay0"] == r0["epoch0"] and r1["replay0"] == r1["epoch0"]
    assert r0["pin_memory"] is False  # CPU
    assert r0["global_batch"] == 8 and r0["len"] == 2

    # gather_for_metrics: exactly the 11 samples, in dataset order, on every rank (6 local rows incl. 1 pad).
    for r in (r0, r1):
        assert r["local_rows"] == 6
        assert r["per_batch_idx"] == list(range(11))
        assert r["per_batch_pair"] == [[10 * i for i in range(11)], [10 * i + 1 for i in range(11)]]
        assert r["after_loop"] == list(range(11))
        assert r["shuffled"] == torch.randperm(11, generator=torch.Generator().manual_seed(SEED + 2)).tolist()
        assert "5 rows" in r["wrong_rows"] and "current batch" in r["wrong_rows"]

    # Worker seeding: rows are [index, torch, random, numpy, worker id].
    n0, n1 = torch.tensor(r0["noisy0"]), torch.tensor(r1["noisy0"])
    assert n0[:, 0].tolist() == [0, 2, 4, 6] and n0[:, 4].tolist() == [0, 0, 1, 1]  # one batch per worker
    for col in (1, 2, 3):
        assert len(set(n0[:, col].tolist()) | set(n1[:, col].tolist())) == 8  # every draw differs: ranks, workers
    assert r0["noisy0_again"] == r0["noisy0"] and r1["noisy0_again"] == r1["noisy0"]  # exact replay of epoch 0
    assert r0["noisy1"] != r0["noisy0"]

    # The global batch is logged once per loader, by rank 0 only.
    assert len(r0["messages"]) == 4 and r1["messages"] == []
    assert "batch_size 4 per rank x 2 rank(s) = global batch 8" in r0["messages"][0]
    assert "1 padded with duplicates" in r0["messages"][1]


# -- in this process ----------------------------------------------------------------------------------------
def _shard_loader(n: int, rank: int, batch_size: int, device: str = "cpu", **kwargs) -> ddata.DistributedLoader:
    def make_sampler(dataset, shuffle, drop_last):
        return DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=shuffle, drop_last=drop_last)

    return ddata.dataloader(TensorDataset(torch.arange(n)), batch_size, make_sampler, rank=rank, seed=0,
                            device=torch.device(device), shuffle=False, **kwargs)


def test_padding_rows_are_dropped_per_batch_and_per_epoch() -> None:
    # Rank 1 of 2 over 11 samples holds 1, 3, 5, 7, 9 and a padding copy of sample 0 in its last batch.
    # The run's LastLoader names the loader that handed out a batch last (what ctx.gather_for_metrics defaults to).
    last = ddata.LastLoader()
    loader = _shard_loader(11, rank=1, batch_size=4, tracker=last)
    batches = []
    for (x,) in loader:
        batches.append(x)
        kept = ddata.gather_for_metrics(x * 10, last.current())
        assert kept.tolist() == [10 * int(i) for i in x if int(i) != 0]
        assert loader.at_last_batch() == (len(batches) == 2)
        assert last.at_last_batch() == (len(batches) == 2)
    assert ddata.gather_for_metrics(torch.cat(batches), last.current()).tolist() == [1, 3, 5, 7, 9]
    assert ddata.gather_for_metrics(torch.cat(batches), loader).tolist() == [1, 3, 5, 7, 9]


def test_drop_last_drops_the_tail_instead_of_padding_and_cuda_pins_memory() -> None:
    assert _shard_loader(4, rank=0, batch_size=2, device="cuda:0").pin_memory is True
    assert _shard_loader(4, rank=0, batch_size=2, device="cuda:0", pin_memory=False).pin_memory is False
    loader = _shard_loader(11, rank=1, batch_size=2, drop_last=True)
    assert [x.tolist() for (x,) in loader] == [[1, 3], [5, 7]]  # 5 per rank, last incomplete batch dropped
    assert len(loader.sampler) == 5


def test_dataloader_refuses_what_it_cannot_shard() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    @distributed(mode="single")
    def job(cfg, ctx):
        errors = []
        for call in (lambda: ctx.dataloader(Stream(), 2), lambda: ctx.dataloader(TensorDataset(torch.zeros(4)), 0),
                     lambda: ctx.dataloader(TensorDataset(torch.zeros(4)), 2, sampler=None)):
            with pytest.raises(ConfigError) as info:
                call()
            errors.append(str(info.value))
        loader = ctx.dataloader(TensorDataset(torch.arange(5)), 2, shuffle=False)
        with pytest.raises(ConfigError, match="before this loader handed out a batch"):
            ctx.gather_for_metrics(torch.zeros(2), loader)
        with pytest.raises(ConfigError, match="set_epoch"):
            loader.set_epoch(-1)
        with pytest.raises(ConfigError, match=r"ctx\.all_reduce"):
            for (x,) in loader:
                ctx.gather_for_metrics(x.sum())
        # One process: nothing padded, gather is the identity on the rows.
        assert torch.cat([ctx.gather_for_metrics(x) for (x,) in loader]).tolist() == [0, 1, 2, 3, 4]
        return errors

    stream, size, sampler = job()
    assert "IterableDataset must shard itself" in stream
    assert "positive int" in size and "sampler=" in sampler


def test_mix_seed_is_stable_and_spreads() -> None:
    assert ddata.mix_seed(1, 0) == ddata.mix_seed(1, 0)
    seeds = {ddata.mix_seed(s, r, e) for s in range(3) for r in range(4) for e in range(3)}
    assert len(seeds) == 36 and all(0 <= s < 2**63 for s in seeds)


# -- epochs: a peek at the first batch is not an epoch (issue 18) ---------------------------------------------
def _tutorial(peek: bool, epochs: range) -> tuple[list, list, list]:
    """The PyTorch DDP tutorial's loop: it reads the batch size with `len(next(iter(loader))[0])` every epoch;
    a run that starts at epoch `epochs.start` > 0 resumes with `loader.set_epoch`."""

    @distributed(mode="single", seed=3)
    def job(cfg, ctx):
        xs = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
        loader = ctx.dataloader(TensorDataset(xs, xs.sum(1, keepdim=True)), 4)
        if epochs.start:
            loader.set_epoch(epochs.start)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        orders, epochs_used = [], []
        for _ in epochs:
            if peek:
                assert len(next(iter(loader))[0]) == 4
            order = []
            for x, y in loader:
                order.append(x)
                torch.nn.functional.mse_loss(model(x), y).backward()
                ctx.step(opt)
            orders.append(torch.cat(order).tolist())
            epochs_used.append(loader.epoch)
        return orders, epochs_used, [p.detach().clone() for p in model.parameters()]

    return job()


def test_a_peek_at_the_first_batch_does_not_start_a_new_epoch() -> None:
    plain_orders, plain_epochs, plain_weights = _tutorial(False, range(3))
    orders, epochs, weights = _tutorial(True, range(3))
    assert plain_epochs == epochs == [0, 1, 2]
    assert orders == plain_orders and len({str(o) for o in orders}) == 3  # three different shuffles
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    # A resume with set_epoch, peeking too, sees the same epochs as the uninterrupted run.
    resumed, resumed_epochs, _ = _tutorial(True, range(1, 3))
    assert resumed_epochs == [1, 2] and resumed == orders[1:]


def test_a_loop_left_with_break_still_uses_up_its_epoch() -> None:
    loader = _shard_loader(16, rank=0, batch_size=2)
    loader.sampler.shuffle = True
    first = [int(i) for (x,) in loader for i in x]
    for k, _ in enumerate(loader):  # epoch 1, left after two batches
        if k == 1:
            break
    assert loader.epoch == 1
    third = [int(i) for (x,) in loader for i in x]
    assert loader.epoch == 2 and loader.next_epoch == 3 and third != first


def test_pin_memory_is_dropped_on_cpu_without_a_warning() -> None:
    import warnings

    loader = _shard_loader(4, rank=0, batch_size=2, pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch: "'pin_memory' argument is set as true but no accelerator ..."
        assert [x.tolist() for (x,) in loader] == [[0, 2]]
    assert loader.pin_memory is False

