"""The check-in that makes a rank-0-only `ctx.save` / `ctx.load` in `mode="fsdp"` an error instead of a hang.

Gathering a full state dict is a collective. If only rank 0 calls ``ctx.save`` (the habit from DDP mode:
``if ctx.is_main: ctx.save(...)``), rank 0 would block in the all-gather while the other ranks block in their
next forward's all-gather, and the job would hang until the 30-minute collective timeout, or worse, pair
mismatched collectives. So before gathering, every rank checks in through the process group's key-value store
(no collective) and waits for the others. A rank that skips the save is caught by positive evidence rather than
a guess: every rank posts ``(saves, progress)`` to the store at each *sync point* (a forward of a wrapped model,
a distfn collective such as ``ctx.barrier()`` / ``ctx.all_reduce``) and on exit. In a correct program every rank
reaches the same number of sync points between two saves.

* a rank that reaches a sync point while another rank waits in save number ``k`` it never started sees the
  pending check-in and raises at once;
* a waiting rank that sees another rank past the save point (more progress than itself, or finished) without
  having checked in raises within about a second;
* anything else (e.g. the other rank blocked in a raw ``torch.distributed`` call) ends after ``save_timeout``
  seconds (default 300) with the same error instead of a silent hang.

`distfn.fsdp` uses it: `fsdp.wrap` registers `note_progress` as a forward pre-hook, `fsdp.save` / `fsdp.load`
call `check_in`, and `worker.run` calls `fsdp.begin` / `fsdp.finish`, which start and end the bookkeeping here.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

import attrs
import torch.distributed as dist
from loguru import logger

from . import collectives
from .errors import CheckpointError

__all__ = ["begin", "check_in", "finish", "note_progress"]

_EXITED: Final = 2**62  # the progress a finished rank posts: "past every save point"


@attrs.define
class Run:
    """This rank's view of the current fsdp run's save bookkeeping in the store."""

    store: Any
    prefix: str
    rank: int
    world_size: int
    save_timeout: float
    saves: int = 0  # gathering saves this rank started
    progress: int = 0  # sync points this rank reached: forwards of wrapped models and distfn collectives

    def key(self, *parts: Any) -> str:
        return self.prefix + "/".join(map(str, parts))

    def post(self, progress: int | None = None) -> None:
        self.store.set(self.key("rank", self.rank), f"{self.saves} {self.progress if progress is None else progress}")

    def read_all(self) -> dict[int, tuple[int, int]]:
        """Every rank's posted ``(saves, progress)``, in two store round trips when all ranks have posted."""
        keys = [self.key("rank", r) for r in range(self.world_size)]
        if self.store.check(keys):
            values = dict(zip(range(self.world_size), self.store.multi_get(keys), strict=True))
        else:  # a rank that never got going: read the others one by one (get() would block on a missing key)
            values = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        out = {}
        for rank, raw in values.items():
            saves, progress = raw.decode().split()
            out[rank] = (int(saves), int(progress))
        return out


_RUN: Run | None = None


def begin(rank: int, world_size: int, save_timeout: float) -> None:
    """Start this rank's bookkeeping for an fsdp run. Collective (one broadcast): call on every rank right after
    the process group is up.

    The run gets a fresh key prefix from rank 0, so keys of an earlier run in the same store (torchrun restarts,
    several decorated calls in one process) never count.
    """
    global _RUN
    token = collectives.broadcast_object(secrets.token_hex(8) if rank == 0 else None)
    try:
        store = dist.distributed_c10d._get_default_store()  # private, but stable since torch 1.x
    except (AttributeError, RuntimeError) as exc:
        logger.warning("fsdp: no process-group store ({}); ctx.save on rank 0 only cannot be detected", exc)
        store = None
    _RUN = Run(store, f"distfn/fsdp/{token}/", rank, world_size, save_timeout)
    if store is not None:
        _RUN.post()
        collectives.SYNC_HOOKS.append(note_progress)


