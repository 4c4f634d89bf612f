"""Divergent ranks caught at the start: every ``ctx.wrap`` compares what the ranks were given.

Different hyperparameters on different nodes (a config file that differs, an argument given to one ``srun`` task
only) or a model built differently on one rank (pytorch/pytorch#32426) otherwise end in a hang at the first
collective whose sizes disagree, or, worse, in silently different training. So at each ``ctx.wrap`` (before DDP's
or FSDP's own collectives) every rank posts a digest of the cfg's items and of the model's parameters (name,
shape, dtype) to the process group's store, and compares the others' digests: no collective, two store round
trips when they agree (only the digests travel; the items themselves only after a mismatch, one rank per side).
On a mismatch every rank raises the same `ConfigError`, naming the first differing key
and the ranks on each side.

A cfg item is compared by its canonical form (`canonical`): mappings by sorted key and sets by sorted element
(two equal dicts built in another order, or a set under another hash seed, are the same input), anything else by
its ``repr``; an item whose ``repr`` holds a memory address (``<object at 0x...>``), which differs between
processes by nature, is compared by its type alone. An item with no canonical form (its ``repr`` raises, it is
nested over 100 deep) is left out of the comparison, said in one line; it never fails the job.
``DISTFN_FINGERPRINT=0`` turns the check off (for a cfg that is meant to differ between ranks; better: derive
the per-rank part from ``ctx.rank``).

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
#: A leaf nested deeper than this (a cfg built by recursion, a list that holds itself) is not compared.
_MAX_NESTING: Final = 100
#: Containers walked for one leaf at most (its canonical form is built in Python); a list of plain strings or
#: numbers (a dataset's file list) counts as one, however long.
_MAX_NODES: Final = 100_000
_PLAIN: Final = (str, int, float, bool, type(None), bytes, complex)


class Unfingerprintable(Exception):
    """A cfg value has no canonical form (its ``repr`` raised, it is nested too deep, or too large): it is not
    compared, and the rest of the cfg still is."""


def _plain(value: Any) -> str:
    """The repr of a value of a `_PLAIN` type (exactly that type: a subclass's repr is its own)."""
    try:
        return repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits(): hex has no such limit
        return hex(value)


def canonical(value: Any) -> str:
    """A text that is equal on every process for equal values, whatever their construction order or hash seed.

    Mappings by sorted key, sets and frozensets by sorted element, dataclasses, attrs classes and namespaces by
    field; any other value by its ``repr``, or its type alone where the repr holds a memory address (which
    differs between processes by nature). Raises `Unfingerprintable` (never anything else) for a value whose
    repr raises, nested deeper than `_MAX_NESTING` or larger than `_MAX_NODES` containers.
    """
    budget = [_MAX_NODES]
    try:
        return _canonical(value, 0, budget)
    except Unfingerprintable:
        raise
    except RecursionError:
        raise Unfingerprintable("nested too deep") from None
    except Exception as exc:  # noqa: BLE001 - a hostile __repr__, __eq__, items() or keys(): not comparable
        raise Unfingerprintable(f"{type(exc).__name__} from its repr") from None


def _canonical(value: Any, depth: int, budget: list[int]) -> str:
    kind = type(value)
    if kind in _PLAIN:
        return _plain(value)
    if depth >= _MAX_NESTING:
        raise Unfingerprintable(f"nested deeper than {_MAX_NESTING}")
    budget[0] -= 1
    if budget[0] < 0:
        raise Unfingerprintable(f"more than {_MAX_NODES} nested containers")
    name = kind.__qualname__
    if kind in (list, tuple) and all(type(v) in _PLAIN for v in value):
        # the common long list (file names): its repr is canonical already, and C-fast (1M names: 0.8 s, not 3)
        try:
            return f"{name}{value!r}"
        except ValueError:  # an int past the int-to-str limit inside
            return f"{name}({', '.join(map(_plain, value))})"
    if isinstance(value, Mapping):
        pairs = sorted(f"{_canonical(k, depth + 1, budget)}: {_canonical(v, depth + 1, budget)}"
                       for k, v in value.items())
        return f"{name}{{{', '.join(pairs)}}}"
    if isinstance(value, (set, frozenset)):
        return f"{name}{{{', '.join(sorted(_canonical(v, depth + 1, budget) for v in value))}}}"
    if isinstance(value, (list, tuple)):
        return f"{name}({', '.join(_canonical(v, depth + 1, budget) for v in value)})"
    fields = _fields(value)
    if fields is not None:
        return f"{name}({', '.join(f'{k}={_canonical(v, depth + 1, budget)}' for k, v in fields.items())})"
    text = repr(value)
    if not isinstance(text, str):
        raise Unfingerprintable("its repr is not a string")
    return f"<{name}>" if _ADDRESS.search(text) else text


def _fields(value: Any) -> dict[str, Any] | None:
    """The fields of a dataclass, attrs or namespace instance (``None`` for anything else)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if attrs.has(type(value)):
        return {a.name: getattr(value, a.name) for a in attrs.fields(type(value))}
    if type(value).__name__ in ("Namespace", "SimpleNamespace") and hasattr(value, "__dict__"):
        return dict(sorted(vars(value).items()))  # argparse / types.SimpleNamespace
    return None


def _value(value: Any) -> str:
    """What a cfg leaf is compared by: its `canonical` form, shortened to `_MAX_REPR` characters with the whole
    form's digest (so a difference past the cut still counts). Raises `Unfingerprintable`."""
    text = canonical(value)
    if len(text) <= _MAX_REPR:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{text[:_MAX_REPR - 25]}... (sha256 {digest})"


def cfg_items(cfg: Any, prefix: str = "cfg", depth: int = 0) -> dict[str, str]:
    """``{dotted key: canonical form}`` of ``cfg``'s leaves: mappings (by sorted key), dataclasses, attrs
    classes, namespaces, lists.

    Never raises: a leaf without a canonical form (`Unfingerprintable`) is left out, and one line says which
    and why (every rank leaves the same ones out of the same cfg, so the rest is still compared).
    """
    skipped: dict[str, str] = {}
    out = _items(cfg, prefix, depth, skipped)
    if skipped:
        shown = "; ".join(f"{k} ({why})" for k, why in list(skipped.items())[:3])
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        logger.info("fingerprint: {} not compared between ranks: {}{}", "this cfg item is" if len(skipped) == 1
                    else "these cfg items are", shown, more)
    return out


def _items(cfg: Any, prefix: str, depth: int, skipped: dict[str, str]) -> dict[str, str]:
    try:
        children = _children(cfg) if depth < _MAX_DEPTH else None
    except Exception as exc:  # noqa: BLE001 - a hostile mapping or field: compared (or skipped) whole
        logger.debug("fingerprint: {} is compared whole: {!r}", prefix, exc)
        children = None
    if children is None or len(children) > _MAX_CHILDREN:
        try:
            return {prefix: _value(cfg)}
        except Unfingerprintable as exc:
            skipped[prefix] = str(exc)
            return {}
    out: dict[str, str] = {}
    for key, value in children.items():
        out.update(_items(value, f"{prefix}.{key}", depth + 1, skipped))
    if not children:
        try:
            out[prefix] = _value(cfg)
        except Unfingerprintable as exc:
            skipped[prefix] = str(exc)
    return out


def _children(cfg: Any) -> dict[str, Any] | None:
    """The named parts of a container cfg (mapping keys sorted: two equal dicts built in another order give the
    same items), or ``None`` for a leaf."""
    if isinstance(cfg, Mapping):
        named = {(k if type(k) is str else canonical(k)): v for k, v in cfg.items()}
        return dict(sorted(named.items()))
    if isinstance(cfg, (list, tuple)):
        return {str(i): v for i, v in enumerate(cfg)}
    return _fields(cfg)


def model_items(model: nn.Module) -> dict[str, str]:
    """``{"model.<parameter name>": "(shape) dtype"}`` for every parameter of ``model``."""
    return {f"model.{name}": f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            for name, p in model.named_parameters()}


def _digest(items: Mapping[str, str]) -> str:
    """The items' digest, by sorted key: the same items in another order are the same inputs."""
    return hashlib.sha256(json.dumps(sorted(items.items())).encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
