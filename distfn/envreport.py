"""``distfn env``: what distfn would detect in this process, the first thing to paste into a bug report.

It prints the launcher and why, the plan a decorated ``mode="ddp"`` call would execute here (the same
`distfn.plan.CallPlan` the call executes: how it runs, this machine's ranks, the world size, and that a script's
``nprocs=`` or ``DISTFN_NPROCS`` may change the count), each rank's device and how ``CUDA_VISIBLE_DEVICES`` maps
program indices to physical GPUs, the default backend, CPUs and memory, the versions of torch / CUDA / NCCL / the
driver and of the optional extras, where distfn is installed (and its commit, from a git checkout), and the
launcher variables that are set. Nothing is started: no process group, no worker, no name lookup. Under a
launcher every rank prints one block headed by its rank (``--rank0``: rank 0 only).

Output here is for a person at a terminal, so this module prints (the library itself logs).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import devices
from .errors import ConfigError, DistfnError
from .options import Options, make_options, with_env
from .plan import CallPlan, plan_call
from .preflight import choose_start_method
from .topology import describe

__all__ = ["collect", "print_env", "render"]

#: Environment variables worth reporting besides the launchers' own (which ``topology.describe`` lists).
_EXTRA_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG", "RAY_ADDRESS",
)


#: The extras that are for developing distfn, not for using it: every other extra of distfn's metadata (the
#: ``[project.optional-dependencies]`` of pyproject.toml: mlflow, wandb, tensorboard, s3, ray, mpi, ...) is listed.
_DEVELOPMENT_EXTRAS = frozenset({"docs", "lint", "runner", "test"})
#: What is listed where distfn's metadata cannot be read (run from a source tree that was never installed).
_KNOWN_EXTRAS = {"mlflow": ("mlflow",), "wandb": ("wandb",), "tensorboard": ("tensorboard",),
                 "s3": ("fsspec", "s3fs"), "ray": ("ray",), "mpi": ("mpi4py",), "bench": ("psutil",),
                 "examples": ("scikit-learn",)}

#: What the count of a self-spawned or in-place call depends on besides this machine (said next to the count).
COUNT_NOTE = "a script's @distributed(nprocs=N) or DISTFN_NPROCS=N changes this count"

# A requirement of distfn's metadata that belongs to an extra: "ray[default]>=2.9; extra == 'ray'".
_EXTRA_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*).*;.*\bextra\s*==\s*['\"]([\w-]+)['\"]")


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


def _extras() -> dict[str, dict[str, str | None]]:
    """``{extra: {package: version or None}}`` for every user-facing extra (not `_DEVELOPMENT_EXTRAS`), read from
    distfn's own metadata, so the list cannot drift from pyproject.toml (`_KNOWN_EXTRAS` without metadata).

    Only the installed distributions' metadata is read (`importlib.metadata`): no extra is imported, so this costs
    milliseconds even with mlflow, ray and wandb installed (each of which takes seconds to import)."""
    try:
        requires = metadata.requires("distfn") or []
    except metadata.PackageNotFoundError:
        requires = None
    if requires is None:
        return {extra: {name: _version(name) for name in names} for extra, names in _KNOWN_EXTRAS.items()}
    out: dict[str, dict[str, str | None]] = {}
    for requirement in requires:
        match = _EXTRA_REQUIREMENT.match(requirement)
        if match and match[2] not in _DEVELOPMENT_EXTRAS:
            out.setdefault(match[2], {})[match[1]] = _version(match[1])
    known = [extra for extra in _KNOWN_EXTRAS if extra in out]  # the usual order first, then any new one
    return {extra: out[extra] for extra in [*known, *sorted(set(out) - set(known))]}


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _install() -> dict[str, Any]:
    """Where this distfn was imported from, and the commit (``+ local changes`` when the tree differs from it)
    when that is a git checkout (an editable install or ``PYTHONPATH``): what a bug report needs to be
    reproduced."""
    package = Path(__file__).resolve().parent
    out: dict[str, Any] = {"location": str(package), "commit": None}
    root = package.parent
    if (root / ".git").exists():
        commit = _git(root, "rev-parse", "--short=12", "HEAD")
        if commit is not None and _git(root, "status", "--porcelain", "--untracked-files=no", "--", "distfn"):
            commit += " + local changes"
        out["commit"] = commit
    return out


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
    if plan.kind in ("one-process", "spawn", "pernode") and plan.counted_by != "DISTFN_NPROCS":
        out["notes"].insert(0, COUNT_NOTE)  # a launcher's world size, or DISTFN_NPROCS, is what the call gets
    if plan.layout is not None:
        out.update(num_nodes=plan.layout.num_nodes, node_rank=plan.layout.node_rank,
                   workers_per_node=plan.layout.local_world_size,
                   rendezvous=f"{plan.layout.master_addr}:{plan.layout.master_port}")
    if plan.launches:
        out["start_method"], out["start_method_reason"] = start_method
    if plan.opts.mesh is not None:
        out["mesh"] = _mesh(plan)
    mapping = {m["index"]: m["physical"] for m in cuda["mapping"]}
    out["ranks"], out["devices"] = [], []
    for rank, local_rank in plan.local_ranks():
        where = devices.device_for(local_rank, count)
        out["ranks"].append(rank)
        out["devices"].append({"local_rank": local_rank, "device": str(where),
                               "physical_gpu": mapping.get(where.index) if where.index is not None else None})
    return out


def _mesh(plan: CallPlan) -> str:
    """``DISTFN_MESH`` as the call would lay it out: the spec, and the sizes on the plan's world when known."""
    spec = plan.opts.mesh
    world = plan.world_size
    if spec is None or world is None:
        return spec.describe() if spec is not None else ""
    where = plan.layout if plan.layout is not None else plan.topology
    layout = spec.resolve(world, num_nodes=where.num_nodes if where is not None else 1,
                          local_world_size=where.local_world_size if where is not None else None)
    return (f"{spec.describe()} -> {layout.describe()} ({layout.dp_size} data-parallel rank(s), "
            f"tensor parallel {layout.tp_size})")


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
        memory), ``versions``, ``extras`` (each optional extra's packages and their versions, ``None`` when
        missing), ``install`` (``location`` of the package, git ``commit`` or ``None``) and ``variables`` (the
        launcher, CUDA and ``DISTFN_*`` variables that are set).
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
    # DISTFN_MESH applies to mode="fsdp" only: with it set, the plan shown is an fsdp call's (a ddp call refuses it)
    planned = {"launcher": launcher, **({"mode": "fsdp"} if env.get("DISTFN_MESH", "").strip() else {})}
    plan, error = _call_plan(make_options(planned), env, argv, cuda["device_count"])
    if plan is not None and plan.kind == "one-process":
        # One process runs in place (no worker is started): what the run itself reports as `local`.
        detected = {**detected, "launcher": "local", "reason": plan.reason}
    variables = dict(detected.pop("variables"))
    variables.update({k: env[k] for k in _EXTRA_VARIABLES if k in env})
    variables.update({k: v for k, v in env.items() if k.startswith("DISTFN_")})
    return {"host": socket.gethostname(), "pid": os.getpid(), "launcher": detected,
            "plan": _plan(plan, error, cuda, start_method), "cuda": cuda, "machine": _machine(),
            "versions": _versions(), "extras": _extras(), "install": _install(),
            "variables": dict(sorted(variables.items()))}


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
    if plan.get("mesh"):
        out.append(_line("mesh (fsdp)", plan["mesh"]))
    out += ["", "versions"]
    for key in ("python", "platform", "torch", "cuda", "driver", "nccl", "cudnn", "safetensors", "attrs", "loguru",
                "numpy", "tqdm", "cloudpickle", "ray"):
        out.append(_line(key, ver[key] if ver[key] is not None else "-"))
    backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in ver["backends"].items())
    out.append(_line("torch.distributed", backends or "not available"))
    out += ["", "extras"]
    for extra, packages in info["extras"].items():
        found = ", ".join(f"{name} {version or '-'}" for name, version in packages.items())
        missing = "" if all(packages.values()) else f"  (pip install 'distfn[{extra}]')"
        out.append(_line(extra, found + missing))
    install = info["install"]
    out += ["", "install", _line("location", install["location"]),
            _line("commit", install["commit"] or "- (not a git checkout)")]
    out += ["", "variables"]
    out += [_line(k, v) for k, v in info["variables"].items()] or ["  (no launcher, CUDA or distfn variables set)"]
    return "\n".join(out)


