"""The ledger: which collectives this process entered, so that a hang report can say which one each rank is in.

The classic deadlock of distributed training is two ranks in *different* collectives (one called under
``if ctx.is_main:``, or in a different order): each waits for the other forever. Stacks show where each rank is;
the ledger says which collective it is by number, so the report can put it in one line ("rank 1 is in
broadcast_object #57 (train.py:52); rank 0 is in all_reduce #57 (train.py:40)", `disagreement`).

Each entry is ``(seq, op, call site)``: ``seq`` counts the collectives of this process since the run started,
``op`` is distfn's name for it, the call site is the first frame outside distfn (the user's line, or the
checkpoint code's caller). Recorded for what distfn can see: every ``ctx`` collective and barrier and the
checkpoint's gathers (all go through `distfn.collectives`), and DDP's gradient all-reduces by count (a forward
pre-hook on the wrapped model counts the steps whose backward all-reduces). A raw ``torch.distributed`` call in
user code is not seen.

The ledger is per process, like the main thread it describes (collectives on other threads, the background
checkpoint's own gloo group, are not recorded): `reset` starts it afresh for each run. Cost: a tuple appended to a
ring and a short frame walk per collective, about 1.5 µs (``bench/bench_collectives.py`` shows what distfn adds per
call); nothing per DDP step but a counter.

Imports `failures` (the phrase naming ranks) only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, Final

import attrs

from .failures import ranks_phrase

# distfn's own frames, and contextlib's (the frames between one of distfn's generator-based context managers and
# the code that entered it)
_SKIPPED = (os.path.dirname(os.path.abspath(__file__)), contextlib.__file__)

__all__ = ["LEDGER", "Entry", "Ledger", "RankState", "disagreement"]

#: Entries kept per rank (the report shows the last few; older ones drop out of the ring).
RING_SIZE: Final = 64


@attrs.frozen
class Entry:
    """One collective this process entered: its number, distfn's name for it, and the caller's ``file:line``."""

    seq: int
    op: str
    site: str

    def text(self) -> str:
        return f"{self.op} #{self.seq} ({self.site})"


@attrs.frozen
class RankState:
    """What a rank's ledger says at the moment of a report (travels through the store as a plain dict).

    Attributes:
        rank: the rank.
        last: its most recent entry, or ``None`` when it entered no collective yet.
        inside: whether it is inside ``last`` right now (entered, not yet returned).
        ddp_steps: forwards of DDP-wrapped models so far (each one's backward all-reduces the gradients).
        tail: its last few entries, oldest first.
    """

    rank: int
    last: Entry | None
    inside: bool
    ddp_steps: int = 0
    tail: tuple[Entry, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankState:
        last = data.get("last")
        return cls(rank=int(data["rank"]), last=Entry(**last) if last else None, inside=bool(data["inside"]),
                   ddp_steps=int(data.get("ddp_steps", 0)), tail=tuple(Entry(**e) for e in data.get("tail", ())))

    def where(self) -> str:
        """What this rank is doing, collective-wise, in a few words (after "is"/"are")."""
        if self.last is None:
            return "in no collective yet"
        if self.inside:
            return f"in {self.last.text()}"
        return f"not in a collective (last left {self.last.text()})"


def _site_name(path: str) -> str | None:
    """The basename a frame of ``path`` is reported as, or ``None`` for a frame the call site skips (distfn's
    own, ``contextlib``'s, torch's ``nn`` module call machinery)."""
    if path.startswith(_SKIPPED) or "torch" + os.sep + "nn" + os.sep in path:
        return None
    return os.path.basename(path)


#: `_site_name` per source path, filled as frames are seen: a collective's frame walk is then a dictionary
#: look-up per frame instead of string tests (a program has few source files, so it stays small).
_SITE_NAMES: dict[str, str | None] = {}


def _site(frame: FrameType | None) -> tuple[str | None, int]:
    """The first frame from ``frame`` outwards that the call site names, as ``(basename, line)``; ``(None, 0)``
    when there is none. Kept apart from its text (`_site_text`): the ledger formats it only when read."""
    names = _SITE_NAMES
    while frame is not None:
        path = frame.f_code.co_filename
        try:
            name = names[path]
        except KeyError:
            name = names[path] = _site_name(path)
        if name is not None:
            return name, frame.f_lineno
        frame = frame.f_back
    return None, 0


def _site_text(name: str | None, line: int) -> str:
    return "?" if name is None else f"{name}:{line}"


def call_site() -> str:
    """``file:line`` of the first frame outside distfn (and outside torch's ``nn`` module call machinery)."""
    return _site_text(*_site(sys._getframe(1)))


#: One ring slot: ``(seq, op, basename, line)``; an `Entry` is made from it only when the ledger is read (a
#: report, a test), not on every collective (measured: an attrs `Entry` and its ``file:line`` text were 1 µs of
#: the 3.5 µs an entry cost).
_Slot = tuple[int, str, str | None, int]


class _Entered:
    """The ``with`` block of one kind of collective (`Ledger.entered`). One instance per op and ledger, reused:
    it keeps no state of its own (the nesting depth is the ledger's), so a collective pays no allocation; a
    plain class rather than a generator-based context manager, which costs about twice as much per call."""

    __slots__ = ("_ledger", "_op")

    def __init__(self, ledger: Ledger, op: str) -> None:
        self._ledger, self._op = ledger, op

    def __enter__(self) -> None:
        book = self._ledger
        if threading.get_ident() != book._main:  # another thread: not recorded
            return
        book._depth += 1
        if book._depth > 1:  # nested: part of the outer collective
            return
        book.seq += 1
        book._ring.append((book.seq, self._op, *_site(sys._getframe(1))))
        book.inside_since, book.failed = time.monotonic(), False

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        book = self._ledger
        if threading.get_ident() != book._main:
            return
        book._depth -= 1
        if book._depth == 0:
            book.failed = kind is not None  # a collective that raised (a timeout): the rank is still "in" it
            if book.gpu_event is not None and kind is None:
                book._queue(book.inside_since)
            book.inside_since = None


def _entry(slot: _Slot) -> Entry:
    seq, op, name, line = slot
    return Entry(seq, op, _site_text(name, line))


@attrs.define
class Ledger:
    """This process's ring of collectives (see the module docstring); ``inside_since`` is the monotonic time the
    current collective was entered (``None`` outside one), which the NCCL deadline watch reads."""

    seq: int = 0
    ddp_steps: int = 0
    inside_since: float | None = None
    #: the last collective raised (a timeout): the rank is still "in" it for the report
    failed: bool = False
    _main: int = attrs.field(factory=threading.get_ident)
    _ring: collections.deque[_Slot] = attrs.field(factory=lambda: collections.deque(maxlen=RING_SIZE))
    #: how many `entered` blocks the main thread is in (more than one: a collective inside another)
    _depth: int = 0
    _blocks: dict[str, _Entered] = attrs.field(factory=dict)
    #: Under NCCL (the hang responder sets it, `distfn.hangs`): makes an event recorded on the current CUDA stream
    #: (``None`` when it cannot, e.g. while a CUDA graph is captured).
    #: A collective's host call may return once it is queued (a CUDA tensor's all-reduce); the event, recorded as
    #: the call returns, is passed only when the GPU has finished it, so the deadline watch still sees it.
    gpu_event: Callable[[], Any] | None = None
    #: (event, entered at, seq) of the collectives the GPU may not have finished, oldest first
    _queued: collections.deque[tuple[Any, float, int]] = attrs.field(factory=collections.deque)

    def _queue(self, since: float | None) -> None:
        """Main thread, a collective's host call returned: drop the finished ones (their events passed), note it.
        Never raises into the collective's caller: a CUDA error here (a torn-down context) ends the watch."""
        queued, make = self._queued, self.gpu_event
        try:
            while queued and queued[0][0].query():
                queued.popleft()
            event = make() if make is not None and since is not None and len(queued) < RING_SIZE else None
        except Exception:  # noqa: BLE001 - the watch is a diagnosis aid; the collective itself succeeded
            self.gpu_event = None
            queued.clear()
            return
        if event is not None and since is not None:  # (full: the oldest ones are what matters)
            queued.append((event, since, self.seq))

    def gpu_overdue(self, now: float, timeout_s: float, query: Callable[[Any], bool]) -> Entry | None:
        """The oldest collective whose host call returned more than ``timeout_s`` ago and that the GPU has not
        finished (``query(event)`` false), or ``None`` (any thread: the main thread only appends and pops)."""
        try:
            event, since, seq = self._queued[0]
        except IndexError:
            return None
        if now - since <= timeout_s or query(event):
            return None
        slot = next((s for s in list(self._ring) if s[0] == seq), None)
        return _entry(slot) if slot is not None else Entry(seq, "a collective", "?")

    @property
    def entries(self) -> list[Entry]:
        """The recorded entries, oldest first (at most `RING_SIZE`)."""
        return [_entry(slot) for slot in list(self._ring)]

    def reset(self) -> None:
        """Start afresh (a new run in this process); the calling thread is the one recorded."""
        self._ring.clear()
        self.seq = self.ddp_steps = self._depth = 0
        self.inside_since = None
        self.failed = False
        self._main = threading.get_ident()
        self.gpu_event = None
        self._queued.clear()

    def entered(self, op: str) -> contextlib.AbstractContextManager[None]:
        """Record ``op`` for the duration of the ``with`` block (the collective itself); other threads are not
        recorded (the ledger describes the main thread, whose stack the report shows), nor a collective inside
        another (e.g. the tensor all-reduce inside that of a Python number)."""
        try:
            return self._blocks[op]
        except KeyError:
            block = self._blocks[op] = _Entered(self, op)
            return block

    def count_ddp_step(self, *_: Any) -> None:
        """A forward pre-hook of a DDP-wrapped model: one more step whose backward all-reduces the gradients."""
        self.ddp_steps += 1

    def state(self, rank: int, tail: int = 5) -> RankState:
        """This rank's ledger now (read from any thread: a deque snapshot is atomic under the GIL)."""
        slots = list(self._ring)
        inside = self.inside_since is not None or self.failed
        return RankState(rank=rank, last=_entry(slots[-1]) if slots else None, inside=inside,
                         ddp_steps=self.ddp_steps, tail=tuple(_entry(s) for s in slots[-tail:]))


#: This process's ledger (reset by the rank bootstrap at the start of each run).
LEDGER: Final = Ledger()


def disagreement(states: Sequence[RankState]) -> str | None:
    """One line saying where the ranks' ledgers disagree, or ``None`` when they agree (or say nothing).

    Ranks are grouped by what they are doing (`RankState.where`); with more than one group the line names each,
    largest group last: "rank 1 is in broadcast_object #3 (train.py:9); ranks 0, 2 are in all_reduce #3
    (train.py:7)". DDP step counts that differ are named too (a rank that skipped a step's backward).
    """
    if len(states) < 2:
        return None
    groups: dict[str, list[int]] = {}
    for s in sorted(states, key=lambda s: s.rank):
        groups.setdefault(s.where(), []).append(s.rank)
    parts = []
    if len(groups) > 1:
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
        parts.append("; ".join(f"{ranks_phrase(ranks)} {'is' if len(ranks) == 1 else 'are'} {where}"
                               for where, ranks in ordered))
    steps: dict[int, list[int]] = {}
    for s in states:
        steps.setdefault(s.ddp_steps, []).append(s.rank)
    if len(steps) > 1:
        parts.append("DDP steps so far: " + "; ".join(f"{ranks_phrase(sorted(r))} {n}"
                                                      for n, r in sorted(steps.items())))
    return "; ".join(parts) or None
