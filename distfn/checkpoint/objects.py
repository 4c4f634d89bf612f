"""The objects a training state holds, seen the same way by every writer and reader of the package.

A training state maps names to modules, optimizers, schedulers and other objects with ``state_dict()`` /
``load_state_dict()``, next to tensors and plain values. Writers replace each object by its state dict
(`state_of`); the sharded restorer and ``distfn.fsdp_state`` find the model an optimizer belongs to (`owner_of`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..modules import unwrap_module
from . import format as fmt

__all__ = ["is_object", "owner_of", "state_of"]


def is_object(value: Any) -> bool:
    """Whether ``value`` is saved through its state dict (a module or a stateful object), not walked into."""
    return isinstance(value, nn.Module) or fmt.is_stateful(value)


def state_of(value: Any) -> Any:
    """The state dict ``value`` is saved as (a module's with its wrappers' prefixes removed), or ``value``."""
    if isinstance(value, nn.Module):
        return unwrap_module(value).state_dict()
    return value.state_dict() if fmt.is_stateful(value) else value


def owner_of(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module], missing: str) -> nn.Module:
    """The first of ``models`` that holds every parameter of ``optimizer``.

    Raises:
        CheckpointError: with the message ``missing`` when none does.
    """
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(missing)
