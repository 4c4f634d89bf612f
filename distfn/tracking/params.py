"""The cfg as a run's parameters: flattened to ``{"optim.lr": "0.001"}``, JSON-able values only.

A cfg may be a mapping, a dataclass, an attrs class, an ``argparse.Namespace`` or anything with ``vars()``;
nested ones are joined with dots. Leaves that JSON cannot hold (tensors, functions, open files) are left out
rather than logged as an unreadable ``repr``; lists of plain values are logged as their JSON text.

Imports: nothing from distfn.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

#: The longest parameter value kept (MLflow refuses longer ones; longer text is seldom a hyperparameter).
MAX_VALUE = 6000


def _children(value: Any) -> Mapping[Any, Any] | None:
    """The named parts of a composite cfg value, or ``None`` for a leaf."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if attrs.has(type(value)):
        return {a.name: getattr(value, a.name) for a in attrs.fields(type(value))}
    if type(value).__module__ == "argparse" and hasattr(value, "__dict__"):
        return vars(value)
    # OmegaConf's DictConfig and similar: a mapping in all but its base class
    if hasattr(value, "items") and hasattr(value, "keys") and not isinstance(value, (str, bytes)):
        try:
            return dict(value.items())
        except Exception:  # noqa: BLE001 - an object with an odd items(): treat it as a leaf
            return None
    return None


def _leaf(value: Any) -> str | None:
    """The text of a JSON-able leaf, or ``None`` when it is not one."""
    if value is None or isinstance(value, (bool, int, str)):
        text = value if isinstance(value, str) else json.dumps(value)
    elif isinstance(value, float):
        text = repr(value) if math.isfinite(value) else str(value)
    elif isinstance(value, (list, tuple)):
        try:
            text = json.dumps(list(value), allow_nan=False)
        except (TypeError, ValueError):
            return None
    else:
        return None
    return text if len(text) <= MAX_VALUE else None


def flatten(cfg: Any, prefix: str = "") -> dict[str, str]:
    """``cfg`` as flat ``{dotted name: text}`` parameters (empty for ``None`` or a cfg with no named parts; a
    plain value is logged as ``cfg``)."""
    children = _children(cfg)
    if children is None:
        text = _leaf(cfg) if cfg is not None else None
        return {} if text is None else {prefix or "cfg": text}
    out: dict[str, str] = {}
    for name, value in children.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if str(name).startswith("_"):
            continue  # private state of a config object, not a setting
        out.update(flatten(value, key) if _children(value) is not None else
                   ({key: text} if (text := _leaf(value)) is not None else {}))
    return out
