"""Restoring in place from a sharded checkpoint, onto any world size and any mode (resharding).

`load_into` checks the directory whole (`distfn.checkpoint.sharded.read.open_checkpoint`), then every target of
``into`` against it (names, shapes, param groups) before anything changes; sharded (FSDP2) modules and optimizers
then read only their own slices through torch's resharding load and `distfn.checkpoint.sharded.reader.ShardReader`
(memory-mapped shards on a local disk, ranged reads on an object store), plain ones whole tensors. Each rank plans
its own reads: no collective.

torch's checkpoint modules cost ~0.3 s to import: they are imported inside the functions that use them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ... import tree
from ...errors import CheckpointError
from ...modules import indexed_optimizer_state, unwrap_module
from .. import format as fmt
from ..layout import Location
from ..objects import is_object, owner_of
from .read import Checkpoint, Chunks, open_checkpoint

__all__ = ["load_into"]

_NO_MODEL = ("loading an optimizer from a sharded checkpoint needs its model in the same `into` mapping (e.g. "
             "{'model': model, 'optimizer': opt})")


class _Restore:
    """Collects, for every module and optimizer of ``into``, the live tensors to fill (by stored name); fills
    them with one resharding `torch.distributed.checkpoint.load`; then applies them and every other value."""

    def __init__(self, checkpoint: Checkpoint, strict: bool) -> None:
        self.directory = checkpoint.location
        self.strict = strict
        self.targets: dict[str, torch.Tensor] = {}
        self.ties: list[tuple[torch.Tensor, str]] = []
        self.after: list[Any] = []
        self.chunks = Chunks(checkpoint)

    def _want(self, stored: str, tensor: torch.Tensor) -> None:
        if stored in self.targets:
            if self.targets[stored] is not tensor:
                self.ties.append((tensor, stored))
            return
        self.targets[stored] = tensor

    def module(self, where: str, module: nn.Module, node: Any) -> None:
        live = unwrap_module(module).state_dict()
        saved = fmt.as_plain_dict(node)
        if saved is None:
            raise CheckpointError(f"'{where}' in the checkpoint is {fmt.kind(node)}, not a module's state")
        live_keys = {k for k, v in live.items() if isinstance(v, torch.Tensor)}
        missing = sorted(live_keys - set(saved))
        unexpected = sorted(k for k in saved if k not in live_keys and fmt.ref(saved[k]) is not None)
        if self.strict and (missing or unexpected):
            raise CheckpointError(f"cannot load '{where}': missing keys {fmt.describe(missing)}; unexpected keys "
                                  f"{fmt.describe(unexpected)} (strict=False skips them). Nothing was changed.")
        for k in sorted(live_keys & set(saved)):
            stored = fmt.ref(saved[k])
            if stored is None:
                raise CheckpointError(f"'{where}.{k}' in the checkpoint is {fmt.kind(saved[k])}, not a tensor")
            self._check_shape(f"{where}.{k}", stored, live[k])
            self._want(stored, live[k])
        self.after.append(lambda: unwrap_module(module).load_state_dict(live, strict=False))

    def _check_shape(self, where: str, stored: str, live: torch.Tensor) -> None:
        spec = self.chunks.checkpoint.shapes.get(stored)
        if spec is not None and list(spec[1]) != list(live.shape):
            raise CheckpointError(f"cannot load '{where}': the checkpoint holds shape {tuple(spec[1])}, the "
                                  f"live tensor has {tuple(live.shape)}. Nothing was changed.")

    def optimizer(self, where: str, opt: torch.optim.Optimizer, node: Any, modules: list[nn.Module]) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        saved = fmt.as_plain_dict(node)
        saved_state = fmt.as_plain_dict(saved.get("state")) if saved else None
        if saved is None or saved_state is None or "param_groups" not in saved:
            raise CheckpointError(f"'{where}' in the checkpoint is {fmt.kind(node)}, not an optimizer's state")
        groups = fmt.decode(saved["param_groups"], fmt.NoTensors())
        if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                   for g in groups):
            raise CheckpointError(f"'{where}' in the checkpoint is not an optimizer's state: its param_groups are "
                                  f"{fmt.brief(groups)}, not a list of groups with params. Nothing was changed.")
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
            raise CheckpointError(f"cannot load '{where}': the checkpoint's optimizer has param groups of sizes "
                                  f"{[len(g['params']) for g in groups]}, the live one "
                                  f"{[len(g['params']) for g in opt.param_groups]}. Nothing was changed.")
        ids = [j for g in groups for j in g["params"]]
        if sorted(ids, key=str) != sorted(range(len(ids)), key=str):  # torch numbers them 0..n-1 (key: any type)
            raise CheckpointError(f"'{where}' in the checkpoint is not an optimizer's state: its param groups list "
                                  f"the parameters {fmt.brief(ids)}, not 0..{len(ids) - 1} once each. Nothing was "
                                  "changed.")
        model = owner_of(opt, modules, _NO_MODEL)
        named: Any = get_optimizer_state_dict(model, opt)  # creates the moments of a fresh optimizer
        order = [fqn for g in named["param_groups"] for fqn in g["params"]]
        indexed = indexed_optimizer_state(named)
        state: dict[int, dict[str, Any]] = {}
        for i, entry in saved_state.items():
            number = i if fmt.natural(i) else int(i) if isinstance(i, str) and i.isascii() and i.isdigit() else None
            if number is None or number >= len(order):
                raise CheckpointError(f"'{where}' in the checkpoint holds state for parameter {fmt.brief(i)}, the "
                                      f"optimizer has {len(order)} parameters. Nothing was changed.")
            values = fmt.as_plain_dict(entry) or {}
            live = indexed["state"].get(int(i), {})
            state[int(i)] = {}
            for k, v in values.items():
                stored = fmt.ref(v)
                if stored is not None and isinstance(live.get(k), torch.Tensor):
                    self._check_shape(f"{where}.state.{i}.{k}", stored, live[k])
                    self._want(stored, live[k])
                    state[int(i)][k] = live[k]
                else:
                    state[int(i)][k] = fmt.decode(v, self.chunks)

        def apply() -> None:
            full: Any = {"state": {order[i]: v for i, v in state.items()},
                    "param_groups": [{**g, "params": [order[j] for j in g["params"]]} for g in groups]}
            set_optimizer_state_dict(model, opt, full)

        self.after.append(apply)

    def run(self) -> None:
        from torch.distributed.checkpoint import load as dcp_load  # ~0.3 s, paid by sharded loads only

        from .reader import ShardReader  # imports torch's checkpoint modules too

        if self.targets:
            # no_dist: each rank plans its own reads (its slices only); no collective, so no rank can hang here
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(self.targets, storage_reader=ShardReader(self.chunks.checkpoint), no_dist=True)
        for tensor, stored in self.ties:
            with torch.no_grad():
                tensor.copy_(self.targets[stored])
        for step in self.after:
            step()


def _objects(into: Any) -> Iterator[Any]:
    return iter(x for x in tree.tree_leaves(into, is_leaf=is_object) if isinstance(x, nn.Module))


def load_into(
    path: str | os.PathLike[str] | Location,
    into: nn.Module | Mapping[str, Any],
    *,
    device: torch.device | str = "cpu",
    strict: bool = True,
) -> dict[str, Any]:
    """Restore ``into`` in place from a sharded checkpoint, onto any world size and any mode.

    Sharded (FSDP2) modules and optimizers read only their own slices; plain ones read whole tensors; each rank
    plans its own reads from memory-mapped shards, so there is no collective. Everything is checked (names,
    shapes, param groups) before anything changes.

    Args:
        path: the checkpoint directory.
        into: a module, or a mapping of modules / optimizers / schedulers / plain values (restored in place).
        device: where tensors of plain values go.
        strict: every tensor of a module must be in the checkpoint and nothing extra.

    Returns:
        The saved values not restored in place (``step``, ...), like `distfn.checkpoint.load_into`.
    """
    checkpoint = open_checkpoint(path)
    saved, d = checkpoint.tree, checkpoint.location
    job = _Restore(checkpoint, strict)
    dev = torch.device(device)
    if isinstance(into, nn.Module) or not isinstance(into, Mapping):
        if isinstance(into, torch.optim.Optimizer) or not isinstance(into, nn.Module):
            raise CheckpointError("into= must be a module or a mapping (an optimizer needs its model next to it)")
        job.module("<root>", into, saved)
        job.run()
        return {}
    nodes = fmt.as_plain_dict(saved)
    if nodes is None:
        raise CheckpointError(f"'{d}' holds {fmt.kind(saved)}, not a mapping: load it into a module")
    plain = _plan_mapping(job, into, nodes, strict, dev)
    job.run()
    out = {k: fmt.decode(v, job.chunks, dev) for k, v in nodes.items() if k not in into or k in plain}
    job.chunks.close()
    if isinstance(into, dict):
        for k in plain:
            into[k] = out[k]
    return out


def _plan_mapping(job: _Restore, into: Mapping[str, Any], nodes: Mapping[Any, Any], strict: bool,
                  dev: torch.device) -> set[str]:
    """Queue every entry of ``into`` on ``job``; the keys of plain values (replaced by the saved ones)."""
    modules = list(_objects(into))
    plain: set[str] = set()
    for key, value in into.items():
        if key not in nodes:
            if value is not None and strict and is_object(value):
                raise CheckpointError(f"cannot load '{key}': the checkpoint has no such entry (it holds "
                                      f"{fmt.describe(sorted(str(k) for k in nodes))}). Nothing was changed.")
            continue
        if isinstance(value, nn.Module):
            job.module(str(key), value, nodes[key])
        elif isinstance(value, torch.optim.Optimizer):
            job.optimizer(str(key), value, nodes[key], modules)
        elif fmt.is_stateful(value):
            obj, node = value, nodes[key]
            job.after.append(lambda obj=obj, node=node: obj.load_state_dict(fmt.decode(node, job.chunks, dev)))
        elif value is not None:
            fmt.refuse_plain_loader(value, nodes[key], str(key))  # a torch DataLoader: no position to take
            plain.add(key)
    return plain
