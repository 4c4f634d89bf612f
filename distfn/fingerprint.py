"""Divergent ranks caught at the start: every ``ctx.wrap`` compares what the ranks were given.

Different hyperparameters on different nodes (a config file that differs, an argument given to one ``srun`` task
only) or a model built differently on one rank (pytorch/pytorch#32426) otherwise end in a hang at the first
collective whose sizes disagree, or, worse, in silently different training. So at each ``ctx.wrap`` (before DDP's
or FSDP's own collectives) every rank posts a digest of the cfg's items and of the model's parameters (name,
shape, dtype) to the process group's store, and compares the others' digests: no collective, two store round
trips when they agree (only the digests travel; the items themselves only after a mismatch, one rank per side).
On a mismatch every rank raises the same `ConfigError`, naming the first differing key
and the ranks on each side.

A cfg item is compared by its ``repr``; an item whose ``repr`` holds a memory address (``<object at 0x...>``),
which differs between processes by nature, is compared by its type alone. ``DISTFN_FINGERPRINT=0`` turns the
check off (for a cfg that is meant to differ between ranks; better: derive the per-rank part from ``ctx.rank``).

Imports: `errors`, `failures` (the phrase naming ranks), `rankstore` (the run's channel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Final

import attrs
from loguru import logger
from torch import nn

from .errors import ConfigError
from .failures import ranks_phrase
from .rankstore import Channel

__all__ = ["Agreement", "cfg_items", "model_items"]

_ADDRESS: Final = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_REPR: Final = 120
_MAX_DEPTH: Final = 6
_MAX_CHILDREN: Final = 64  # a longer list or mapping (a dataset's file list) is one item: its repr's digest


def _value(value: Any) -> str:
    """What a cfg leaf is compared by: its repr, shortened to `_MAX_REPR` characters with the whole repr's
    digest (so a difference past the cut still counts), or its type where the repr holds an address."""
    text = repr(value)
    if _ADDRESS.search(text):
        return f"<{type(value).__qualname__}>"
    if len(text) <= _MAX_REPR:
        return text
    return f"{text[:_MAX_REPR - 25]}... (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"


def cfg_items(cfg: Any, prefix: str = "cfg", depth: int = 0) -> dict[str, str]:
    """``{dotted key: repr}`` of ``cfg``'s leaves: mappings, dataclasses, attrs classes, namespaces, lists."""
    children: dict[str, Any] | None = None
    if depth < _MAX_DEPTH:
        if isinstance(cfg, Mapping):
            children = {str(k): v for k, v in cfg.items()}
        elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            children = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        elif attrs.has(type(cfg)):
            children = {a.name: getattr(cfg, a.name) for a in attrs.fields(type(cfg))}
        elif isinstance(cfg, (list, tuple)):
            children = {str(i): v for i, v in enumerate(cfg)}
        elif type(cfg).__name__ == "Namespace" and hasattr(cfg, "__dict__"):  # argparse / types.SimpleNamespace
            children = dict(vars(cfg))
    if children is None or len(children) > _MAX_CHILDREN:
        return {prefix: _value(cfg)}
    out: dict[str, str] = {}
    for key, value in children.items():
        out.update(cfg_items(value, f"{prefix}.{key}", depth + 1))
    return out or {prefix: _value(cfg)}


def model_items(model: nn.Module) -> dict[str, str]:
    """``{"model.<parameter name>": "(shape) dtype"}`` for every parameter of ``model``."""
    return {f"model.{name}": f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for name, p in model.named_parameters()}


def _digest(items: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(list(items.items())).encode()).hexdigest()[:32]


@attrs.define
class Agreement:
    """This rank's side of the start-up comparison for one run (``ctx.run.agreement``).

    Attributes:
        channel: the run's fingerprint keys (``run.channel.child("fingerprint")``, `distfn.rankstore.Channel`).
        timeout_s: how long a rank waits for the others to reach the same ``ctx.wrap`` before it goes on unchecked.
        cfg: this rank's `cfg_items`.
        wraps: the ``ctx.wrap`` calls compared so far (each has its own keys).
    """

    channel: Channel
    timeout_s: float
    cfg: dict[str, str]
    wraps: int = 0

    @classmethod
    def start(cls, channel: Channel, cfg: Any, timeout_s: float) -> Agreement | None:
        """The run's comparison on ``channel`` (``None`` when ``DISTFN_FINGERPRINT=0``)."""
        if os.environ.get("DISTFN_FINGERPRINT", "1").strip() == "0":
            return None
        return cls(channel, timeout_s, cfg_items(cfg))

    @property
    def rank(self) -> int:
        """This rank."""
        return self.channel.rank

    def check(self, model: nn.Module) -> None:
        """Compare the cfg and ``model`` with every rank's; raise `ConfigError` on the first difference."""
        self.wraps += 1
        items = {**self.cfg, **model_items(model)}
        wrap = f"wrap{self.wraps}"
        self.channel.post(f"{wrap}/digest", _digest(items))
        found = self.channel.wait_all(f"{wrap}/digest", self.timeout_s)
        if len(found) < self.channel.world_size:
            logger.debug("fingerprint: not every rank reached ctx.wrap #{} in time; not compared", self.wraps)
            return
        digests = [found[r].decode() for r in range(self.channel.world_size)]
        if len(set(digests)) == 1:
            return
        sides: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            sides.setdefault(d, []).append(r)
        groups = sorted(sides.values())  # rank 0's side first
        # the items themselves travel only now, one rank per side: a large model's list stays off the store
        if any(g[0] == self.rank for g in groups):
            self.channel.post(f"{wrap}/items", json.dumps(items))
        firsts = [g[0] for g in groups]
        reps = self.channel.wait_all(f"{wrap}/items", self.timeout_s, firsts)
        if len(reps) < len(firsts):
            raise ConfigError(f"the ranks were given different inputs at ctx.wrap #{self.wraps}: "
                              f"{'; '.join(ranks_phrase(g) for g in groups)} differ (cfg or model)")
        raise ConfigError(self._explain({r: json.loads(v) for r, v in reps.items()}, groups))

    def _explain(self, reps: dict[int, dict[str, str]], groups: list[list[int]]) -> str:
        ref = reps[groups[0][0]]
        lines = []
        for other in groups[1:]:
            theirs = reps[other[0]]
            first = next(k for k in [*ref, *(k for k in theirs if k not in ref)] if ref.get(k) != theirs.get(k))
            what = "the cfg" if first.startswith("cfg") else "the wrapped model"
            lines.append(f"{what} differs at {first!r}: {ref.get(first, '(absent)')} on {ranks_phrase(groups[0])}, "
                         f"{theirs.get(first, '(absent)')} on {ranks_phrase(other)}")
        return (f"the ranks were given different inputs at ctx.wrap #{self.wraps}: " + "; ".join(lines) + ". Every "
                "rank must get the same cfg and build the same model (check the config files and arguments of "
                "each node; a model built from data seen by one rank only). A cfg meant to differ between ranks: "
                "derive that part from ctx.rank inside the function, or set DISTFN_FINGERPRINT=0.")
