"""Modules and optimizers as users hand them to distfn.

`unwrap_module` is the one place that knows the wrappers (DDP, DataParallel, ``torch.compile``); `Context.unwrap`
and the checkpoint code both use it, so the runtime can unwrap without importing the checkpoint package.
`indexed_optimizer_state` / `named_optimizer_state` translate an optimizer state between parameter names (what
FSDP's full state dicts use) and ``Optimizer.state_dict()``'s integer layout (what a file written in DDP mode
holds); both the FSDP gather and the sharded checkpoint reader use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn

__all__ = ["indexed_optimizer_state", "named_optimizer_state", "unwrap_module"]

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


def indexed_optimizer_state(named: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter names -> ``Optimizer.state_dict()``'s layout (ints).

    The ints number the parameters across ``param_groups`` in order, as ``torch.optim.Optimizer.state_dict``
    does, so the file matches one written in DDP mode and loads into a bare optimizer.
    """
    if not named:
        return {}
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [index.setdefault(fqn, len(index)) for fqn in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[fqn]: value for fqn, value in named["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def named_optimizer_state(
    indexed: Mapping[Any, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """The inverse of `indexed_optimizer_state` for ``optimizer``: ints -> the parameter names ``model`` uses."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {order[int(i)]: v for i, v in indexed["state"].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}
