"""The one channel every cross-rank service of a run speaks over the process group's key-value store.

The check-in (`distfn.checkin`), the start-up fingerprint (`distfn.fingerprint`), the hang report
(`distfn.hangs`) and the timings exchange (`distfn.timings`) each exchange a few small values between ranks
without a collective: a collective would be one more thing to get wrong on exactly the paths that exist to catch
ranks that went wrong. They share three rules, written here once:

* **run-scoped keys**: `Channel.open` numbers the runs on a store without a collective (each rank ``add``s its own
  counter, and every rank of a job opens the same sequence of runs, so the n-th run gets the same prefix
  everywhere); a second decorated call, or a torchrun restart on the same store, starts with fresh keys.
  `Channel.child` gives each service its own part of the run's keys;
* **post mine, read all**: `post` writes this rank's value under a name, `read` / `read_all` take every rank's
  in two store round trips (``check`` of all, one ``multi_get``), one by one only when some rank has not posted
  (a blocking ``get`` of a missing key would hang);
* **one back-off** (`poll`): a wait polls from 1 ms, doubling up to `MAX_PAUSE`, until its deadline. It polls
  rather than ``store.wait(keys, timeout)`` because TCPStore logs a C++ warning for every wait that times out.

Nothing else in distfn touches a store (``tests/test_layout.py`` checks it), apart from the rendezvous that makes
one. The torch elastic analogue is ``torch/distributed/elastic/utils/store.py``.

Imports nothing from distfn.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any, Final

import attrs
import torch.distributed as dist
from loguru import logger

__all__ = ["MAX_PAUSE", "Channel", "default_store", "poll"]

#: The longest pause between two looks at the store while waiting (a waiting rank asks at most 10 times a second).
MAX_PAUSE: Final = 0.1
_FIRST_PAUSE: Final = 0.001


def poll(seconds: float = math.inf, *, first: float = _FIRST_PAUSE) -> Iterator[float]:
    """The one back-off: yield the seconds left (at once, then after each pause), pausing from ``first``, doubling
    up to `MAX_PAUSE`, until ``seconds`` have passed (``math.inf``: until the caller stops iterating)."""
    deadline = time.monotonic() + seconds
    pause = first
    while True:
        left = deadline - time.monotonic()
        yield max(left, 0.0)
        if left <= 0:
            return
        time.sleep(min(pause, left))
        pause = min(2 * pause, MAX_PAUSE)


def default_store() -> Any | None:
    """The default process group's key-value store, or ``None`` when it has none (then nothing can be checked)."""
    try:
        return dist.distributed_c10d._get_default_store()  # private, but stable since torch 1.x
    except (AttributeError, RuntimeError, ValueError) as exc:
        logger.debug("no process-group store: {}", exc)
        return None


