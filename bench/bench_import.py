"""Import cost: milliseconds that ``from distfn import distributed`` adds after ``import torch`` (each sample a
fresh process), beside the same plus decorating a DDP function (which forks the fork server where the call will
start workers: ``start_method="auto"``), ``import distfn`` alone and ``import torch.distributed`` alone (the
part of a launch's import that distfn defers to the first call; torch 2.13 imports it with torch itself).

Peers (``accelerate``, ``ignite``, ``lightning.fabric``) are measured the same way when ``--peers-python`` can
import them. The JSON also lists the modules that make up distfn's import time (``python -X importtime``),
largest first: where to look when the target is missed. Target (issue 32 item 1): ≤ 50 ms for
``from distfn import distributed``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

TARGET_MS = 50.0
PEERS = {"accelerate": "accelerate", "ignite": "ignite.distributed", "lightning fabric": "lightning.fabric"}

#: What a user who only decorates runs: the import and one decoration (which plans the call and forks the fork
#: server: ``start_method="auto"``, two processes).
DECORATE = ("from distfn import distributed\n"
            "@distributed(mode='ddp', nprocs=2)\n"
            "def train(cfg, ctx):\n"
            "    return None")
#: distfn's own rows: (name, statement timed after ``import torch``).
OWN = {"distfn: from distfn import distributed": "from distfn import distributed",
       "distfn: the same + decorate (forks the fork server)": DECORATE, "distfn: import distfn": "import distfn",
       "import torch.distributed": "import torch.distributed"}

#: The same import in a script file: there it also makes the fork server's copy (issue 46 item 3).
IN_SCRIPT = "distfn: from distfn import distributed, in a script file (makes the fork server's copy)"

_PROBE = ("import time, torch\n"
          "t = time.perf_counter()\n"
          "{statement}\n"
          "print('OK', time.perf_counter() - t)\n")


def _import_time(python: str, statement: str) -> float:
    """Milliseconds that ``statement`` takes after ``import torch``, in a fresh interpreter."""
    proc = subprocess.run([python, "-c", _PROBE.format(statement=statement)], capture_output=True, text=True,
                          env=c.clean_env(), timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("OK "):
            return float(line.split()[1]) * 1000
    raise RuntimeError(f"{statement!r} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")


def _import_time_in_script(python: str, statement: str) -> float:
    """`_import_time` with the probe run as a script file (``python probe.py``), where a script's own
    ``from distfn import distributed`` also makes the fork server's copy (`distfn.decorator.copy_at_import`):
    what a user's script pays, which ``python -c`` does not show."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(_PROBE.format(statement=statement))
        proc = subprocess.run([python, str(probe)], capture_output=True, text=True, env=c.clean_env(), timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("OK "):
            return float(line.split()[1]) * 1000
    raise RuntimeError(f"{statement!r} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")


def _importable(python: str, module: str) -> bool:
    code = f"import importlib.util as u, sys; sys.exit(0 if u.find_spec({module.split('.')[0]!r}) else 1)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


def breakdown(python: str = sys.executable, top: int = 12) -> list[dict[str, Any]]:
    """The modules that importing and decorating (`DECORATE`) import after torch, by self time (µs), largest
    first."""
    # spawn: no fork server, whose copy of this process would print its own imports (the workers' preload) here
    proc = subprocess.run([python, "-X", "importtime", "-c", f"import torch\n{DECORATE}"], capture_output=True,
                          text=True, env=c.clean_env(DISTFN_START_METHOD="spawn"), timeout=300)
    rows, after_torch = [], False
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, cumulative_us, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        if not after_torch:
            after_torch = name == "torch"
            continue
        try:
            rows.append({"module": name, "self_us": int(self_us), "cumulative_us": int(cumulative_us)})
        except ValueError:
            continue
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=15)
    p.add_argument("--peers-python", default=sys.executable, help="interpreter that has the peers installed")
    args = p.parse_args(argv)
    rounds = 1 if args.tiny else args.rounds
    target = next(iter(OWN))
    variants = {name: partial(_import_time, sys.executable, statement) for name, statement in OWN.items()}
    variants[IN_SCRIPT] = partial(_import_time_in_script, sys.executable, "from distfn import distributed")
    if not args.tiny:
        for name, module in PEERS.items():
            if _importable(args.peers_python, module):
                c.warm_bytecode(args.peers_python, ("torch", module))
                variants[name] = partial(_import_time, args.peers_python, f"import {module}")
    c.warm_bytecode()
    c.log(f"import: {', '.join(variants)}; {rounds} round(s)")
    samples = c.interleave(variants, rounds, c.log)
    tab = c.table("Import cost: each statement after `import torch` (fresh process per sample)", "ms", samples,
                  baseline=target, targets=[{"variant": target, "max_value": TARGET_MS},
                                            {"variant": IN_SCRIPT, "max_value": TARGET_MS}])
    parts = breakdown()
    notes = ["bytecode cached, as after `pip install` (this shell's PYTHONDONTWRITEBYTECODE is unset for the runs)",
             "largest self times in `from distfn import distributed` + decorating (python -X importtime): "
             + ", ".join(f"{r['module']} {r['self_us'] / 1000:.1f} ms" for r in parts[:8])]
    c.emit({"benchmark": "import", "tables": [tab], "breakdown": parts, "notes": notes}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
