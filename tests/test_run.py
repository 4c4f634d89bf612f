"""distfn.run and distfn.checkin: a call's state lives on its Run (two runs in one process never see each
other's), and the one "did every rank call this?" protocol, driven here by threads sharing one store."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from distfn import distributed
from distfn.checkin import CheckIn
from distfn.context import Context
from distfn.errors import CheckpointError
from distfn.fsdp_options import FsdpOptions
from distfn.run import Run


def _pair(timeout: float = 30.0) -> tuple[CheckIn, CheckIn]:
    store = dist.HashStore()
    zero, one = (CheckIn.start(rank, 2, timeout, store) for rank in (0, 1))
    return zero, one


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; the dict gets its ``"error"`` (or ``"ok"``) and ``"seconds"``."""
    out: dict[str, Any] = {}

    def target() -> None:
        start = time.monotonic()
        try:
            fn()
            out["ok"] = True
        except CheckpointError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


# -- the check-in protocol ------------------------------------------------------------------------------------
def test_every_rank_checking_in_releases_all_of_them() -> None:
    zero, one = _pair()
    thread, out = _in_thread(lambda: one.check_in("ctx.save"))
    zero.check_in("ctx.save")
    thread.join(10)
    assert out.get("ok") and zero.calls == one.calls == 1


def test_runs_on_one_store_get_their_own_keys_without_a_collective() -> None:
    store = dist.HashStore()
    first, second = (CheckIn.start(0, 2, 1.0, store) for _ in range(2))
    assert first.prefix != second.prefix


def test_a_rank_that_finished_is_named_within_seconds_not_after_the_wait() -> None:
    zero, one = _pair(timeout=60.0)
    one.finish()
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        zero.check_in("ctx.save(..., rng=True)")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "rank 1 went on" in message and "rng=True" in message and "if ctx.is_main:" in message


def test_a_rank_at_a_sync_point_sees_the_call_it_skipped() -> None:
    zero, one = _pair()
    thread, out = _in_thread(lambda: zero.check_in("ctx.load"))
    while not one.store.check([zero.prefix + "call/1"]):
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match=r"rank 1 went on \(a forward pass or a collective\) while another "
                                              r"rank is in ctx\.load"):
        one.note_progress()
    thread.join(10)
    assert "ctx.load in mode='fsdp' must be called on every rank" in out["error"] and out["seconds"] < 10


def test_fsdp_calls_time_out_on_every_rank() -> None:
    _zero, one = _pair(timeout=0.5)
    with pytest.raises(CheckpointError, match=r"ctx\.save in mode='fsdp' must be called on every rank.*waited "
                                              r"0\.5 s.*save_timeout"):
        one.check_in("ctx.save")


def test_with_rng_only_rank0_times_out_the_others_wait_for_it() -> None:
    """Rank 0 may legitimately arrive late (an evaluation first): the others wait for it past the timeout."""
    zero, one = _pair(timeout=0.3)
    thread, out = _in_thread(lambda: one.check_in("ctx.save(..., rng=True)"))
    time.sleep(1.5)
    assert thread.is_alive() and not out
    zero.check_in("ctx.save(..., rng=True)")
    thread.join(10)
    assert out.get("ok")
    lonely, _ = _pair(timeout=0.3)
    with pytest.raises(CheckpointError, match=r"waited 0\.3 s.*DISTFN_RNG_SAVE_WAIT"):
        lonely.check_in("ctx.save(..., rng=True)")


def test_after_finish_sync_points_are_not_noted() -> None:
    zero, _ = _pair()
    zero.finish()
    zero.note_progress()
    assert zero.progress == 0


# -- the Run: which calls check in, one check-in per save --------------------------------------------------------
def _ctx(mode: Any, run: Run) -> Context:
    return Context(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   device=torch.device("cpu"), backend="gloo", mode=mode, launcher="local", run=run)


def _world_of_one_run(mode: Any) -> Run:
    run = Run(mode=mode)
    run.checkin = CheckIn.start(0, 1, 5.0, dist.HashStore())
    return run


def test_an_fsdp_save_with_rng_checks_in_once(tmp_path: Path) -> None:
    """Issue 24: ctx.save(..., rng=True) in mode='fsdp' ran two check-in protocols one after the other."""
    run = _world_of_one_run("fsdp")
    ctx = _ctx("fsdp", run)
    ctx.save({"w": torch.ones(2), "step": 1}, tmp_path / "a.safetensors", rng=True)
    assert run.checkin is not None and run.checkin.calls == 1


