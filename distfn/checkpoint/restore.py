"""Restoring in place: `load_into` validates every target against the file first, then restores them all.

A mismatch (missing keys, shapes, optimizer layout) therefore leaves every target untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Final

import attrs
import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader

from .. import tree
from ..errors import CheckpointError
from ..modules import unwrap_module
from . import format as fmt
from . import sharded, storage
from .layout import Location, resolve

__all__ = ["load_into"]

_WRAPPER_SEGMENTS: Final = ("module", "_orig_mod")


def _child(node: dict[Any, Any], key: Any) -> Any:
    """``node[key]``, or for flat files the entries under ``key.`` gathered into a sub-mapping."""
    if key in node:
        return node[key]
    prefix = f"{key}."
    sub = {k[len(prefix):]: v for k, v in node.items() if isinstance(k, str) and k.startswith(prefix)}
    return sub or None


def _restorable(value: Any) -> bool:
    """Whether ``value`` is restored in place (a module, optimizer, tensor or stateful object)."""
    return isinstance(value, (nn.Module, torch.optim.Optimizer, torch.Tensor)) or fmt.is_stateful(value)


def _plain(value: Any) -> bool:
    """A plain value of ``into=`` (``0``, ``"run"``, ``[]``): replaced by the saved value instead of restored in
    place. A mapping is not plain (its entries are matched one by one), nor a list holding restorable objects."""
    if isinstance(value, Mapping):
        return False
    return not any(_restorable(leaf) for leaf in tree.tree_leaves(value, is_leaf=_restorable))


def _strip_wrappers(key: str) -> str:
    parts = key.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_SEGMENTS:
        parts = parts[1:]
    return ".".join(p for i, p in enumerate(parts) if p != "_orig_mod" or i == len(parts) - 1)


@attrs.define
class _Step:
    """One validated restore, applied after every target has been checked."""

    where: str
    apply: Callable[[], None]


@attrs.frozen
class _ModuleMatch:
    """How a module's state dict keys map onto a file's entries (the result of validation)."""

    file_keys: dict[str, Any]  # module key -> key of the file's mapping
    missing: list[str]
    unexpected: list[str]


class _Restorer:
    def __init__(self, reader: storage.Reader, device: torch.device, strict: bool) -> None:
        self.reader = reader
        self.device = device
        self.strict = strict
        self.steps: list[_Step] = []
        self.file = reader.header.path

    # -- dispatch ---------------------------------------------------------------------------------
    def plan(self, target: Any, node: Any, path: tuple[Any, ...]) -> Any:
        """Validate restoring ``target`` from ``node``; queue the work; return leftovers (for mappings)."""
        where = fmt.path_str(path)
        if isinstance(target, nn.Module):
            self._module(target, node, where)
        elif isinstance(target, torch.optim.Optimizer):
            self._optimizer(target, node, where)
        elif isinstance(target, torch.Tensor):
            self._tensor(target, node, where)
        elif isinstance(target, Mapping):
            return self.mapping(target, node, path)
        elif fmt.is_stateful(target):
            self.steps.append(_Step(where, lambda: target.load_state_dict(fmt.decode(node, self.reader, self.device))))
        elif isinstance(target, DataLoader):
            fmt.refuse_plain_loader(target, node, where)
        else:
            raise CheckpointError(
                f"cannot restore into {type(target).__qualname__} at '{where}': into= takes modules, optimizers, "
                "schedulers, GradScalers, tensors, objects with load_state_dict() and mappings of those (plain "
                "values such as a step count are replaced by the saved value)."
            )
        return None

    def mapping(self, into: Mapping[Any, Any], node: Any, path: tuple[Any, ...]) -> dict[Any, Any]:
        where = fmt.path_str(path)
        children = fmt.as_plain_dict(node)
        if children is None:
            raise CheckpointError(f"'{self.file}': expected a mapping at '{where}' to restore "
                                  f"{fmt.describe([str(k) for k in into])} into, found {fmt.kind(node)}")
        missing = []
        used: set[Any] = set()
        for key, target in into.items():
            if target is None:
                continue
            child = _child(children, key)
            if child is None:
                missing.append(key)
                continue
            if _plain(target):  # e.g. "step": 0 -> the saved step (returned, and set in `into` when it can be)
                fmt.refuse_plain_loader(target, child, fmt.path_str((*path, key)))
                self._replace(into, key, child, (*path, key))
                continue
            used.add(key)
            if key not in children:  # gathered from "key.*" names
                used.update(k for k in children if isinstance(k, str) and k.startswith(f"{key}."))
            self.plan(target, child, (*path, key))
        if missing:
            self._report_missing(missing, children)
        return {k: v for k, v in children.items() if k not in used}

    def _replace(self, into: Mapping[Any, Any], key: Any, node: Any, path: tuple[Any, ...]) -> None:
        if not isinstance(into, MutableMapping):
            return  # left in the returned values only

        def apply() -> None:
            into[key] = fmt.decode(node, self.reader, self.device)

        self.steps.append(_Step(fmt.path_str(path), apply))

    def _report_missing(self, missing: list[Any], children: dict[Any, Any]) -> None:
        holds = fmt.describe([str(k) for k in children])
        hint = ""
        if all(fmt.ref(v) is not None for v in children.values()):
            hint = " The file holds a bare state dict; to load a module from it pass into=model."
        msg = f"'{self.file}' has no entry for {fmt.describe([str(k) for k in missing])} (it holds {holds}).{hint}"
        if self.strict:
            raise CheckpointError(msg)
        logger.warning("{} (strict=False: left as they are)", msg)

    # -- modules ------------------------------------------------------------------------------------
    def _module(self, target: nn.Module, node: Any, where: str) -> None:
        module = unwrap_module(target)
        children = self._module_entries(node, where)
        match = self._match_module(module, children, where)
        missing, unexpected, file_keys = match.missing, match.unexpected, match.file_keys

        def apply() -> None:
            # Read on the CPU: load_state_dict copies each tensor straight into the parameter, on its device.
            state = {k: fmt.decode(children[orig], self.reader, torch.device("cpu"))
                     for k, orig in file_keys.items() if k not in unexpected}
            result = module.load_state_dict(state, strict=False)
            if result.missing_keys and self.strict:  # hooks may add requirements; report them the same way
                still = [k for k in result.missing_keys if k in missing]
                if still:
                    raise CheckpointError(f"'{self.file}': keys missing for '{where}': {fmt.describe(still)}")

        self.steps.append(_Step(where, apply))

    def _module_entries(self, node: Any, where: str) -> dict[Any, Any]:
        """The file's mapping for a module at ``where``: tensor references (and ``_extra_state`` values) only."""
        children = fmt.as_plain_dict(node)
        if children is None:
            raise CheckpointError(f"'{self.file}': expected a module state dict at '{where}', found {fmt.kind(node)}")
        bad = [k for k, v in children.items() if fmt.ref(v) is None and not str(k).endswith("_extra_state")]
        if bad:
            raise CheckpointError(
                f"'{self.file}' holds a training state ({fmt.describe([str(k) for k in children])}), not a module "
                f"state dict at '{where}'; pass into={{'model': model, ...}} naming the entries to restore."
            )
        return children

    def _match_module(self, module: nn.Module, children: dict[Any, Any], where: str) -> _ModuleMatch:
        """Check the file's keys and shapes against ``module``'s state dict (raising, or warning when not strict)."""
        expected = module.state_dict()
        file_keys = _file_keys(children, expected)
        missing = [k for k in expected if k not in file_keys]
        if missing:  # a tied weight the file stores once (e.g. files written by other tools) is not missing
            tied = _tied_keys(expected, file_keys)
            missing = [k for k in missing if k not in tied]
        unexpected = [k for k in file_keys if k not in expected]
        prefix = "" if where == "<root>" else f"{where}."
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing from the file: {fmt.describe([prefix + k for k in missing])}")
            if unexpected:
                parts.append(f"unexpected in the file: {fmt.describe([prefix + k for k in unexpected])}")
            msg = f"'{self.file}' does not match the module at '{where}': " + "; ".join(parts)
            if self.strict:
                raise CheckpointError(msg + " (pass strict=False to load the matching keys only)")
            logger.warning("{} (strict=False: loading the matching keys)", msg)
        for key, value in expected.items():
            if key in file_keys and isinstance(value, torch.Tensor):
                self._check_shape(fmt.ref(children[file_keys[key]]), list(value.shape), f"{prefix}{key}", "model")
        return _ModuleMatch(file_keys, missing, unexpected)

    def _check_shape(self, name: str | None, want: list[int], where: str, what: str) -> None:
        shape = list(self.reader.header.tensors.get(name or "", {}).get("shape", []))
        if shape != want:
            raise CheckpointError(f"'{self.file}': shape mismatch at '{where}': the file has {shape}, the {what} "
                                  f"has {want}")

    # -- other kinds ----------------------------------------------------------------------------------
    def _optimizer(self, target: torch.optim.Optimizer, node: Any, where: str) -> None:
        children = fmt.as_plain_dict(node)
        groups = children.get("param_groups") if children else None
        if children is None or "state" not in children or not isinstance(groups, list):
            raise CheckpointError(f"'{self.file}': the entry at '{where}' is not an optimizer state "
                                  f"(found {fmt.kind(node)})")
        saved = [len(_group_params(g)) for g in groups]
        live = [len(g["params"]) for g in target.param_groups]
        if saved != live:
            raise CheckpointError(
                f"'{self.file}': the optimizer at '{where}' does not match: the file has {len(saved)} param "
                f"group(s) with {saved} parameters, the optimizer has {len(live)} with {live}"
            )

        def apply() -> None:
            # CPU tensors: Optimizer.load_state_dict moves each to its parameter's device and dtype
            # (and keeps 'step' where the optimizer wants it).
            state = fmt.decode(node, self.reader, torch.device("cpu"))
            try:
                target.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"'{self.file}': cannot restore the optimizer at '{where}': {exc}") from exc

        self.steps.append(_Step(where, apply))

    def _tensor(self, target: torch.Tensor, node: Any, where: str) -> None:
        name = fmt.ref(node)
        if name is None:
            raise CheckpointError(f"'{self.file}': expected a tensor at '{where}', found {fmt.kind(node)}")
        self._check_shape(name, list(target.shape), where, "tensor")

        def apply() -> None:
            with torch.no_grad():
                target.copy_(self.reader.get(name, torch.device("cpu")))

        self.steps.append(_Step(where, apply))


