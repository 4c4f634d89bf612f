"""distfn: PyTorch distributed training, a decorator away.

    from distfn import distributed

    @distributed(mode="ddp")
    def train(cfg, ctx):
        model = ctx.wrap(Net())
        ...

    if __name__ == "__main__":
        print(train(cfg))   # rank 0's return value

``python script.py`` starts one worker per device; under ``torchrun``, ``srun`` and ``mpirun`` the same file
runs in place, one rank per process.
"""

from __future__ import annotations

from typing import Any

from .context import Context
from .decorator import distributed
from .errors import (CheckpointError, ConfigError, DistfnError, LauncherError, NestedLaunchError, Terminated,
                     WorkerError)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Context",
    "DistfnError",
    "LauncherError",
    "NestedLaunchError",
    "Terminated",
    "WorkerError",
    "distributed",
    "latest",
    "load",
]

__version__ = "0.1.0"


def load(path: Any, device: Any = "cpu") -> dict[str, Any]:
    """Read a distfn/safetensors checkpoint as a plain ``{name: tensor}`` dict (no process group needed).

    Never unpickles: a pickle ``.pt``/``.bin`` file is refused with the one-line conversion.
    """
    from . import checkpoint

    return checkpoint.load(path, device=device)


def latest(directory: Any) -> Any:
    """The newest complete ``ckpt-{step}.safetensors`` in ``directory``, or ``None``."""
    from . import checkpoint

    return checkpoint.latest(directory)
