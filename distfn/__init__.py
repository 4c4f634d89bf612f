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

The package is lazy: ``import distfn`` loads only the error classes and `distfn.logs` (whose import silences
distfn's log lines outside a job, loguru's rule for libraries), and each public name (`distributed`,
`load`, `checkpoint`, ...) imports its module, and with it torch (3-5 s), on first use. So ``distfn --help``
and ``distfn version``, which need no torch, answer at once, while ``from distfn import distributed`` works
as ever. ``distributed`` itself imports only what decorating needs (`distfn.decorator`); the launch machinery
loads at the first call (`distfn.execute`).
"""

from __future__ import annotations

import importlib
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from . import logs as _logs  # noqa: F401 - its import is the rule "quiet outside a job" (logger.disable), ~0.1 s
from .errors import CheckpointError, ConfigError, DistfnError, LauncherError, NestedLaunchError, Terminated, WorkerError

if TYPE_CHECKING:  # what type checkers and the API docs see; at run time `__getattr__` imports them
    from . import checkpoint
    from .checkpoint import latest, load
    from .context import Context
    from .decorator import distributed

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

#: The public names that import torch, and the module each comes from (``checkpoint`` is the module itself).
_LAZY = {"checkpoint": "checkpoint", "latest": "checkpoint", "load": "checkpoint", "Context": "context",
         "distributed": "decorator"}


def __getattr__(name: str) -> Any:
    """A public name on first use (see `_LAZY`), or a submodule (``distfn.failures`` after ``import distfn``, as
    when the package imported everything up front)."""
    module_name = _LAZY.get(name, name)
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{module_name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = module if module_name == name else getattr(module, name)
    globals()[name] = value
    if name == "distributed":  # a script's `from distfn import distributed`: its fork server's copy, now
        caller: FrameType | None = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename.startswith("<frozen importlib"):
            caller = caller.f_back  # `from distfn import ...` asks through importlib's _handle_fromlist
        module.copy_at_import(caller)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# `python -m torch.distributed.launch` appends --local-rank=N: out of sys.argv at once, before the user's argparse.
# Only then is `distfn.process` (and so torch, through the options) imported here: the flag is a launcher's, and the
# job imports torch next.
if any(arg.startswith(("--local-rank", "--local_rank")) for arg in sys.argv):
    from .process import adopt_legacy_local_rank as _adopt_legacy_local_rank

    _adopt_legacy_local_rank()
