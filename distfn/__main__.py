"""``python -m distfn env`` (or the ``distfn`` console script): what distfn would detect in this process.

The first thing to paste into a bug report. It shows the launcher distfn would pick and why, the ranks, which
device each rank would use and how ``CUDA_VISIBLE_DEVICES`` maps program indices to physical GPUs, the
default backend, the versions of torch / CUDA / NCCL, and the launcher variables that are set. Nothing is
started: no process group, no worker, no name lookup. Run it the way you run your script to see what each
rank would see, e.g. ``srun -n2 python -m distfn env`` or ``torchrun --nproc_per_node=2 -m distfn env``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

__all__ = ["collect", "main", "render"]

#: Environment variables worth reporting besides the launchers' own (which ``topology.describe`` lists).
_EXTRA_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG",
)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _visible_mapping(env: Mapping[str, str], count: int) -> list[dict[str, Any]]:
    """Program index -> physical GPU, as CUDA applies ``CUDA_VISIBLE_DEVICES`` (``'0,5'``:
    ``cuda:1`` is physical GPU 5)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in raw.split(",")] if raw is not None else []
    out = []
    for index in range(count):
        physical = entries[index] if index < len(entries) else str(index)
        out.append({"index": index, "physical": physical})
    return out


def _cuda(env: Mapping[str, str]) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "available": False,
        "device_count": 0,
        "visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "mapping": [],
        "initialized": torch.cuda.is_initialized(),
    }
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


def _versions() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

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
    return {
        "distfn": _version("distfn"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "nccl": nccl,
        "backends": {
            name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
            for name in ("gloo", "nccl", "mpi")
        } if dist.is_available() else {},
        "safetensors": _version("safetensors"),
        "attrs": _version("attrs"),
        "loguru": _version("loguru"),
        "numpy": _version("numpy"),
    }


def _start_method() -> tuple[str | None, str]:
    """What ``start_method="auto"`` would choose in this process. Asked before anything touches CUDA here:
    reading the device names below initialises CUDA, after which the answer would always be spawn."""
    try:
        from . import preflight

        return preflight.choose_start_method("auto")
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def _plan(describe: Mapping[str, Any], cuda: Mapping[str, Any], env: Mapping[str, str],
          start_method: tuple[str | None, str] = (None, "")) -> dict[str, Any]:
    """Ranks, device per rank and backend that a decorated ``mode="ddp"`` call would use here."""
    count = cuda["device_count"]
    plan: dict[str, Any] = {"backend": "nccl" if count else "gloo"}
    topo = describe.get("topology")
    if describe.get("launcher") == "spawn":
        raw = env.get("DISTFN_NPROCS", "").strip()
        if raw:
            nprocs, source = raw, "DISTFN_NPROCS"
        else:
            nprocs, source = str(count or 1), ("visible CUDA devices" if count else "no CUDA: one process")
        plan["nprocs"] = nprocs
        plan["nprocs_source"] = source
        plan["start_method"], plan["start_method_reason"] = start_method
        local_ranks = range(int(nprocs)) if nprocs.isdigit() else range(0)
    elif topo is not None:
        local_ranks = range(topo["local_rank"], topo["local_rank"] + 1)
    else:
        local_ranks = range(0)
    mapping = {m["index"]: m["physical"] for m in cuda["mapping"]}
    plan["devices"] = [
        {"local_rank": r, "device": f"cuda:{r % count}", "physical_gpu": mapping.get(r % count)} if count
        else {"local_rank": r, "device": "cpu", "physical_gpu": None}
        for r in local_ranks
    ]
    return plan


def collect(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
            launcher: str = "auto") -> dict[str, Any]:
    """Everything ``distfn env`` reports, as a JSON-ready dict.

    Args:
        env: environment variables (default ``os.environ``).
        argv: the process's arguments, for the legacy ``--local_rank=N`` (default none).
        launcher: as ``@distributed(launcher=...)``: ``"auto"`` detects, the others force one.
    """
    from .topology import describe

    env = dict(os.environ if env is None else env)
    detected = describe(env, tuple(argv or ()), launcher)
    start_method = _start_method()
    cuda = _cuda(env)
    variables = dict(detected.pop("variables"))
    variables.update({k: env[k] for k in _EXTRA_VARIABLES if k in env})
    variables.update({k: v for k, v in env.items() if k.startswith("DISTFN_")})
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launcher": detected,
        "plan": _plan(detected, cuda, env, start_method),
        "cuda": cuda,
        "versions": _versions(),
        "variables": dict(sorted(variables.items())),
    }


