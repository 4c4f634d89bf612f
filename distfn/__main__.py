"""The ``distfn`` command (also ``python -m distfn``): ``distfn test``, ``distfn env``, ``distfn version``.

- ``distfn test`` is what to run first on a new machine or cluster: it starts 2 ranks the way a job would (the
  detected launcher, e.g. ``srun -N2 distfn test`` or ``torchrun --nproc_per_node=2 -m distfn test``, or
  self-spawned under a plain shell), runs an all-reduce, a barrier, a checkpoint save/load round trip and one
  DDP step, and prints a pass/fail line with the time of each. ``--gpu`` runs it over NCCL on the GPUs. The
  exit status is non-zero when a check fails.
- ``distfn env`` prints what distfn would detect in this process, the first thing to paste into a bug report:
  the launcher and why, the plan a decorated ``mode="ddp"`` call would execute here (the same
  `distfn.plan.CallPlan` the call executes: how it runs, this machine's ranks, the world size), each rank's
  device and how ``CUDA_VISIBLE_DEVICES`` maps program indices to physical GPUs, the default backend, CPUs and
  memory, the versions of torch / CUDA / NCCL / the driver, and the launcher variables that are set. Nothing is
  started: no process group, no worker, no name lookup. Under a launcher every rank prints one block headed by
  its rank (``--rank0``: rank 0 only).

Output here is for a person at a terminal, so this module prints (the library itself logs). Its imports are all at
the top: ``python -m distfn`` and the ``distfn`` script import the package (and so torch) before this module runs,
so deferring them would defer nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import devices, load
from .checkpoint import consolidate
from .decorator import distributed
from .errors import CheckpointError, ConfigError, DistfnError, WorkerError
from .options import LAUNCHERS, Options, make_options, with_env
from .plan import CallPlan, plan_call
from .preflight import choose_start_method
from .topology import describe

__all__ = ["collect", "main", "render", "report", "smoke_checks"]

#: Environment variables worth reporting besides the launchers' own (which ``topology.describe`` lists).
_EXTRA_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG", "RAY_ADDRESS",
)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# -- distfn env ----------------------------------------------------------------------------------------------------
def _visible_mapping(env: Mapping[str, str], count: int) -> list[dict[str, Any]]:
    """Program index -> physical GPU, as CUDA applies ``CUDA_VISIBLE_DEVICES`` (``'0,5'``: ``cuda:1`` is
    physical GPU 5)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in raw.split(",")] if raw is not None else []
    return [{"index": i, "physical": entries[i] if i < len(entries) else str(i)} for i in range(count)]


