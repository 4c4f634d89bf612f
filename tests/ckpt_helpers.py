"""Models and helpers shared by the checkpoint tests (tests/test_checkpoint*.py, test_rng.py, test_resume.py)."""

from __future__ import annotations

import os
import pathlib

import torch
from torch import nn

REPO = pathlib.Path(__file__).resolve().parents[1]


def repo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def equal_state(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
        assert v.dtype == b[k].dtype, k


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.bn = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, sched=None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
