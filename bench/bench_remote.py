"""Benchmark checkpoints on object storage (s3://, issue 28) against the raw floor, on one S3 server, in one run.

The server is moto's standalone S3 server on loopback (started and stopped here, as the tests do:
tests/s3server.py), so the numbers measure distfn's overhead over the same client library on the same server,
not a real network. What is measured (float32 tensors, ``--size-mib`` in total, ``--tensors`` tensors):

* **single-file save**: ``distfn.checkpoint.save(state, "s3://...")`` (streamed tensor by tensor in parts, size
  checked, commit object) against the floor, **one s3fs ``put`` of a prepared file** holding the same bytes;
* **load**: ``distfn.load("s3://...")`` against a raw s3fs read (``cat_file``) of the same object;
* **sharded save on 2 ranks** (a 2-rank gloo job, the state replicated, so each rank writes about half):
  ``ctx.save(..., sharded=True)`` against torch DCP's ``FsspecWriter`` on the same server;
* **peak extra host memory** of the single-file save, in a fresh process: ``VmHWM`` after the save minus
  ``VmRSS`` before it (the high-water mark reset through ``/proc/self/clear_refs``).

Targets (issue 28): save <= 1.1x the floor, sharded save <= 1.0x DCP's fsspec writer, load <= 1.1x the raw read,
peak extra memory <= one part (`distfn.checkpoint.remote.PART_BYTES`) + 64 MiB.

Usage::

    python bench/bench_remote.py                      # 256 MiB, 3 rounds
    python bench/bench_remote.py --tiny --json /tmp/out.json    # smoke: 16 MiB, one round
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO, REPO / "bench", REPO / "tests"):
    if str(extra) not in sys.path:  # runnable as a plain script from a checkout
        sys.path.insert(0, str(extra))


import s3server  # the moto server of the tests: one way to start and stop it
from bench_checkpoint import make_state

from distfn import checkpoint
from distfn.checkpoint import remote

import _common as c

MIB = 1 << 20

_SHARDED_JOB = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not re-exported by torch
    sys.path.insert(0, sys.argv[4])
    from bench_checkpoint import make_state
    from distfn import distributed

    @distributed(mode="ddp", nprocs=2)
    def job(cfg, ctx):
        base, size, tensors = cfg
        state = make_state(size, tensors)
        out = {}
        for r in range(2):  # distfn and DCP alternate, each twice; the first of each warms the connections
            for name in ("distfn", "dcp"):
                url = f"{base}/{name}-{r}"
                dist.barrier()
                t = time.perf_counter()
                if name == "distfn":
                    ctx.save(state, url, sharded=True)
                else:
                    dcp.save(state, storage_writer=FsspecWriter(url, sync_files=False))
                dist.barrier()
                out.setdefault(name, []).append(time.perf_counter() - t)
        return {k: min(v[1:] or v) for k, v in out.items()}

    print("RESULT", json.dumps(job((sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))))
    """
)

_RSS_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from bench_checkpoint import _status_kib, make_state
    from distfn import checkpoint
    state = make_state(int(sys.argv[2]), 8)
    checkpoint.save({"w": torch.ones(1)}, sys.argv[1] + "-warm.safetensors")  # the libraries and a connection
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    checkpoint.save(state, sys.argv[1])
    print("RESULT", json.dumps({"extra_mib": (_status_kib("VmHWM") - before) / 1024}))
    """
)


def _result(cmd: list[str], env: dict[str, str], timeout: float = 900) -> Any:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{cmd[:3]} failed: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=8)
    args = p.parse_args(argv)
    if s3server.needs_s3.args[0]:  # the skip condition of the tests: no fsspec, s3fs or moto_server here
        c.emit({"benchmark": "remote", "tables": [], "notes": [f"skipped: {s3server.needs_s3.kwargs['reason']}"]},
               args.json)
        return 0
    size = 16 if args.tiny else args.size_mib
    rounds = 1 if args.tiny else args.rounds
    server = s3server.start()
    env = {**c.clean_env(), **server.env, "PYTHONPATH": str(REPO)}
    os.environ.update(server.env)
    try:
        import fsspec
        import fsspec.config

        fsspec.config.conf["s3"] = {"endpoint_url": server.endpoint}
        s3 = fsspec.filesystem("s3", endpoint_url=server.endpoint, skip_instance_cache=True)
        state = make_state(size, args.tensors)
        with tempfile.TemporaryDirectory() as tmp:
            prepared = Path(tmp) / "prepared.safetensors"
            checkpoint.save(state, prepared)  # the same bytes as the remote save
            nbytes = prepared.stat().st_size
            counter = iter(range(10**6))

            def put() -> float:
                t = time.perf_counter()
                s3.put_file(str(prepared), f"{s3server.BUCKET}/floor/put-{next(counter)}.safetensors")
                return time.perf_counter() - t

            def save() -> float:
                t = time.perf_counter()
                checkpoint.save(state, server.url("bench", f"ckpt-{next(counter)}.safetensors"))
                return time.perf_counter() - t

            loaded = checkpoint.save(state, server.url("bench", "load.safetensors"))

            def load() -> float:
                t = time.perf_counter()
                checkpoint.load(loaded)
                return time.perf_counter() - t

            def raw_read() -> float:
                t = time.perf_counter()
                s3.cat_file(remote.locate(str(loaded))[1].key)
                return time.perf_counter() - t

            save()  # warm the connections of both clients
            put()
            c.log("single-file save and load ...")
            saves = c.interleave({"s3fs put (floor)": put, "distfn.save": save}, rounds, c.log)
            loads = c.interleave({"s3fs cat_file (floor)": raw_read, "distfn.load": load}, rounds, c.log)
            c.log("2-rank sharded save ...")
            sharded = _result([sys.executable, "-c", _SHARDED_JOB, server.url("sharded"), str(size),
                               str(args.tensors), str(REPO / "bench")], env)
            c.log("peak memory ...")
            rss = _result([sys.executable, "-c", _RSS_CHILD, server.url("rss", "ckpt.safetensors"), str(size),
                           str(REPO / "bench")], env)
    finally:
        server.stop()
    part_mib = remote.PART_BYTES / MIB
    tables = [
        c.table(f"single-file save to s3:// ({nbytes / MIB:.0f} MiB, moto on loopback)", "s", saves,
                "s3fs put (floor)", [{"variant": "distfn.save", "max_ratio": 1.1}]),
        c.table(f"load from s3:// ({nbytes / MIB:.0f} MiB)", "s", loads, "s3fs cat_file (floor)",
                [{"variant": "distfn.load", "max_ratio": 1.1}]),
        c.table(f"sharded save, 2 ranks ({size} MiB replicated, each writes about half)", "s",
                {"DCP FsspecWriter": [sharded["dcp"]], "distfn sharded": [sharded["distfn"]]}, "DCP FsspecWriter",
                [{"variant": "distfn sharded", "max_ratio": 1.0}]),
        c.table("peak extra host memory of the single-file save", "MiB",
                {"distfn.save": [rss["extra_mib"]]}, None,
                [{"variant": "distfn.save", "max_value": part_mib + 64}]),
    ]
    c.emit({"benchmark": "remote", "tables": tables,
            "notes": [f"part size {part_mib:.0f} MiB; moto keeps objects in memory, so the server's own cost is "
                      "small and the ratios show the client side"]},
           args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