@attrs.frozen
class Channel:
    """One run's keys on the store, as seen by one rank (see the module docstring).

    Attributes:
        store: the process group's key-value store (``torch.distributed.Store``, or anything with its methods).
        prefix: every key of this channel starts with it (``distfn/run3/checkin/``).
        rank: this rank.
        world_size: the number of ranks.
    """

    store: Any
    prefix: str
    rank: int
    world_size: int

    @classmethod
    def open(cls, store: Any, rank: int, world_size: int, name: str = "run") -> Channel:
        """This rank's channel for the next run of ``name`` on ``store`` (one ``add``; no collective)."""
        number = int(store.add(f"distfn/{name}/runs/rank{rank}", 1))
        return cls(store, f"distfn/{name}{number}/", rank, world_size)

    def child(self, name: str) -> Channel:
        """The part of this run's keys that belongs to one service (``run.channel.child("hang")``)."""
        return attrs.evolve(self, prefix=f"{self.prefix}{name}/")

    def clone(self) -> Channel:
        """The same keys on a connection of its own (`Store.clone`), for another thread: two threads must not share
        a socket. Raises ``AttributeError`` / ``RuntimeError`` for a store that cannot be cloned."""
        return attrs.evolve(self, store=self.store.clone())

    def key(self, *parts: Any) -> str:
        """The full key of ``parts`` under this channel."""
        return self.prefix + "/".join(map(str, parts))

    # -- one key ------------------------------------------------------------------------------------------------
    def set(self, name: str, value: str) -> None:
        """Write ``value`` under ``name`` (a key of the run, not of one rank)."""
        self.store.set(self.key(name), value)

    def get(self, name: str) -> bytes:
        """The value under ``name``; call it only once `has` said it is there (a missing key blocks)."""
        return bytes(self.store.get(self.key(name)))

    def add(self, name: str, amount: int = 1) -> int:
        """Add ``amount`` to the counter ``name`` and return its new value (atomic across ranks)."""
        return int(self.store.add(self.key(name), amount))

    def has(self, *names: str) -> bool:
        """Whether every key of ``names`` exists (one round trip)."""
        return bool(self.store.check([self.key(n) for n in names]))

    def wait(self, names: Iterable[str], seconds: float) -> bool:
        """Wait (`poll`) at most ``seconds`` until every key of ``names`` exists; whether they all did."""
        keys = [self.key(n) for n in names]
        return any(self.store.check(keys) for _ in poll(seconds))

    # -- one key per rank -----------------------------------------------------------------------------------------
    def post(self, name: str, value: str) -> None:
        """Write this rank's ``value`` under ``name`` (``<name>/<rank>``)."""
        self.store.set(self.key(name, self.rank), value)

    def read(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, bytes]:
        """``{rank: value}`` of every rank of ``ranks`` (default: all) that has posted ``name``, now; two round trips
        when all have, one more per rank otherwise."""
        wanted = list(range(self.world_size) if ranks is None else ranks)
        if not wanted:
            return {}
        keys = [self.key(name, r) for r in wanted]
        if self.store.check(keys):
            return dict(zip(wanted, map(bytes, self.store.multi_get(keys)), strict=True))
        have = [r for r, k in zip(wanted, keys, strict=True) if self.store.check([k])]
        values = self.store.multi_get([self.key(name, r) for r in have]) if have else []
        return dict(zip(have, map(bytes, values), strict=True))

    def read_all(self, name: str, ranks: Iterable[int] | None = None) -> dict[int, bytes] | None:
        """``{rank: value}`` when every rank of ``ranks`` (default: all) has posted ``name``, else ``None``; never
        a blocking ``get``."""
        wanted = list(range(self.world_size) if ranks is None else ranks)
        keys = [self.key(name, r) for r in wanted]
        if wanted and not self.store.check(keys):
            return None
        return dict(zip(wanted, map(bytes, self.store.multi_get(keys)), strict=True)) if wanted else {}

    def wait_all(self, name: str, seconds: float, ranks: Iterable[int] | None = None) -> dict[int, bytes]:
        """Every rank's value of ``name`` once all have posted it, waiting (`poll`) at most ``seconds``; at the
        deadline, the values of the ranks that did (a rank that never posts is left out, never waited for)."""
        wanted = list(range(self.world_size) if ranks is None else ranks)
        for _ in poll(seconds):
            found = self.read_all(name, wanted)
            if found is not None:
                return found
        return self.read(name, wanted)

    def block(self, name: str, seconds: float = 7 * 86400.0) -> None:
        """Block, without polling, until ``name`` exists (the store's own ``wait``): for a thread on its own connection
        (`clone`) that has nothing else to do until asked (`distfn.boundary`'s answering thread). Raises the store's
        error when ``seconds`` pass or the store goes away; whoever ends the thread wakes it by writing ``name``."""
        self.store.wait([self.key(name)], datetime.timedelta(seconds=seconds))

    def others(self) -> list[int]:
        """Every rank but this one."""
        return [r for r in range(self.world_size) if r != self.rank]
