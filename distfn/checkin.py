"""The one "did every rank call this?" protocol: a call that is a collective, made on some ranks only, becomes an
error instead of a hang.

Gathering a full state dict (``ctx.save`` in ``mode="fsdp"``), handing out shards (``ctx.load`` into a sharded
model) and gathering every rank's generator states (``ctx.save(..., rng=True)``) are collectives. If only rank 0
calls one (the habit from DDP mode: ``if ctx.is_main: ctx.save(...)``), rank 0 blocks in it while the other ranks
block in their next collective, and the job hangs until the 30-minute collective timeout, or worse, pairs
mismatched collectives. So before those collectives every rank checks in through the process group's key-value
store (no collective) and waits for the others (`CheckIn.check_in`).

A rank that skips the call is caught by positive evidence rather than a guess: every rank posts
``(calls, progress)`` to the store at start, at each *sync point* (`CheckIn.note_progress`: in ``mode="fsdp"`` a
forward of a wrapped model and a distfn collective such as ``ctx.barrier()`` / ``ctx.all_reduce``) and on exit
(`CheckIn.finish`). In a correct program every rank reaches the same number of sync points between two checked
calls.

* a rank that reaches a sync point while another rank waits in checked call number ``k`` it never started sees
  the pending check-in and raises at once;
* a waiting rank that sees another rank past the call (more progress than itself, or finished) without having
  checked in raises within about a second;
* anything else (e.g. the other rank blocked in a raw ``torch.distributed`` call) ends after the run's timeout
  with the same error instead of a silent hang. Each kind of call says who times out (`Rule`): for the fsdp
  calls every rank after ``save_timeout`` (default 300 s); for ``rng=True`` in the other modes rank 0 alone, after
  ``DISTFN_RNG_SAVE_WAIT`` (default 20 s), because rank 0 legitimately arrives late (an evaluation, logging)
  while the others wait for it.

The run (`distfn.run.Run`) starts one `CheckIn` per multi-rank run and decides which calls check in and which
timeout applies; `ctx.wrap` in `mode="fsdp"` registers the run's sync point (`Run.sync_point`) as a forward
pre-hook.
"""

from __future__ import annotations

import math
import time
from typing import Any, Final, Literal

import attrs
import torch.distributed as dist
from loguru import logger

from .errors import CheckpointError

__all__ = ["RULES", "Call", "CheckIn", "Rule", "default_store"]

_EXITED: Final = 2**62  # the progress a finished rank posts: "past every checked call"

#: The calls that check in, as the errors name them.
Call = Literal["ctx.save", "ctx.load", "ctx.save(..., rng=True)"]


@attrs.frozen
class Rule:
    """How the errors about one kind of checked call read, and who times out in it.

    Attributes:
        scope: where the rule holds, after the call's name (``" in mode='fsdp'"``, or empty: every mode).
        why: why every rank must make the call.
        longer: how to allow a longer wait, for a rank that legitimately arrives much later.
        rank0_times_out: only rank 0 gives up waiting (the others wait for it however long it takes).
    """

    scope: str
    why: str
    longer: str
    rank0_times_out: bool = False


_FSDP_LONGER: Final = "allow a longer wait with the fsdp option save_timeout (docs/modes.md)"

#: Every checked call's rule.
RULES: Final[dict[str, Rule]] = {
    "ctx.save": Rule(" in mode='fsdp'", "it gathers the sharded model, a collective; only rank 0 writes the file",
                     _FSDP_LONGER),
    "ctx.load": Rule(" in mode='fsdp'", "every rank receives its shard from rank 0, a collective", _FSDP_LONGER),
    "ctx.save(..., rng=True)": Rule(
        "", "gathering every rank's random generator states is a collective; only rank 0 writes the file",
        "raise DISTFN_RNG_SAVE_WAIT (seconds), or drop rng=True", rank0_times_out=True),
}


def default_store() -> Any | None:
    """The default process group's key-value store, or ``None`` when it has none (then nothing can be checked)."""
    try:
        return dist.distributed_c10d._get_default_store()  # private, but stable since torch 1.x
    except (AttributeError, RuntimeError, ValueError) as exc:
        logger.debug("no process-group store: {}", exc)
        return None


