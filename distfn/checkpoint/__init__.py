"""Checkpoints as standard ``.safetensors``: streamed, atomic, pickle-free, full training state.

``save(obj, path)`` accepts a module (bare, ``DistributedDataParallel``, ``DataParallel``, ``torch.compile``-d:
stored with the bare module's keys), a flat ``{name: tensor}`` mapping, or a **training state**: any mapping such
as ``{"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "step": 1200, "rng": RNG}`` whose
values are modules, optimizers, LR schedulers, ``GradScaler`` objects, anything else with
``state_dict()``/``load_state_dict()``, tensors, and plain JSON-like values, nested freely. The file layout, the
durability promise and the loading rules are specified in docs/checkpoints.md ("File format").

The package, bottom up: `fs` (the storage seam: every file-system call, `fs.LocalFileSystem` first), `layout`
(what a path names: `resolve`, step-numbered names, ``keep=`` rotation), `format` (object <-> header and JSON
tree), `storage` (the atomic streaming writer and the memory-mapped reader of one file), `objects`,
`background` (asynchronous saves), `restore` (`load_into` for one file), `sharded` (directories every rank writes:
`sharded.write`, `sharded.read`, `sharded.restore`), `names` (the names checkpoints are recognised by), and `api`
(the plain functions below). What ``ctx.save``/``load``/``resume`` do is `distfn.checkpointing`, beside
``Context``: it needs the run state, and nothing in this package imports the run.
Everything re-exported here is a plain function: no process group, no collective, no rank logic. Random
generator states live in `distfn.rng` and module unwrapping in `distfn.modules`; both are re-exported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..modules import unwrap_module
    from ..rng import RNG, combine_rng_states, gather_rng_states, rng_state, rng_state_for_rank, set_rng_state
    from .api import latest, load, read_metadata, save, save_in_background
    from .layout import step_of_path
    from .restore import load_into
    from .sharded import consolidate

#: Each public name and the module it comes from, imported at the name's first use. Why lazily: a job imports
#: `background` (``ctx.saves``) and `objects` (FSDP's state) at its start, and a package that imported its whole
#: self for them cost every process ~30 ms after torch (``python -X importtime``: ~40 attrs classes and the
#: sharded reader and writer), although most jobs save at their end, or never.
_EXPORTS = {
    "unwrap_module": "..modules",
    **dict.fromkeys(("RNG", "combine_rng_states", "gather_rng_states", "rng_state", "rng_state_for_rank",
                     "set_rng_state"), "..rng"),
    **dict.fromkeys(("latest", "load", "read_metadata", "save", "save_in_background"), ".api"),
    "step_of_path": ".layout",
    "load_into": ".restore",
    "consolidate": ".sharded",
}

__all__ = [
    "RNG",
    "combine_rng_states",
    "consolidate",
    "gather_rng_states",
    "latest",
    "load",
    "load_into",
    "read_metadata",
    "rng_state",
    "rng_state_for_rank",
    "save",
    "save_in_background",
    "set_rng_state",
    "step_of_path",
    "unwrap_module",
]


def __getattr__(name: str) -> Any:
    """A public name on first use (see `_EXPORTS`); submodules import as usual (``distfn.checkpoint.format``)."""
    try:
        module_name = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
