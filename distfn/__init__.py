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

from . import checkpoint
from .checkpoint import latest, load
from .context import Context
from .decorator import distributed
from .errors import CheckpointError, ConfigError, DistfnError, LauncherError, NestedLaunchError, Terminated, WorkerError
from .worker import adopt_legacy_local_rank as _adopt_legacy_local_rank

_adopt_legacy_local_rank()  # `python -m torch.distributed.launch` appends --local-rank=N: out of sys.argv at once

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Context",
    "DistfnError",
    "LauncherError",
    "NestedLaunchError",
    "Terminated",
    "WorkerError",
    "checkpoint",
    "distributed",
    "latest",
    "load",
]

__version__ = "0.1.0"