def _group_params(group: Any) -> list[Any]:
    plain = fmt.as_plain_dict(group)
    return list(plain.get("params", [])) if plain else []


def _file_keys(children: dict[Any, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """Module key -> file key; files written from a wrapped module (by other tools) have their prefixes removed."""
    file_keys = {str(k): k for k in children}
    if set(expected) == set(file_keys):
        return file_keys
    # Files written from a wrapped module (by other tools): 'module.fc.weight', '_orig_mod.fc.weight'.
    stripped = {_strip_wrappers(k): orig for k, orig in file_keys.items()}
    if len(stripped) == len(file_keys) and len(set(stripped) & set(expected)) > len(set(file_keys) & set(expected)):
        return stripped
    return file_keys


def _tied_keys(expected: Mapping[str, Any], file_keys: Mapping[str, Any]) -> set[str]:
    """Keys of ``expected`` that share memory with a key the file has (tied weights stored once)."""
    by_memory: dict[tuple[Any, ...], list[str]] = {}
    for k, t in expected.items():
        if isinstance(t, torch.Tensor) and t.numel():
            by_memory.setdefault((t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)),
                                 []).append(k)
    return {k for group in by_memory.values() if any(g in file_keys for g in group) for k in group}


def load_into(
    path: str | os.PathLike[str] | Location,
    into: Mapping[str, Any] | nn.Module | torch.optim.Optimizer | Any,
    *,
    device: str | torch.device = "cpu",
    strict: bool = True,
) -> dict[str, Any]:
    """Restore objects in place from a checkpoint and return the values that were not restored in place.

    Every target is validated first (keys, shapes, optimizer structure) and only then restored, so a mismatch
    leaves all targets untouched.

    Args:
        path: a ``.safetensors`` file (written by `distfn.checkpoint.save` or by other tools), or a sharded
            checkpoint directory (read by `distfn.checkpoint.sharded.load_into`, in any process and world size:
            ``load_into(directory, {})`` gives its plain values, such as a data loader's saved position).
        into: a module (possibly wrapped) for a module file (or any single object the file was saved from,
            e.g. an optimizer), or a mapping naming the entries of a training state to restore, e.g.
            ``{"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "rng": RNG}``. Values
            may be modules, optimizers, schedulers, ``GradScaler`` objects, tensors, objects with
            ``load_state_dict()``, nested mappings of those, or ``None`` (skipped). A plain value (``"step": 0``,
            a string, a list of numbers) is replaced by the saved one: set in ``into`` itself when it is a
            mutable mapping, and returned (top-level entries). Module entries accept keys prefixed by
            ``module.`` / ``_orig_mod.``.
        device: where returned tensors (and the state of generic stateful objects) are placed. Module and
            optimizer tensors go to their parameters' devices.
        strict: when true (default) a missing entry, a missing or unexpected module key is an error; when
            false it is logged as a warning and the matching part is restored.

    Returns:
        The file's top-level entries that ``into`` did not restore in place (``step``, ``epoch``, ``best``, ...,
        including those ``into`` held as plain values), decoded: tensors on ``device``, other values as saved.
        ``{}`` when ``into`` is a single object.

    Raises:
        CheckpointError: unreadable or pickle file, missing/unexpected keys (strict), the first shape mismatch
            (naming the key and both shapes), an optimizer with another parameter layout.
    """
    dev = torch.device(device)
    loc = path if isinstance(path, Location) else resolve(path)
    if loc.layout() in ("sharded", "dir") and isinstance(into, (Mapping, nn.Module)):
        return sharded.load_into(loc, into, device=dev, strict=strict)
    with storage.open_reader(loc, dev) as reader:
        tree = fmt.check(reader.header)  # the whole header: a malformed file fails before anything is restored
        restorer = _Restorer(reader, dev, strict)
        if isinstance(into, Mapping):
            leftovers: dict[Any, Any] = restorer.mapping(into, tree, ())
        elif isinstance(into, (nn.Module, torch.Tensor)) or fmt.is_stateful(into):
            restorer.plan(into, tree, ())  # a file saved from this one object (e.g. save(optimizer, path))
            leftovers = {}
        else:
            raise CheckpointError(f"into= must be a module, a stateful object or a mapping of objects to restore, "
                                  f"got {type(into).__qualname__}")
        for step in restorer.steps:
            step.apply()
        result = {k: fmt.decode(v, reader, dev) for k, v in leftovers.items()}
    logger.debug("loaded {} into {}", reader.header.path, fmt.describe([s.where for s in restorer.steps]))
    return result
