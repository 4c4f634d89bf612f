"""The rank bootstrap (distfn.worker): the nested-launch check, thread sizing and seeding."""

from __future__ import annotations

import random

import pytest
import torch

import distfn
from distfn import worker


def test_in_worker_while_a_function_runs_and_in_a_starting_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(worker.CHILD_ENV, raising=False)
    assert not worker.in_worker()

    @distfn.distributed(mode="single")
    def inside(cfg, ctx):
        return worker.in_worker()

    assert inside() is True and not worker.in_worker()
    # a spawn/forkserver worker re-importing the user's script, before distfn's entry point runs
    monkeypatch.setenv(worker.CHILD_ENV, "1")
    assert worker.in_worker()


def test_seed_everything_seeds_random_and_torch() -> None:
    worker.seed_everything(3)
    first = (random.random(), torch.rand(2))
    worker.seed_everything(3)
    second = (random.random(), torch.rand(2))
    assert first[0] == second[0] and torch.equal(first[1], second[1])


def test_size_thread_pool_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    assert "(OMP_NUM_THREADS=" in worker.size_thread_pool(4) and torch.get_num_threads() == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert worker.size_thread_pool(1) == f"{before} CPU threads"

