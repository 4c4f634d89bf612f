"""distfn.rankstore: the one store channel of a run (issue 40 item 1), and the run's lifecycle on it (item 2):
run-scoped keys without a collective, post mine / read all / wait for all, one back-off; `Run.fail` / `Run.close`
in the reverse order of the services' start, once, never raising."""

from __future__ import annotations

import math
import threading
import time

import torch.distributed as dist

from distfn import rankstore
from distfn.rankstore import Channel
from distfn.run import Run


def test_runs_are_numbered_per_name_without_a_collective_and_services_get_their_own_keys() -> None:
    store = dist.HashStore()
    zero, one = Channel.open(store, 0, 2), Channel.open(store, 1, 2)
    assert zero.prefix == one.prefix == "distfn/run1/"  # every rank opens the same sequence of runs
    assert Channel.open(store, 0, 2).prefix == "distfn/run2/"  # a second call on the same store starts afresh
    assert Channel.open(store, 0, 2, "timings").prefix == "distfn/timings1/"
    assert zero.child("hang").key("answer", 3) == "distfn/run1/hang/answer/3"


def test_read_takes_what_is_posted_read_all_only_everything_and_wait_all_gives_up_at_the_deadline() -> None:
    store = dist.HashStore()
    ranks = [Channel.open(store, r, 3).child("x") for r in range(3)]
    ranks[0].post("v", "a")
    ranks[2].post("v", "c")
    assert ranks[0].read("v") == {0: b"a", 2: b"c"} and ranks[0].read_all("v") is None
    assert ranks[0].read_all("v", ranks[0].others()) is None and ranks[1].read_all("v", [0, 2]) == {0: b"a", 2: b"c"}
    start = time.monotonic()
    assert ranks[0].wait_all("v", 0.3) == {0: b"a", 2: b"c"} and 0.25 < time.monotonic() - start < 2.0
    threading.Timer(0.2, ranks[1].post, ("v", "b")).start()
    assert ranks[0].wait_all("v", 10.0) == {0: b"a", 1: b"b", 2: b"c"}
    assert ranks[1].add("n") == 1 and ranks[2].add("n") == 2 and ranks[0].has("n") and not ranks[0].has("m")


def test_one_back_off_from_a_millisecond_to_its_cap() -> None:
    slept: list[float] = []
    original = rankstore.time.sleep
    rankstore.time.sleep = slept.append  # type: ignore[assignment]
    try:
        polls = rankstore.poll(math.inf)
        for _ in range(12):
            next(polls)
    finally:
        rankstore.time.sleep = original  # type: ignore[assignment]
    assert slept[0] == 0.001 and slept[1] == 0.002 and max(slept) == rankstore.MAX_PAUSE == slept[-1]
    assert list(rankstore.poll(0.0)) == [0.0]  # no time: one look, no pause


def test_the_run_fails_and_closes_its_services_in_reverse_order_once_and_never_raises() -> None:
    run, events = Run(), []

    def broken(_: object) -> None:
        raise RuntimeError("a service that cannot end")

    run.register("first", fail=lambda exc: events.append(("fail", "first")),
                 close=lambda error: events.append(("close", "first", error is None)))
    run.register("broken", fail=broken, close=broken)
    run.register("last", close=lambda error: events.append(("close", "last", error is None)))
    run.fail(ValueError("x"))
    run.close(ValueError("x"))
    run.close()
    assert events == [("fail", "first"), ("close", "last", False), ("close", "first", False)]