@attrs.define
class CheckIn:
    """This rank's side of the protocol for one run: its key prefix in the store and its counters.

    Attributes:
        store: the process group's key-value store.
        prefix: this run's keys in it (`start` numbers the runs, so an earlier run's keys never count).
        rank: this rank.
        world_size: the number of ranks.
        timeout: seconds a rank waits in `check_in` for ranks that leave no trace (see `Rule.rank0_times_out`).
        calls: checked calls this rank entered.
        progress: sync points this rank reached.
    """

    store: Any
    prefix: str
    rank: int
    world_size: int
    timeout: float
    calls: int = 0
    progress: int = 0
    _finished: bool = attrs.field(default=False, init=False)

    @classmethod
    def start(cls, rank: int, world_size: int, timeout: float, store: Any) -> CheckIn:
        """Start this rank's side for a run on ``store`` (the process group's, `default_store`).

        No collective: each rank counts the runs it started on this store (`store.add` of its own key), and
        every rank of a job runs the same sequence of them, so the n-th run gets the same prefix on every rank
        without a broadcast (which would be one more collective to get wrong), and a torchrun restart (a new
        store prefix) or a second decorated call on the same store starts with fresh keys.
        """
        number = int(store.add(f"distfn/checkin/runs/rank{rank}", 1))
        checkin = cls(store, f"distfn/checkin/run{number}/", rank, world_size, timeout)
        checkin._post()
        return checkin

    def _key(self, *parts: Any) -> str:
        return self.prefix + "/".join(map(str, parts))

    def _post(self, progress: int | None = None) -> None:
        self.store.set(self._key("rank", self.rank), f"{self.calls} {self.progress if progress is None else progress}")

    def _read_all(self) -> dict[int, tuple[int, int]]:
        """Every rank's posted ``(calls, progress)``, in two store round trips when all ranks have posted."""
        keys = [self._key("rank", r) for r in range(self.world_size)]
        if self.store.check(keys):
            values = dict(zip(range(self.world_size), self.store.multi_get(keys), strict=True))
        else:  # a rank that never got going: read the others one by one (get() would block on a missing key)
            values = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        out = {}
        for rank, raw in values.items():
            calls, progress = raw.decode().split()
            out[rank] = (int(calls), int(progress))
        return out

    def finish(self, *, wait_for_peers: float = 0.0) -> None:
        """End this rank's side; tells ranks waiting in a checked call that this one will never join it.

        Args:
            wait_for_peers: after a normal end, wait up to this many seconds until every rank has started its side
                (`start` runs right after the rank's process group is up). A rank whose function returns at once
                would otherwise tear its group down while a peer is still connecting, and gloo's mesh set-up on
                that peer fails with "connectFullMesh failed ... Connection closed by peer". Normally every rank
                has long started: one store round trip.
        """
        if self._finished:
            return
        self._finished = True
        try:
            if wait_for_peers > 0:
                self._wait_started(wait_for_peers)
            self._post(progress=_EXITED)
        except Exception as exc:  # noqa: BLE001 - the store may be gone when the job is being torn down
            logger.trace("check-in: could not post exit: {}", exc)

    def finished_ranks(self) -> list[int]:
        """The ranks that have ended their side (their function returned or failed): read by the hang report,
        which must not wait for an answer from a rank that left."""
        return sorted(r for r, (_, progress) in self._read_all().items() if progress == _EXITED)

    def _wait_started(self, seconds: float) -> None:
        keys = [self._key("rank", r) for r in range(self.world_size)]
        deadline, pause = time.monotonic() + seconds, 0.001
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                logger.debug("check-in: not every rank started within {:g} s; leaving anyway", seconds)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def note_progress(self) -> None:
        """A sync point, which every rank reaches equally often in a correct program: post it, then raise if
        another rank waits in a checked call that this rank skipped."""
        if self._finished:
            return
        self.progress += 1
        self._post()  # post first, then look: with the waiting rank doing the opposite, one of the two notices
        pending = self._key("call", self.calls + 1)
        if self.store.check([pending]):
            what = self.store.get(pending + "/what").decode() if self.store.check([pending + "/what"]) else "ctx.save"
            rule = RULES.get(what, RULES["ctx.save"])
            raise CheckpointError(
                f"rank {self.rank} went on (a forward pass or a collective) while another rank is in {what} "
                f"(checkpoint call #{self.calls + 1}), which this rank never called. {what}{rule.scope} must be "
                f"called on every rank ({rule.why}), not under `if ctx.is_main:`."
            )

    def check_in(self, what: Call) -> None:
        """Wait until every rank has entered this checked call (all kinds share one count), or raise
        ``CheckpointError`` naming a rank that went on without it, or after `timeout`."""
        rule = RULES[what]
        self.calls += 1
        number = self.calls
        self._post()
        key = self._key("call", number)
        self.store.set(key + "/what", what)  # before the key exists: whoever sees the key can name the call
        everyone = self._key("call", number, "all")
        if self.store.add(key, 1) >= self.world_size:
            self.store.set(everyone, "1")  # the last to arrive releases the others
            return
        start = time.monotonic()
        deadline = math.inf if rule.rank0_times_out and self.rank != 0 else start + self.timeout
        # Ranks normally arrive within milliseconds of each other: poll fast, then back off to 4 checks a second
        # (store.wait with a timeout would do, but TCPStore logs a C++ warning for every wait that times out). The
        # others' progress is read only after a while, once a second: two store round trips per waiting rank, so
        # a large world does not flood the store.
        pause, next_scan = 0.001, start + 0.5
        while True:
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
            if self.store.check([everyone]):
                return
            now = time.monotonic()
            if now < next_scan and now < deadline:
                continue
            next_scan = now + 1.0
            states = self._read_all()
            missing = [r for r in range(self.world_size) if r not in states or states[r][0] < number]
            for other in missing:
                if other in states and states[other][1] > self.progress:  # went past this call, or finished
                    raise CheckpointError(
                        f"{what}{rule.scope} must be called on every rank ({rule.why}). Rank {self.rank} is in "
                        f"{what} (checkpoint call #{number}) but rank {other} went on without calling it. Call "
                        f"{what} on every rank, not under `if ctx.is_main:`."
                    )
            if now >= deadline:
                raise CheckpointError(
                    f"{what}{rule.scope} must be called on every rank ({rule.why}); rank {self.rank} waited "
                    f"{self.timeout:g} s in {what} (checkpoint call #{number}) and rank(s) {missing or 'unknown'} "
                    f"did not arrive. Call {what} on every rank (not under `if ctx.is_main:`); if some rank "
                    f"legitimately arrives much later, {rule.longer}."
                )