def _cuda(env: Mapping[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = {"available": False, "device_count": 0, "visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
                            "mapping": [], "initialized": torch.cuda.is_initialized()}
    try:
        info["device_count"] = torch.cuda.device_count()  # NVML first, like distfn's launching process
        info["available"] = info["device_count"] > 0
    except Exception as exc:  # noqa: BLE001 - a broken driver is exactly what this command should show
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    mapping = _visible_mapping(env, info["device_count"])
    for item in mapping:
        try:
            item["name"] = torch.cuda.get_device_name(item["index"])
        except Exception as exc:  # noqa: BLE001
            item["name"] = f"? ({type(exc).__name__}: {exc})"
    info["mapping"] = mapping
    return info


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from the driver itself (no library needed), or None."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), first.strip())


def _machine() -> dict[str, Any]:
    """CPUs (all, and those this process may run on) and memory (total, available), from the OS."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                memory[key] = int(value.split()[0]) / 2**20  # kB -> GiB
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpus_usable": usable, "memory_gib": memory.get("MemTotal"),
            "memory_available_gib": memory.get("MemAvailable")}


def _versions() -> dict[str, Any]:
    nccl = None
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - best effort
            nccl = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        cudnn = None
    backends = {name: bool(getattr(dist, f"is_{name}_available", lambda: False)()) for name in ("gloo", "nccl", "mpi")}
    return {
        "distfn": _version("distfn"), "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "driver": _driver_version(), "cudnn": cudnn,
        "nccl": nccl, "backends": backends if dist.is_available() else {},
        **{name: _version(name) for name in ("safetensors", "attrs", "loguru", "numpy", "tqdm", "cloudpickle", "ray")},
    }


def _start_method() -> tuple[str | None, str]:
    """What ``start_method="auto"`` would choose in this process. Asked before anything touches CUDA here:
    reading the device names below initialises CUDA, after which the answer would always be spawn."""
    try:
        return choose_start_method("auto")
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def _plan(plan: CallPlan | None, error: str | None, cuda: Mapping[str, Any],
          start_method: tuple[str | None, str] = (None, "")) -> dict[str, Any]:
    """The call's plan as JSON-ready data: how it runs, the processes of this machine, the world size, and the
    device of each local rank (`distfn.devices`' rule: ``cuda:(local_rank % count)``)."""
    count = cuda["device_count"]
    device = devices.device_for(0, count)
    out: dict[str, Any] = {"backend": devices.default_backend(device)}
    if plan is None:
        out.update(error=error, nprocs=0, devices=[])
        return out
    out.update(kind=plan.kind, reason=plan.reason, nprocs=plan.nprocs, nprocs_source=plan.source,
               world_size=plan.world_size, notes=[note.text for note in plan.notes])
    if plan.layout is not None:
        out.update(num_nodes=plan.layout.num_nodes, node_rank=plan.layout.node_rank,
                   workers_per_node=plan.layout.local_world_size,
                   rendezvous=f"{plan.layout.master_addr}:{plan.layout.master_port}")
    if plan.launches:
        out["start_method"], out["start_method_reason"] = start_method
    mapping = {m["index"]: m["physical"] for m in cuda["mapping"]}
    out["ranks"], out["devices"] = [], []
    for rank, local_rank in plan.local_ranks():
        where = devices.device_for(local_rank, count)
        out["ranks"].append(rank)
        out["devices"].append({"local_rank": local_rank, "device": str(where),
                               "physical_gpu": mapping.get(where.index) if where.index is not None else None})
    return out


def _call_plan(opts: Options, env: Mapping[str, str], argv: Sequence[str],
               count: int) -> tuple[CallPlan | None, str | None]:
    try:
        return plan_call(opts, env, argv, lambda: count, nested=False), None
    except DistfnError as exc:
        return None, str(exc)


def collect(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
            launcher: str = "auto") -> dict[str, Any]:
    """Everything ``distfn env`` reports, as a JSON-ready dict.

    Args:
        env: environment variables (default `os.environ`).
        argv: the process's arguments, for the legacy launcher's ``--local-rank=N`` (default none).
        launcher: as ``@distributed(launcher=...)``: ``"auto"`` detects, the others force one.

    Returns:
        The keys ``host``, ``pid``, ``launcher`` (what was detected and why), ``plan`` (the `distfn.plan.CallPlan`
        of a ``mode="ddp"`` call here: kind, processes and where the count comes from, world size, start method,
        device of each local rank, backend; ``error`` when the call would fail), ``cuda``, ``machine`` (CPUs,
        memory), ``versions`` and ``variables`` (the launcher, CUDA and ``DISTFN_*`` variables that are set).
    """
    env = dict(os.environ if env is None else env)
    argv = tuple(argv or ())
    opts = make_options({"launcher": launcher})
    try:
        opts = with_env(opts, env)  # DISTFN_LAUNCHER & co., as the call sees them
    except ConfigError:
        pass  # the plan reports it
    detected = describe(env, argv, opts.launcher)
    start_method = _start_method()
    cuda = _cuda(env)
    plan, error = _call_plan(make_options({"launcher": launcher}), env, argv, cuda["device_count"])
    if plan is not None and plan.kind == "one-process":
        # One process runs in place (no worker is started): what the run itself reports as `local`.
        detected = {**detected, "launcher": "local", "reason": plan.reason}
    variables = dict(detected.pop("variables"))
    variables.update({k: env[k] for k in _EXTRA_VARIABLES if k in env})
    variables.update({k: v for k, v in env.items() if k.startswith("DISTFN_")})
    return {"host": socket.gethostname(), "pid": os.getpid(), "launcher": detected,
            "plan": _plan(plan, error, cuda, start_method), "cuda": cuda, "machine": _machine(),
            "versions": _versions(), "variables": dict(sorted(variables.items()))}


def _line(key: str, value: Any) -> str:
    return f"  {key:<20} {value}"


def _render_launcher(det: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    out = ["launcher", _line("detected", det["launcher"] or "error"), _line("why", det["reason"])]
    if det.get("requested", "auto") != "auto":
        out.append(_line("requested", det["requested"]))
    if det.get("error"):
        out.append(_line("error", det["error"]))
    for name, why in det.get("candidates", {}).items():
        if name != det["launcher"] and not (det.get("error") and why.startswith("inconsistent")):
            out.append(_line(f"also set: {name}", why))
    return [*out, "", "ranks", *_render_ranks(det, plan)]


def _render_ranks(det: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    topo = det.get("topology")
    if plan.get("kind") == "pernode":
        out.append(_line("one task per node", f"{plan['workers_per_node']} workers on each of {plan['num_nodes']} "
                                              f"nodes ({plan['nprocs_source']})"))
        out.append(_line("world size", plan["world_size"]))
        ranks = plan["ranks"]
        out.append(_line("this node", f"node {plan['node_rank']} of {plan['num_nodes']}: ranks {ranks[0]}-"
                                      f"{ranks[-1]}"))
        out.append(_line("rendezvous", plan["rendezvous"]))
    elif topo is not None:
        out.append(_line("rank", f"{topo['rank']} of {topo['world_size']}"))
        out.append(_line("local rank", f"{topo['local_rank']} of {topo['local_world_size']}"))
        out.append(_line("node", f"{topo['node_rank']} of {topo['num_nodes']}"))
        if topo.get("master_addr"):
            out.append(_line("rendezvous", f"{topo['master_addr']}:{topo['master_port']}"))
    elif plan.get("error"):
        out.append(_line("error", plan["error"]))
    elif det["launcher"] == "local":
        out.append(_line("local", f"1 process, this one ({plan['nprocs_source']})"))
    elif det["launcher"] == "spawn":
        out.append(_line("self-spawn", f"{plan['nprocs']} worker(s) ({plan['nprocs_source']})"))
        if plan.get("start_method"):
            out.append(_line("start method", f"{plan['start_method']}: {plan['start_method_reason']}"))
        out.append(_line("rendezvous", "127.0.0.1, a free port chosen at launch"))
    elif det["launcher"] == "ray":
        count = f"{plan['nprocs']} ({plan['nprocs_source']})" if plan.get("nprocs") else plan.get("nprocs_source")
        out.append(_line("ray", f"one actor per rank: {count or 'one per GPU of the cluster'}"))
        out.append(_line("rendezvous", "rank 0's node, a free port chosen at launch"))
    out += [_line("note", note) for note in plan.get("notes", ())]
    return out


def render(info: Mapping[str, Any]) -> str:
    """The human-readable report of a `collect` result."""
    plan, cuda, ver, machine = info["plan"], info["cuda"], info["versions"], info["machine"]
    out = [f"distfn {ver['distfn']} on {info['host']} (pid {info['pid']})", ""]
    out += _render_launcher(info["launcher"], plan)
    out += ["", "machine", _line("CPUs", f"{machine['cpus']} ({machine['cpus_usable']} usable by this process)")]
    if machine["memory_gib"] is not None:
        out.append(_line("memory", f"{machine['memory_gib']:.1f} GiB ({machine['memory_available_gib']:.1f} GiB "
                                   "available)"))
    out += ["", "devices"]
    out.append(_line("CUDA available", cuda["available"] if "error" not in cuda else f"no ({cuda['error']})"))
    visible = cuda["visible_devices"]
    out.append(_line("CUDA_VISIBLE_DEVICES", visible if visible is not None else "(unset: all GPUs)"))
    for m in cuda["mapping"]:
        out.append(_line(f"cuda:{m['index']}", f"physical GPU {m['physical']}  {m.get('name', '')}".rstrip()))
    for d in plan["devices"]:
        where = d["device"] + (f" (physical GPU {d['physical_gpu']})" if d["physical_gpu"] is not None else "")
        out.append(_line(f"local rank {d['local_rank']}", where))
    out.append(_line("backend", f"{plan['backend']} (default for these devices)"))
    out += ["", "versions"]
    for key in ("python", "platform", "torch", "cuda", "driver", "nccl", "cudnn", "safetensors", "attrs", "loguru",
                "numpy", "tqdm", "cloudpickle", "ray"):
        out.append(_line(key, ver[key] if ver[key] is not None else "-"))
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in ver["backends"].items())
    out.append(_line("torch.distributed", backends or "not available"))
    out += ["", "variables"]
    out += [_line(k, v) for k, v in info["variables"].items()] or ["  (no launcher, CUDA or distfn variables set)"]
    return "\n".join(out)


def _print_env(args: argparse.Namespace, argv: Sequence[str]) -> int:
    info = collect(argv=argv, launcher=args.launcher)
    topo = info["launcher"].get("topology")
    if topo is not None and args.rank0 and topo["rank"] != 0:
        return 1 if info["launcher"].get("error") else 0
    text = json.dumps(info, indent=2, default=str) if args.json else render(info)
    if topo is not None and topo["world_size"] > 1 and not args.json:
        # Every rank prints at once under srun/mpirun/torchrun: a header per block, written in one call, in
        # rank order as far as a short stagger can make it (there is no process group to order them).
        text = (f"===== rank {topo['rank']} of {topo['world_size']} (local rank {topo['local_rank']}, node "
                f"{topo['node_rank']}) on {info['host']} =====\n{text}")
        time.sleep(min(topo["rank"], 64) * 0.05)
    # An environment value that is not UTF-8 reaches Python as lone surrogates: shown escaped, not a crash.
    os.write(sys.stdout.fileno(), (text + "\n").encode("utf-8", "backslashreplace"))
    # Non-zero when the launcher variables are inconsistent: the job itself would refuse to start.
    return 1 if info["launcher"].get("error") else 0


# -- distfn test ---------------------------------------------------------------------------------------------------
def smoke_checks(cfg: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
    """The body of ``distfn test``, run on every rank: each check's name, pass/fail, seconds and detail.

    A wrong value is a failed check (the ranks agree on it, so they all go on); an exception on a rank ends the
    job with a `WorkerError` naming that rank, which ``distfn test`` reports as the failure.
    """
    started = time.time() - cfg["t0"]
    checks: list[dict[str, Any]] = [
        {"name": "start", "ok": True, "seconds": started,
         "detail": f"{ctx.world_size} ranks up, {ctx.backend} process group on {ctx.device} ({ctx.launcher})"}]

    def check(name: str, body: Callable[[], tuple[bool, str]]) -> None:
        t = time.perf_counter()
        ok, detail = body()
        checks.append({"name": name, "ok": ok, "seconds": time.perf_counter() - t, "detail": detail})

    def all_reduce() -> tuple[bool, str]:
        total = ctx.all_reduce(torch.tensor([ctx.rank + 1.0], device=ctx.device), op="sum").item()
        want = ctx.world_size * (ctx.world_size + 1) / 2
        return total == want, f"sum of 1..{ctx.world_size} over the ranks = {total:g} (expected {want:g})"

    def barrier() -> tuple[bool, str]:
        ctx.barrier()
        return True, "every rank arrived"

    def save_load() -> tuple[bool, str]:
        if not ctx.is_main:
            return True, "rank 0 writes and reads"
        model = nn.Linear(16, 8)
        with tempfile.TemporaryDirectory(prefix="distfn-test-") as tmp:
            path = ctx.save({"model": model, "step": 7}, Path(tmp) / "check.safetensors")
            loaded = load(path)
            same = all(torch.equal(loaded[f"model.{k}"], v) for k, v in model.state_dict().items())
            verdict = "equal" if same else "DIFFERENT"
            return same, f"{path.stat().st_size} bytes written atomically and read back: {verdict}"

    def ddp_step() -> tuple[bool, str]:
        wrap = time.perf_counter()
        model = ctx.wrap(nn.Linear(32, 4))
        wrap = time.perf_counter() - wrap
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(ctx.rank)  # different data on every rank
        x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 4, generator=gen)
        nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        opt.step()
        digest = float(sum(p.detach().double().sum().item() for p in model.parameters()))
        low, high = ctx.all_reduce(digest, op="min"), ctx.all_reduce(digest, op="max")
        same = f"weights identical on {ctx.world_size} ranks after a step on different data"
        return low == high, (same if low == high else f"weights differ across ranks ({low} vs {high})") + \
            f" (ctx.wrap: {_format_seconds(wrap)}{', DDP imports torch._dynamo once' if wrap > 1 else ''})"

    check("all-reduce", all_reduce)
    check("barrier", barrier)
    check("save/load", save_load)
    check("ddp step", ddp_step)
    return {"rank": ctx.rank, "world_size": ctx.world_size, "launcher": ctx.launcher, "backend": ctx.backend,
            "device": str(ctx.device), "checks": checks}


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def _run_test(args: argparse.Namespace) -> int:
    t0 = time.time()
    options: dict[str, Any] = {"mode": "ddp", "seed": 0, "timeout": args.timeout}
    if args.gpu:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("distfn test --gpu: no CUDA GPU is visible here (torch.cuda.device_count() == 0)", file=sys.stderr)
            return 2
        options.update(backend="nccl", nprocs=args.nprocs or min(2, gpus))  # one rank per GPU: NCCL needs it
    else:
        options.update(backend="gloo", nprocs=args.nprocs or 2)
    try:
        result = distributed(**options)(smoke_checks)({"t0": t0})
    except (WorkerError, DistfnError) as exc:
        print(f"distfn test: FAILED after {_format_seconds(time.time() - t0)}\n{exc}", file=sys.stderr)
        return 1
    if result["rank"] != 0:  # under a launcher every rank returns; rank 0 reports, the others only exit
        return 0 if all(c["ok"] for c in result["checks"]) else 1
    text, status = report(result, time.time() - t0)
    print(text)
    return status


def report(result: Mapping[str, Any], seconds: float) -> tuple[str, int]:
    """``distfn test``'s report of rank 0's `smoke_checks` result, and the exit status (1 when a check failed)."""
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    lines = [f"distfn test: {result['world_size']} ranks ({result['launcher']}), {result['backend']} on "
             f"{result['device'].split(':')[0]}"]
    for c in result["checks"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']:<12} {_format_seconds(c['seconds']):>9}  "
                     f"{c['detail']}")
    verdict = f"{len(failed)} of {len(result['checks'])} checks FAILED: {', '.join(failed)}" if failed else \
        f"all {len(result['checks'])} checks passed"
    lines.append(f"{verdict} in {_format_seconds(seconds)}")
    return "\n".join(lines), 1 if failed else 0


# -- command line --------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distfn", description="distfn command line.")
    sub = parser.add_subparsers(dest="command")
    test = sub.add_parser("test", help="a 2-rank smoke test: all-reduce, barrier, save/load, a DDP step")
    test.add_argument("--gpu", action="store_true", help="on the GPUs over NCCL (default: CPU over gloo)")
    test.add_argument("--nprocs", type=int, default=None,
                      help="ranks to self-spawn (default 2; with --gpu, min(2, GPUs)); a launcher's count wins")
    test.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    env = sub.add_parser("env", help="print what distfn detects here (paste it into bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument("--rank0", action="store_true", help="under a launcher, only rank 0 prints")
    env.add_argument("--launcher", default="auto",
                     help="detect as @distributed(launcher=...) would: auto, spawn, torchrun, slurm, mpi, ray")
    sub.add_parser("version", help="print the distfn version")
    merge = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one .safetensors file")
    merge.add_argument("directory", help="the sharded checkpoint (a directory with model.safetensors.index.json)")
    merge.add_argument("out", help="the .safetensors file to write (streamed, one tensor in memory at a time)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m distfn`` and the ``distfn`` console script; returns the exit status."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # The legacy `python -m torch.distributed.launch` appends --local-rank=N to every process's arguments.
    args, unknown = parser.parse_known_args(given)
    unknown = [a for a in unknown if not a.startswith(("--local_rank", "--local-rank")) and not a.isdigit()]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "version":
        print(_version("distfn"))
        return 0
    if args.command == "env":
        if args.launcher not in LAUNCHERS:
            parser.error(f"--launcher must be one of {', '.join(LAUNCHERS)}")
        return _print_env(args, given)
    if args.command == "test":
        return _run_test(args)
    if args.command == "consolidate":
        try:
            print(consolidate(args.directory, args.out))
        except CheckpointError as exc:
            print(f"distfn consolidate: {exc}", file=sys.stderr)
            return 1
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
