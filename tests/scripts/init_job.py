"""Rendezvous through an explicit init_method (driven by tests/test_init_methods.py).

python init_job.py OUT_DIR INIT_METHOD     (self-spawn, or under torchrun)
"""

import json
import os
import sys
import threading
from pathlib import Path

from distfn import distributed

OUT, INIT = Path(sys.argv[1]), sys.argv[2]


@distributed(nprocs=2, init_method=INIT)
def job(cfg, ctx):
    return {"rank": ctx.rank, "world": ctx.world_size, "launcher": ctx.launcher,
            "sum": ctx.all_reduce(ctx.rank + 1, op="sum"), "gathered": ctx.gather_object(os.getpid())}


if __name__ == "__main__":
    result = job()
    # in place (torchrun): no thread of the run or of its process group outlives the call: a gloo thread left
    # running into the interpreter's finalisation can abort the process after a success
    result["threads_after"] = sorted([t.name for t in threading.enumerate() if t.name.startswith("distfn-")] + [
        n for n in (Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
        if "gloo" in n])
    (OUT / f"result-{os.environ.get('RANK', 'caller')}.json").write_text(json.dumps(result))
