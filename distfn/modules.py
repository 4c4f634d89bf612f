"""Modules as users hand them to distfn: wrapped by DDP, DataParallel or ``torch.compile``.

`unwrap_module` is the one place that knows those wrappers; `Context.unwrap` and the checkpoint code both use it,
so the runtime can unwrap without importing the checkpoint package.
"""

from __future__ import annotations

from typing import Final

from torch import nn

__all__ = ["unwrap_module"]

_MAX_DEPTH: Final = 64  # a cycle of wrappers would be a bug elsewhere, not an endless loop here


def unwrap_module(module: nn.Module) -> nn.Module:
    """Return the bare module inside DDP / DataParallel / ``torch.compile`` wrappers (any nesting).

    Args:
        module: a module, possibly wrapped.

    Returns:
        The innermost module whose ``state_dict()`` keys carry no ``module.`` / ``_orig_mod.`` prefix.
    """
    for _ in range(_MAX_DEPTH):
        orig = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(orig, nn.Module):
            module = orig
            continue
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        break
    return module
