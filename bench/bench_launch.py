"""Launch latency: wall time of a whole ``python script.py`` that starts N workers, initialises the process
group, does one all_reduce and exits.

Variants (each a real script run as a fresh process, interleaved over rounds):

* ``import torch`` alone: what every variant pays at least once;
* ``distfn``: ``@distributed(nprocs=N)`` with the default start method (fork when safe);
* the paths where forking is unsafe, each its own row: ``distfn, after a torch op`` (a matmul between decoration
  and call: an OpenMP pool is alive), ``distfn, after is_available()`` (``torch.cuda.is_available()`` before the
  call: a CUDA driver call, which matters only where GPUs are visible), ``distfn, notebook-like __main__`` (the
  same script as ``python -c``, matmul included: what was defined there is shipped by value), and
  ``distfn, torch op before decoration`` (no safe moment to copy the process: the fork server is a fresh
  interpreter started at decoration). distfn then starts the workers from its fork server
  (`distfn.launch.forkserver`): made at decoration where the call is expected to need it (an interactive
  ``__main__``, a process already unsafe to fork), else started at the call (``after a torch op`` in a script);
* ``raw fork``: ``torch.multiprocessing.start_processes(start_method="fork")``: the floor, torch imported once;
* ``raw spawn``: ``torch.multiprocessing.spawn``: every worker imports torch again;
* ``torchrun``: ``torchrun --nproc_per_node=N script.py``;
* peers, only when importable by ``--peers-python`` (default: this interpreter): Accelerate
  ``notebook_launcher``, Lightning Fabric ``launch`` (ddp_spawn and ddp), Ignite ``idist.Parallel``.

A second table shows scaling with 1, 2 and 4 workers (distfn vs raw fork with the same N). With N=1 distfn
runs the function in place (no worker process), which is what a user gets.
Targets: distfn ≤ 1.1× raw fork; every path where fork is unsafe ≤ 1.3× raw fork (issue 11), against raw spawn's
2.06×.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

SCRIPTS: dict[str, str] = {
    "import_torch": """
import torch
print("OK", 0.0)
""",
    "distfn": """
import sys
import torch
import torch.distributed as dist
from distfn import distributed

N = int(sys.argv[1])
PATH = sys.argv[2] if len(sys.argv) > 2 else "fresh"

def torch_op():
    torch.randn(600, 600) @ torch.randn(600, 600)  # multi-threaded: an OpenMP pool stays alive

if PATH == "op-before-decoration":
    torch_op()