def test_outside_fsdp_only_a_save_with_rng_checks_in(tmp_path: Path) -> None:
    run = _world_of_one_run("ddp")
    ctx = _ctx("ddp", run)
    ctx.save({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    ctx.load(tmp_path / "a.safetensors", into={"w": torch.zeros(2)})
    assert run.checkin is not None and run.checkin.calls == 0
    ctx.save({"w": torch.ones(2)}, tmp_path / "b.safetensors", rng=True)
    assert run.checkin.calls == 1
    assert run.check_in("ctx.load") is False and Run().check_in("ctx.save", rng=True) is False


def test_sync_points_are_noted_in_fsdp_only() -> None:
    fsdp_run, ddp_run = _world_of_one_run("fsdp"), _world_of_one_run("ddp")
    for run in (fsdp_run, ddp_run):
        run.sync_point()
    assert fsdp_run.checkin is not None and fsdp_run.checkin.progress == 1
    assert ddp_run.checkin is not None and ddp_run.checkin.progress == 0


def test_a_loader_of_an_earlier_run_does_not_close_this_runs_window() -> None:
    """The last loader was a process global: a loader left at its last batch by one decorated call made the first
    `with acc:` of the next call close its window (step) after one micro-batch instead of `every`."""
    kept: list[Any] = []

    @distributed(mode="single")
    def first(cfg: Any, ctx: Context) -> bool:
        loader = ctx.dataloader(TensorDataset(torch.arange(4.0)), 2, shuffle=False)
        batches = iter(loader)
        for _ in range(len(loader)):
            next(batches)  # the last batch is out, the iteration not finished
        kept.append((loader, batches))
        return loader.at_last_batch()

    @distributed(mode="single")
    def second(cfg: Any, ctx: Context) -> bool:
        acc = ctx.accumulate(nn.Linear(1, 1), every=2)
        with acc:
            pass
        return acc.sync

    assert first() is True
    assert second() is False


def test_two_runs_keep_their_own_stop_signals() -> None:
    # The objects themselves are kept, not their id()s: the first run's may be freed before the second starts,
    # and a new object can then get the same id (flaky under load).
    seen: list[Any] = []

    @distributed(mode="single")
    def job(cfg: Any, ctx: Context) -> bool:
        seen.append(ctx.run.stop)
        return ctx.should_stop

    stopped_one, stopped_two = job(), job()
    assert len(seen) == 2 and seen[0] is not seen[1] and not stopped_one and not stopped_two


def test_ctx_wrap_shards_by_the_options_of_the_run_it_belongs_to() -> None:
    """The fsdp={...} options ctx.wrap used came from a module global set by the bootstrap, not from the Context."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        by_class = Run(mode="fsdp", fsdp=FsdpOptions(module_classes=("Block",)))
        by_size = Run(mode="fsdp", fsdp=FsdpOptions(min_params=10**9))
        a = _ctx("fsdp", by_class).wrap(nn.Sequential(Block(), Block()))
        b = _ctx("fsdp", by_size).wrap(nn.Sequential(Block(), Block()))
        units = [sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")) for model in (a, b)]
        assert units == [["", "0", "1"], [""]]
        assert list(by_class.wrapped) == [a] and list(by_size.wrapped) == [b]
        by_class.start_check_in(0, 1)  # on the group's store, as the bootstrap does: forwards are sync points
        a(torch.zeros(1, 4))
        assert by_class.checkin is not None and by_class.checkin.progress == 1
        by_class.finish()
    finally:
        dist.destroy_process_group()


def test_a_rank_that_ends_at_once_waits_until_every_peer_has_its_group_up() -> None:
    """A function that returns at once must not tear its process group down while a peer is still setting its up
    (gloo: "connectFullMesh failed ... Connection closed by peer" on the peer, seen about once in 20 runs)."""
    store = dist.HashStore()
    zero = CheckIn.start(0, 2, 5.0, store)
    done = threading.Event()
    ender = threading.Thread(target=lambda: (zero.finish(wait_for_peers=30.0), done.set()))
    ender.start()
    assert not done.wait(0.5)  # rank 1 has not started: rank 0 does not leave
    CheckIn.start(1, 2, 5.0, store)  # rank 1's group is up
    assert done.wait(5.0)
    ender.join()


def test_a_failed_rank_or_a_peer_that_never_starts_does_not_hold_the_end() -> None:
    store = dist.HashStore()
    start = time.monotonic()
    CheckIn.start(0, 2, 5.0, store).finish()  # after a failure: no wait at all
    CheckIn.start(0, 2, 5.0, store).finish(wait_for_peers=0.3)  # a peer that died before its group was up
    assert time.monotonic() - start < 5.0