def print_env(argv: Sequence[str], *, launcher: str = "auto", as_json: bool = False, rank0: bool = False) -> int:
    """Print the report (``as_json``: as JSON); under a launcher with ``rank0`` only rank 0 prints. Returns the exit
    status: 1 when the launcher variables are inconsistent (the job itself would refuse to start), else 0."""
    info = collect(argv=argv, launcher=launcher)
    topo = info["launcher"].get("topology")
    if topo is not None and rank0 and topo["rank"] != 0:
        return 1 if info["launcher"].get("error") else 0
    text = json.dumps(info, indent=2, default=str) if as_json else render(info)
    if topo is not None and topo["world_size"] > 1 and not as_json:
        # Every rank prints at once under srun/mpirun/torchrun: a header per block, written in one call, in
        # rank order as far as a short stagger can make it (there is no process group to order them).
        text = (f"===== rank {topo['rank']} of {topo['world_size']} (local rank {topo['local_rank']}, node "
                f"{topo['node_rank']}) on {info['host']} =====\n{text}")
        time.sleep(min(topo["rank"], 64) * 0.05)
    # An environment value that is not UTF-8 reaches Python as lone surrogates: shown escaped, not a crash.
    os.write(sys.stdout.fileno(), (text + "\n").encode("utf-8", "backslashreplace"))
    # Non-zero when the launcher variables are inconsistent: the job itself would refuse to start.
    return 1 if info["launcher"].get("error") else 0

