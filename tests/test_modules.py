"""distfn.modules: the bare module inside DDP / DataParallel / torch.compile wrappers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distfn.modules import unwrap_module


def test_unwrap_strips_every_wrapper_and_keeps_bare_modules() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert unwrap_module(model) is model
    assert unwrap_module(nn.DataParallel(model)) is model
    assert unwrap_module(nn.DataParallel(nn.DataParallel(model))) is model


def test_unwrap_strips_torch_compile_at_any_depth() -> None:
    model = nn.Linear(2, 3)
    try:
        compiled = torch.compile(model)  # wrapping only; nothing is compiled until it is called
    except Exception as exc:  # noqa: BLE001 - any failure means: not available in this build  # pragma: no cover
        pytest.skip(f"torch.compile unavailable: {exc}")
    assert unwrap_module(compiled) is model
    assert unwrap_module(nn.DataParallel(compiled)) is model


def test_a_submodule_named_module_is_not_a_wrapper() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = Holder()
    assert unwrap_module(holder) is holder
