"""FSDP2's own end-of-backward callback, bracketed for the run's timings (`distfn.timings`; re-exported by
`distfn.fsdp`). A module of its own, importing nothing of distfn's: `distfn.timings` calls it, and `distfn.fsdp`
reaches `distfn.timings` through `distfn.fsdp_state` and `distfn.run`, so it cannot live there without an import
cycle. Importing it is free (it loads neither ``torch.distributed.fsdp`` nor anything else)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

__all__ = ["bracket_final_callback"]


def bracket_final_callback(model: nn.Module, begin: Callable[[], None], end: Callable[[], None]) -> bool:
    """Run ``begin()`` / ``end()`` around FSDP2's own end-of-backward callback of ``model`` (the run's timings: the
    wait for the last reduce-scatter is communication). Returns False, doing nothing, when ``model`` is no
    ``FSDPModule``.

    Why not an autograd callback of our own, as for DDP: FSDP2 queues ``_root_post_backward_final_callback`` from a
    *tensor* hook on the forward's output (torch/distributed/fsdp/_fully_shard/_fsdp_state.py:452 and 466-472), and
    the engine runs tensor pre-hooks before a node's pre-hooks, so FSDP's callback is queued, and runs, before any
    callback a node pre-hook queues: its wait (``current_stream().wait_event`` on the reduce-scatter's event on GPUs,
    the root group's reduce-scatter itself on gloo) would land in compute. ``queue_callback`` takes the bound method
    looked up at queue time, so an instance attribute on each unit's ``FSDPState`` (whichever unit's pre-backward runs
    first queues it) replaces it for this model only. Bracketing twice is a no-op.
    """
    fsdp_api = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be an FSDPModule yet
    if fsdp_api is None or not isinstance(model, fsdp_api.FSDPModule):
        return False
    for module in model.modules():
        if not isinstance(module, fsdp_api.FSDPModule):
            continue
        state = module._get_fsdp_state()
        original = state._root_post_backward_final_callback
        if getattr(original, "__distfn_bracketed__", False):
            continue

        def bracketed(original: Callable[[], None] = original) -> None:
            begin()
            try:
                original()
            finally:
                end()

        bracketed.__distfn_bracketed__ = True  # type: ignore[attr-defined]
        state._root_post_backward_final_callback = bracketed
    return True
