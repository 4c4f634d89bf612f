"""distfn.rng: generator states captured, saved and restored exactly (one process, and per rank)."""

from __future__ import annotations

import pathlib
import random
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from distfn import checkpoint
from distfn.errors import CheckpointError

from conftest import clean_env, run_python


def test_rng_state_round_trip_through_a_file(tmp_path: pathlib.Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    path = checkpoint.save({"rng": checkpoint.rng_state()}, tmp_path / "r.safetensors")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    checkpoint.set_rng_state(checkpoint.load_into(path, {})["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    # and via the stateful RNG stand-in
    torch.manual_seed(7)
    checkpoint.save({"rng": checkpoint.RNG}, tmp_path / "r2.safetensors")
    a = torch.rand(2)
    checkpoint.load_into(tmp_path / "r2.safetensors", {"rng": checkpoint.RNG})
    assert torch.equal(torch.rand(2), a)


def test_per_rank_rng_states(tmp_path: pathlib.Path) -> None:
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        states.append(checkpoint.rng_state())
    path = checkpoint.save({"rng": checkpoint.combine_rng_states(states), "step": 1}, tmp_path / "r.safetensors")
    entry = checkpoint.load_into(path, {})["rng"]
    assert entry["world_size"] == 2
    with pytest.raises(CheckpointError, match="holds the states of 2 ranks"):
        checkpoint.set_rng_state(entry)
    for rank, seed in ((0, 1), (1, 2)):
        checkpoint.set_rng_state(checkpoint.rng_state_for_rank(entry, rank, 2))
        got = torch.rand(3), random.random()
        torch.manual_seed(seed)
        random.seed(seed)
        assert torch.equal(got[0], torch.rand(3)) and got[1] == random.random()
    assert checkpoint.rng_state_for_rank(entry, 3, 4) is entry["ranks"][1]  # other world size: rank % saved
    single = checkpoint.rng_state()
    assert checkpoint.rng_state_for_rank(single, 1, 2) is single
    with pytest.raises(CheckpointError, match="not an RNG state"):
        checkpoint.set_rng_state({"model": 1})


_RANK0_ONLY = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from distfn import distributed

    @distributed(mode="ddp", nprocs=2, seed=0)
    def job(cfg, ctx):
        model = ctx.wrap(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(50):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if ctx.is_main and step == 2:  # the documented habit, wrong with rng=True: a collective inside
                ctx.save({"model": model, "step": step}, cfg["path"], rng=True)
        return "finished"

    if __name__ == "__main__":
        print(job({"path": sys.argv[1]}))
    """
)


@pytest.mark.slow
def test_rank0_only_save_with_rng_fails_fast_naming_rng(tmp_path: pathlib.Path) -> None:
    """Issue 18 item 4: this used to hang for the whole collective timeout (30 min) and then blame gloo."""
    script = tmp_path / "rank0_only.py"
    script.write_text(_RANK0_ONLY)
    env = {**clean_env(), "DISTFN_RNG_SAVE_WAIT": "3"}
    start = time.monotonic()
    proc = run_python([str(script), str(tmp_path / "ckpt-2.safetensors")], env=env, timeout=150)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout
    # a CheckInTimeout (a CheckpointError) naming rng=True, and no word of the 30-minute collective timeout
    assert "failed with CheckInTimeout" in proc.stderr and "rng=True" in proc.stderr, proc.stderr[-3000:]
    assert "1800 s" not in proc.stderr and "check-in deadline" in proc.stderr, proc.stderr[-3000:]
    assert "if ctx.is_main:" in proc.stderr
    assert elapsed < 90, f"took {elapsed:.0f} s"
    assert not (tmp_path / "ckpt-2.safetensors").exists()


_RANK0_ONLY_THEN_RETURN = textwrap.dedent(
    """
    import sys
    from distfn import distributed

    @distributed(mode="ddp", nprocs=2, seed=0)
    def job(cfg, ctx):
        if ctx.is_main:  # rank 1 returns at once: it will never call ctx.save
            ctx.save({"step": 1}, cfg["path"], rng=True)
        return "finished"

    if __name__ == "__main__":
        print(job({"path": sys.argv[1]}))
    """
)


@pytest.mark.slow
def test_rank0_only_save_with_rng_names_a_rank_that_finished_without_waiting(tmp_path: pathlib.Path) -> None:
    """Issue 24 item 4 (one check-in protocol): rng=True now checks in like mode='fsdp' does, so a rank that
    finished is seen at once, instead of rank 0 waiting the whole DISTFN_RNG_SAVE_WAIT (20 s) for it."""
    script = tmp_path / "rank0_only_return.py"
    script.write_text(_RANK0_ONLY_THEN_RETURN)
    start = time.monotonic()
    proc = run_python([str(script), str(tmp_path / "ckpt-1.safetensors")], env=clean_env(), timeout=150)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout
    assert "CheckpointError" in proc.stderr and "rank 1 went on without calling it" in proc.stderr, proc.stderr[-3000:]
    assert "rng=True" in proc.stderr and "if ctx.is_main:" in proc.stderr
    assert elapsed < 18, f"took {elapsed:.0f} s"
    assert not (tmp_path / "ckpt-1.safetensors").exists()


def test_a_resume_on_another_world_size_warns_once_per_job_with_every_ranks_choice(warnings_seen: list[str]) -> None:
    """Issue 44 item 7: the warning came once per rank (4 identical lines on 4 ranks); now rank 0 says it once,
    naming what every rank takes."""
    entry = checkpoint.combine_rng_states([checkpoint.rng_state(), checkpoint.rng_state()])
    for rank in range(4):
        assert checkpoint.rng_state_for_rank(entry, rank, 4) is entry["ranks"][rank % 2]
    assert [w.strip() for w in warnings_seen] == [
        "RNG states were saved by 2 ranks, this job has 4: rank r takes saved rank r % 2 (0 -> 0, 1 -> 1, 2 -> 0, "
        "3 -> 1); the run continues reproducibly, not bit for bit"]
    checkpoint.rng_state_for_rank(entry, 0, 2)  # the same world size: nothing to say
    assert len(warnings_seen) == 1


def test_the_step_snapshot_of_numpy_is_get_state_after_any_use_of_the_global_generator() -> None:
    """`raw_rng_state` reuses NumPy's last state while the generator has not moved (its C state compared byte for
    byte); whatever the program does to NumPy's global generator, what it returns is ``get_state()``'s answer."""
    from distfn import rng

    def same(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]

    np.random.seed(0)
    ops = [lambda: None, np.random.rand, np.random.randn, lambda: np.random.randn(3), np.random.standard_normal,
           lambda: np.random.seed(0), lambda: np.random.randint(5, size=700),  # refills the 624-word key
           lambda: np.random.set_state(np.random.get_state()),
           lambda: rng.set_rng_state({"numpy": rng.rng_state()["numpy"]})]
    pick = random.Random(1)
    for i in range(3000):  # a cached Gaussian handed out (has_gauss 1 -> 0, no draw) comes up hundreds of times
        pick.choice(ops)()
        assert same(rng.raw_rng_state()[1], np.random.get_state()), i
    assert rng._NUMPY_STATE._address  # the fast path was taken on this NumPy, not only the fallback


def test_the_step_snapshot_of_python_random_is_getstate_after_any_use_of_the_module() -> None:
    """The same for Python's ``random`` (its 625-int tuple reused while the generator has not moved)."""
    from distfn import rng

    ops = [lambda: None, random.random, random.gauss, lambda: random.gauss(0, 1),  # gauss caches its second value
           lambda: random.seed(3), lambda: random.setstate(random.getstate()), lambda: random.getrandbits(30_000),
           lambda: rng.set_rng_state({"python": rng.rng_state()["python"]})]
    pick = random.Random(5)
    for i in range(3000):
        pick.choice(ops)()
        assert rng.raw_rng_state()[0] == random.getstate(), i
    if sys.implementation.name == "cpython":
        assert rng._PYTHON_STATE._address  # the fast path was taken, not only the fallback