@distributed(nprocs=N, backend="gloo")
def job(cfg, ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

if __name__ == "__main__":
    if PATH == "op":
        torch_op()
    if PATH == "cuda":
        torch.cuda.is_available()
    print("OK", job(None))
""",
    "raw": """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, n, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        print("OK", t.item(), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    n, port, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.start_processes(worker, args=(n, port), nprocs=n, start_method=method)
""",
    "torchrun": """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print("OK", t.item(), flush=True)
dist.destroy_process_group()
""",
    "accelerate": """
import sys
import torch

def job():
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    t = acc.reduce(torch.ones(1), reduction="sum")
    if acc.is_main_process:
        print("OK", t.item(), flush=True)

if __name__ == "__main__":
    from accelerate import notebook_launcher
    notebook_launcher(job, num_processes=int(sys.argv[1]))
""",
    "fabric": """
import sys
import torch
from lightning.fabric import Fabric

def job(fabric):
    t = fabric.all_reduce(torch.ones(1), reduce_op="sum")
    if fabric.global_rank == 0:
        print("OK", t.item(), flush=True)

if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy=sys.argv[2])
    if sys.argv[2] == "ddp_spawn":
        fabric.launch(job)
    else:
        fabric.launch()
        job(fabric)
""",
    "ignite": """
import sys
import torch
import ignite.distributed as idist

def job(local_rank):
    t = idist.all_reduce(torch.ones(1))
    if idist.get_rank() == 0:
        print("OK", t.item(), flush=True)

if __name__ == "__main__":
    with idist.Parallel(backend="gloo", nproc_per_node=int(sys.argv[1])) as parallel:
        parallel.run(job)
""",
}


def _has(python: str, module: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(module.split(".")[0]) is not None and \
            importlib.util.find_spec(module) is not None
    probe = subprocess.run([python, "-c", f"import importlib.util as u, sys; "
                                          f"sys.exit(0 if u.find_spec({module!r}) else 1)"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def _run(python: str, script: Path, *args: Any, n: int, torchrun: bool = False) -> float:
    """Seconds to run ``script`` to completion; it must print ``OK <sum of ones>`` (``OK`` for n=0)."""
    cmd = [python, str(script), *map(str, args)]
    if torchrun:  # `python -m torch.distributed.run` is the `torchrun` console script; a free port each time
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={c.free_port()}",
               str(script)]
    return c.timed_run(cmd, env=c.clean_env(), cwd=script.parent, expect=f"OK {float(n)}" if n else "OK")


def _run_code(python: str, code: str, *args: Any, n: int) -> float:
    """Seconds to run ``python -c code``: a ``__main__`` without a file, as in a notebook."""
    return c.timed_run([python, "-c", code, *map(str, args)], env=c.clean_env(), expect=f"OK {float(n)}")


def variants(workdir: Path, n: int, peers_python: str, with_peers: bool) -> dict[str, Any]:
    """The main comparison with ``n`` workers: name -> zero-argument callable returning seconds."""
    paths = {}
    for name, text in SCRIPTS.items():
        paths[name] = workdir / f"launch_{name}.py"
        paths[name].write_text(text)
    py = sys.executable
    out: dict[str, Any] = {
        "import torch": partial(_run, py, paths["import_torch"], n=0),
        "distfn": partial(_run, py, paths["distfn"], n, n=n),
        "distfn, after a torch op": partial(_run, py, paths["distfn"], n, "op", n=n),
        "distfn, after is_available()": partial(_run, py, paths["distfn"], n, "cuda", n=n),
        "distfn, notebook-like __main__": partial(_run_code, py, SCRIPTS["distfn"], n, "op", n=n),
        "distfn, torch op before decoration": partial(_run, py, paths["distfn"], n, "op-before-decoration", n=n),
        "raw fork": lambda: _run(py, paths["raw"], n, c.free_port(), "fork", n=n),
        "raw spawn": lambda: _run(py, paths["raw"], n, c.free_port(), "spawn", n=n),
        "torchrun": partial(_run, py, paths["torchrun"], n=n, torchrun=True),
    }
    if with_peers:
        c.warm_bytecode(peers_python, [m for m in ("torch", "accelerate", "lightning.fabric", "ignite.distributed")
                                       if _has(peers_python, m)])
        if _has(peers_python, "accelerate"):
            out["accelerate notebook_launcher"] = partial(_run, peers_python, paths["accelerate"], n, n=n)
        if _has(peers_python, "lightning.fabric"):
            out["fabric ddp_spawn"] = partial(_run, peers_python, paths["fabric"], n, "ddp_spawn", n=n)
            out["fabric ddp"] = partial(_run, peers_python, paths["fabric"], n, "ddp", n=n)
        if _has(peers_python, "ignite"):
            out["ignite Parallel"] = partial(_run, peers_python, paths["ignite"], n, n=n)
    return out


def scaling_variants(workdir: Path, counts: list[int]) -> dict[str, Any]:
    py = sys.executable
    out: dict[str, Any] = {}
    for n in counts:
        out[f"distfn, {n} worker{'s' * (n > 1)}"] = partial(_run, py, workdir / "launch_distfn.py", n, n=n)
        out[f"raw fork, {n} worker{'s' * (n > 1)}"] = (
            lambda n=n: _run(py, workdir / "launch_raw.py", n, c.free_port(), "fork", n=n))
    return out


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--workers", type=int, default=2, help="workers of the main comparison (default 2)")
    p.add_argument("--peers-python", default=sys.executable,
                   help="interpreter that has the peers (accelerate, lightning, ignite) installed")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1/2/4-worker scaling table")
    args = p.parse_args(argv)
    rounds = 1 if args.tiny else args.rounds
    with tempfile.TemporaryDirectory(prefix="distfn-bench-launch-") as tmp:
        work = Path(tmp)
        c.warm_bytecode()
        main_variants = variants(work, args.workers, args.peers_python, with_peers=not args.tiny)
        c.log(f"launch: {', '.join(main_variants)}; {rounds} round(s)")
        samples = c.interleave(main_variants, rounds, c.log)
        tables = [c.table(
            f"Launch latency: whole `python script.py`, {args.workers} workers, init + one all_reduce + exit",
            "s", samples, baseline="raw fork",
            targets=[{"variant": "distfn", "max_ratio": 1.1},
                     *({"variant": name, "max_ratio": 1.3} for name in main_variants
                       if name.startswith("distfn, ") and name != "distfn, torch op before decoration")],
            notes={"import torch": "reference: `python -c 'import torch'`",
                   "raw fork": "the floor: torch imported once, then fork",
                   "raw spawn": "every worker imports torch again",
                   "distfn": "default start method (fork: safe here)",
                   "distfn, after a torch op": "fork unsafe by the call: fork server started at the call",
                   "distfn, after is_available()": "fork unsafe where GPUs are visible (else forks)",
                   "distfn, notebook-like __main__": "python -c, after a torch op: shipped by value",
                   "distfn, torch op before decoration": "fork server: a fresh interpreter started at decoration"},
        )]
        if not args.tiny and not args.no_scaling:
            counts = [1, 2, 4]
            scale = scaling_variants(work, counts)
            c.log(f"launch scaling: {', '.join(scale)}; {rounds} round(s)")
            scale_samples = c.interleave(scale, rounds, c.log)
            tab = c.table("Launch latency by number of workers (ratio: distfn vs raw fork with the same N)", "s",
                          scale_samples, baseline=None,
                          notes={"distfn, 1 worker": "runs in place: no worker process"})
            for row in tab["rows"]:
                if row["variant"].startswith("distfn") and row["median"] is not None:
                    floor = next(r for r in tab["rows"] if r["variant"] == row["variant"].replace("distfn", "raw fork"))
                    if floor["median"]:
                        row["ratio"] = row["median"] / floor["median"]
            tables.append(tab)
    c.emit({"benchmark": "launch", "tables": tables,
            "notes": [] if args.tiny else ["peers are measured only when importable by --peers-python"]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