def finish() -> None:
    """End this rank's bookkeeping; tells ranks waiting in a save that this one will never join it."""
    global _RUN
    run, _RUN = _RUN, None
    if note_progress in collectives.SYNC_HOOKS:
        collectives.SYNC_HOOKS.remove(note_progress)
    if run is not None and run.store is not None:
        try:
            run.post(progress=_EXITED)
        except Exception as exc:  # noqa: BLE001 - the store may be gone when the job is being torn down
            logger.trace("fsdp: could not post exit: {}", exc)


_WHY: Final = {
    "ctx.save": "it gathers the sharded model, a collective; only rank 0 writes the file",
    "ctx.load": "every rank receives its shard from rank 0, a collective",
}


def _skip_message(what: str, rank: int, number: int, late_rank: int) -> str:
    return (f"{what} in mode='fsdp' must be called on every rank ({_WHY[what]}). Rank {rank} is in {what} "
            f"(checkpoint call #{number}) but rank {late_rank} went on without calling it. Call {what} on every "
            "rank, not under `if ctx.is_main:`.")


def note_progress() -> None:
    """A sync point: a forward of a wrapped model or a distfn collective, which every rank reaches equally often
    in a correct program. Post it, then raise if another rank waits in a ``ctx.save`` this rank skipped."""
    run = _RUN
    if run is None or run.store is None:
        return
    run.progress += 1
    run.post()  # post first, then look: with the saver doing the opposite, one of the two always notices
    pending = run.key("save", run.saves + 1)
    if run.store.check([pending]):
        what = run.store.get(pending + "/what").decode() if run.store.check([pending + "/what"]) else "ctx.save"
        raise CheckpointError(
            f"rank {run.rank} went on (a forward pass or a collective) while another rank is in {what} (checkpoint "
            f"call #{run.saves + 1}), which this rank never called. In mode='fsdp' {what} must be called on every "
            f"rank ({_WHY.get(what, 'a collective')}), not under `if ctx.is_main:`."
        )


def check_in(what: str) -> None:
    """Every rank calls this before the collectives of a checkpoint call (``what``: ``"ctx.save"`` or
    ``"ctx.load"``): it returns once all ranks are in, and raises ``CheckpointError`` naming a rank that went on
    without calling it (or after ``save_timeout``). A no-op outside an fsdp run."""
    if _RUN is not None and _RUN.store is not None:
        _check_in(_RUN, what)


def _check_in(run: Run, what: str) -> None:
    """Wait until every rank has entered this checkpoint call (``what``: ``"ctx.save"`` or ``"ctx.load"``, which
    share one count), or raise ``CheckpointError`` naming the rank that will not."""
    run.saves += 1
    number = run.saves
    run.post()
    key = run.key("save", number)
    run.store.set(key + "/what", what)  # before the key exists: whoever sees the key can name the call
    everyone = run.key("save", number, "all")
    if run.store.add(key, 1) >= run.world_size:
        run.store.set(everyone, "1")  # the last to arrive releases the others
        return
    start = time.monotonic()
    deadline = start + run.save_timeout
    # Ranks normally arrive within milliseconds of each other: poll fast, then back off to 4 checks a second
    # (store.wait with a timeout would do, but TCPStore logs a C++ warning for every wait that times out). The
    # others' progress is read only after a while, once a second: two store round trips per waiting rank, so a
    # large world does not flood the store.
    pause, next_scan = 0.001, start + 0.5
    while True:
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
        if run.store.check([everyone]):
            return
        now = time.monotonic()
        if now < next_scan and now < deadline:
            continue
        next_scan = now + 1.0
        states = run.read_all()
        missing = [r for r in range(run.world_size) if r not in states or states[r][0] < number]
        for other in missing:
            if other in states and states[other][1] > run.progress:  # went past this save point, or finished
                raise CheckpointError(_skip_message(what, run.rank, number, other))
        if now >= deadline:
            raise CheckpointError(
                f"{what} in mode='fsdp' must be called on every rank; rank {run.rank} waited "
                f"{run.save_timeout:g} s in {what} (checkpoint call #{number}) and rank(s) "
                f"{missing or 'unknown'} did not arrive. Call {what} on every rank (not under `if ctx.is_main:`); "
                "if some rank legitimately "
                "arrives much later, allow a longer wait with the fsdp option for it (docs/modes.md)."
            )
