"""Two threads of one process launching 2-rank jobs at the same time (issue 16 item 3), for tests/test_spawn.py.

Usage: python threads_job.py MARK_FILE

Thread A launches with a cfg whose pickling is slow, so that it stays inside starting its workers for a while;
thread B launches as soon as A is in there. Prints one JSON line: what each thread got. Every worker, while
spawn re-imports this script, appends whether distfn already sees it as a worker to MARK_FILE.
"""

import json
import sys
import threading
import time

from distfn import distributed, worker

if __name__ == "__mp_main__":  # a spawn worker re-importing this script, before distfn's entry point runs
    with open(sys.argv[1], "a") as f:
        f.write(f"{worker.in_worker()}\n")


class SlowToPickle:
    """Pickling takes 0.5 s from the second time on (the first is distfn's check before the launch)."""

    inside = threading.Event()
    calls = 0

    def __reduce__(self):
        SlowToPickle.calls += 1
        if SlowToPickle.calls > 1:
            SlowToPickle.inside.set()
            time.sleep(0.5)
        return SlowToPickle, ()


def body(cfg, ctx):
    return ctx.all_reduce(ctx.rank + 1, op="sum")


job = distributed(nprocs=2, start_method="spawn", timeout=60)(body)


def main() -> None:
    results: dict[str, str] = {}

    def run(name: str, cfg: object) -> None:
        try:
            results[name] = repr(job(cfg))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[name] = f"{type(exc).__name__}: {exc}"

    a = threading.Thread(target=run, args=("a", SlowToPickle()))
    a.start()
    SlowToPickle.inside.wait(60)
    b = threading.Thread(target=run, args=("b", None))
    b.start()
    a.join()
    b.join()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
