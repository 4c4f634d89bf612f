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

The run (`distfn.run.Run`) starts one `CheckIn` per multi-rank run on its store channel (`distfn.rankstore`) and
decides which calls check in and which timeout applies (never longer than the run's collective deadline, so a
checked call is covered by it like every other collective distfn starts); `ctx.wrap` in `mode="fsdp"` registers
the run's sync point (`Run.sync_point`) as a forward pre-hook.
"""

from __future__ import annotations

import math
import time
from typing import Any, Final, Literal

import attrs
from loguru import logger

from .errors import CheckpointError
from .rankstore import Channel, poll

__all__ = ["RULES", "Call", "CheckIn", "CheckInTimeout", "Rule"]

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


class CheckInTimeout(CheckpointError):
    """A checked call waited past its deadline for ranks that left no trace: a hang of the job, which the hang
    report (`distfn.hangs`) explains with every rank's stack."""


@attrs.define
class CheckIn:
    """This rank's side of the protocol for one run: its keys on the run's channel and its counters.

    Attributes:
        channel: this run's check-in keys (`distfn.rankstore.Channel`; `start` opens one on a bare store).
        timeout: seconds a rank waits in `check_in` for ranks that leave no trace (see `Rule.rank0_times_out`).
        longer: how to allow a longer wait when the run's collective deadline, not the rule's own setting, bounds
            `timeout` (``None``: the rule's `Rule.longer`).
        calls: checked calls this rank entered.
        progress: sync points this rank reached.
    """

    channel: Channel
    timeout: float
    longer: str | None = None
    calls: int = 0
    progress: int = 0
    _finished: bool = attrs.field(default=False, init=False)

    @classmethod
    def start(cls, rank: int, world_size: int, timeout: float, store: Any, *, longer: str | None = None) -> CheckIn:
        """Start this rank's side for a run: on ``store``'s channel (the run's, ``run.channel.child("checkin")``),
        or on a bare store (the process group's, `default_store`), where it opens a channel of its own (no
        collective, see `distfn.rankstore.Channel.open`)."""
        channel = store if isinstance(store, Channel) else Channel.open(store, rank, world_size, "checkin")
        checkin = cls(channel, timeout, longer)
        checkin._post()
        return checkin

    @property
    def store(self) -> Any:
        """The process group's store (the channel's)."""
        return self.channel.store

    @property
    def prefix(self) -> str:
        """This run's check-in keys."""
        return self.channel.prefix

    @property
    def rank(self) -> int:
        """This rank."""
        return self.channel.rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.channel.world_size

    def _post(self, progress: int | None = None) -> None:
        self.channel.post("rank", f"{self.calls} {self.progress if progress is None else progress}")

    def _read_all(self) -> dict[int, tuple[int, int]]:
        """Every rank's posted ``(calls, progress)``."""
        out = {}
        for rank, raw in self.channel.read("rank").items():
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
            if wait_for_peers > 0 and not self.channel.wait(
                    [f"rank/{r}" for r in range(self.world_size)], wait_for_peers):
                logger.debug("check-in: not every rank started within {:g} s; leaving anyway", wait_for_peers)
            self._post(progress=_EXITED)
        except Exception as exc:  # noqa: BLE001 - the store may be gone when the job is being torn down
            logger.trace("check-in: could not post exit: {}", exc)

    def finished_ranks(self) -> list[int]:
        """The ranks that have ended their side (their function returned or failed): read by the hang report,
        which must not wait for an answer from a rank that left."""
        return sorted(r for r, (_, progress) in self._read_all().items() if progress == _EXITED)

    def note_progress(self) -> None:
        """A sync point, which every rank reaches equally often in a correct program: post it, then raise if
        another rank waits in a checked call that this rank skipped."""
        if self._finished:
            return
        self.progress += 1
        self._post()  # post first, then look: with the waiting rank doing the opposite, one of the two notices
        pending = f"call/{self.calls + 1}"
        if self.channel.has(pending) and self._went_past(self.calls + 1):
            what = self.channel.get(pending + "/what").decode() if self.channel.has(pending + "/what") else "ctx.save"
            rule = RULES.get(what, RULES["ctx.save"])
            raise CheckpointError(
                f"rank {self.rank} went on (a forward pass or a collective) while another rank is in {what} "
                f"(checkpoint call #{self.calls + 1}), which this rank never called. {what}{rule.scope} must be "
                f"called on every rank ({rule.why}), not under `if ctx.is_main:`."
            )

    def _went_past(self, number: int) -> bool:
        """Whether this rank's sync points now outnumber those of a rank waiting in checked call ``number`` when
        it entered it: only then did this rank go on without the call. A rank whose sync points are collectives of
        a subgroup (``ctx.all_reduce`` over the data-parallel ranks of a tensor-parallel mesh) may still be on its
        way to the call, at a sync point the waiting rank passed before it: that is no skipped call."""
        waiting = [progress for calls, progress in self._read_all().values() if calls >= number]
        return bool(waiting) and self.progress > min(waiting)

    def check_in(self, what: Call) -> None:
        """Wait until every rank has entered this checked call (all kinds share one count), or raise
        ``CheckpointError`` naming a rank that went on without it, or `CheckInTimeout` after `timeout`."""
        rule = RULES[what]
        self.calls += 1
        number = self.calls
        self._post()
        key = f"call/{number}"
        self.channel.set(key + "/what", what)  # before the key exists: whoever sees the key can name the call
        everyone = f"call/{number}/all"
        if self.channel.add(key) >= self.world_size:
            self.channel.set(everyone, "1")  # the last to arrive releases the others
            return
        start = time.monotonic()
        deadline = math.inf if rule.rank0_times_out and self.rank != 0 else start + self.timeout
        # Ranks normally arrive within milliseconds of each other: the channel's back-off polls fast, then a few
        # times a second. The others' progress is read only after a while, once a second: two store round trips
        # per waiting rank, so a large world does not flood the store.
        next_scan = start + 0.5
        for _ in poll():
            if self.channel.has(everyone):
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
                raise CheckInTimeout(
                    f"{what}{rule.scope} must be called on every rank ({rule.why}); rank {self.rank} waited "
                    f"{self.timeout:g} s in {what} (checkpoint call #{number}) and rank(s) {missing or 'unknown'} "
                    f"did not arrive. Call {what} on every rank (not under `if ctx.is_main:`); if some rank "
                    f"legitimately arrives much later, {self.longer or rule.longer}."
                )