def _line(key: str, value: Any) -> str:
    return f"  {key:<20} {value}"


def render(info: Mapping[str, Any]) -> str:
    """The human-readable report of :func:`collect`'s result."""
    det, plan, cuda, ver = info["launcher"], info["plan"], info["cuda"], info["versions"]
    out = [f"distfn {ver['distfn']} on {info['host']} (pid {info['pid']})", "", "launcher"]
    out.append(_line("detected", det["launcher"] or "error"))
    out.append(_line("why", det["reason"]))
    if det.get("requested", "auto") != "auto":
        out.append(_line("requested", det["requested"]))
    if det.get("error"):
        out.append(_line("error", det["error"]))
    for name, why in det.get("candidates", {}).items():
        if name != det["launcher"] and not (det.get("error") and why.startswith("inconsistent")):
            out.append(_line(f"also set: {name}", why))
    topo = det.get("topology")
    out += ["", "ranks"]
    if topo is not None:
        out.append(_line("rank", f"{topo['rank']} of {topo['world_size']}"))
        out.append(_line("local rank", f"{topo['local_rank']} of {topo['local_world_size']}"))
        out.append(_line("node", f"{topo['node_rank']} of {topo['num_nodes']}"))
        if topo.get("master_addr"):
            out.append(_line("rendezvous", f"{topo['master_addr']}:{topo['master_port']}"))
    elif det["launcher"] == "spawn":
        out.append(_line("self-spawn", f"{plan['nprocs']} worker(s) ({plan['nprocs_source']})"))
        if plan.get("start_method"):
            out.append(_line("start method", f"{plan['start_method']}: {plan['start_method_reason']}"))
        out.append(_line("rendezvous", "127.0.0.1, a free port chosen at launch"))
    out += ["", "devices"]
    out.append(_line("CUDA available", cuda["available"] if "error" not in cuda else f"no ({cuda['error']})"))
    out.append(_line("CUDA_VISIBLE_DEVICES", cuda["visible_devices"] if cuda["visible_devices"] is not None
                     else "(unset: all GPUs)"))
    for m in cuda["mapping"]:
        out.append(_line(f"cuda:{m['index']}", f"physical GPU {m['physical']}  {m.get('name', '')}".rstrip()))
    for d in plan["devices"]:
        where = d["device"] + (f" (physical GPU {d['physical_gpu']})" if d["physical_gpu"] is not None else "")
        out.append(_line(f"local rank {d['local_rank']}", where))
    out.append(_line("backend", f"{plan['backend']} (default for these devices)"))
    out += ["", "versions"]
    for key in ("python", "platform", "torch", "cuda", "cudnn", "nccl", "safetensors", "attrs", "loguru", "numpy"):
        out.append(_line(key, ver[key] if ver[key] is not None else "-"))
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in ver["backends"].items())
    out.append(_line("torch.distributed", backends or "not available"))
    out += ["", "variables"]
    if info["variables"]:
        out += [_line(k, v) for k, v in info["variables"].items()]
    else:
        out.append("  (no launcher, CUDA or distfn variables set)")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distfn", description="distfn command line.")
    sub = parser.add_subparsers(dest="command")
    env = sub.add_parser("env", help="print what distfn detects here (paste it into bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument("--launcher", default="auto",
                     help="detect as @distributed(launcher=...) would: auto, spawn, torchrun, slurm, mpi")
    sub.add_parser("version", help="print the distfn version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m distfn`` and the ``distfn`` console script; returns the exit status."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # The legacy `python -m torch.distributed.launch` appends --local_rank=N to every process's arguments.
    args, unknown = parser.parse_known_args(given)
    unknown = [a for a in unknown if not a.startswith(("--local_rank", "--local-rank")) and not a.isdigit()]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "version":
        print(_version("distfn"))
        return 0
    if args.command != "env":
        parser.print_help()
        return 2
    from .topology import LAUNCHERS

    if args.launcher not in LAUNCHERS:
        parser.error(f"--launcher must be one of {', '.join(LAUNCHERS)}")
    # Only --local_rank matters from argv (legacy torch.distributed.launch passes it to the module).
    info = collect(argv=given, launcher=args.launcher)
    print(json.dumps(info, indent=2, default=str) if args.json else render(info))
    # Non-zero when the launcher variables are inconsistent: the job itself would refuse to start.
    return 1 if info["launcher"].get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
