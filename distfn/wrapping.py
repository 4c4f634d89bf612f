"""`ctx.wrap`: move a model to the rank's device and wrap it for the mode (DDP, DataParallel, FSDP2, or nothing).

Also the model conversions that go with wrapping (SyncBatchNorm). The FSDP policy itself lives in
`distfn.fsdp` (cheap to import; its first `fully_shard` pulls in `torch._dynamo`, ~1.5 s, in `mode="fsdp"` only).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger
from torch import nn

from .errors import ConfigError
from .ledger import LEDGER
from .options import MULTI_RANK_MODES, Mode, shards_state

if TYPE_CHECKING:
    from .run import Run
    from .tensor_parallel import Parallelize


def wrap(
    model: nn.Module,
    *,
    mode: Mode,
    device: torch.device,
    is_main: bool,
    sync_batchnorm: bool = False,
    init: Callable[[nn.Module], None] | None = None,
    run: Run | None = None,
    parallelize: Parallelize | None = None,
    compile: bool = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """`model` on `device`, wrapped for `mode` (see `Context.wrap` for what each mode gets).

    Args:
        model: the bare module.
        mode: `"ddp"`, `"fsdp"`, `"dp"` or `"single"`.
        device: this rank's device.
        is_main: whether this is rank 0 (the rank that warns).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm first (ddp and fsdp modes).
        init: fsdp mode, a model built on the meta device: initialises the materialised shards (see
            `distfn.fsdp.wrap`).
        run: fsdp mode, the run whose `fsdp={...}` options are the defaults, whose sync point every forward
            notes and which remembers the sharded model (`distfn.run.Run`); `None`: the default options alone.
            Every mode: the run's timings watch the returned model's steps (`distfn.timings`).
        parallelize: fsdp mode with a ``tp`` mesh dimension: the tensor-parallel plan (`distfn.tensor_parallel`).
        compile: ``torch.compile`` the forward in place before wrapping (fsdp: each unit's, before sharding).
        ddp_kwargs: `DistributedDataParallel` options (ddp), or `fsdp={...}` option overrides (fsdp).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"ctx.wrap expects a torch.nn.Module, got {type(model).__name__}")
    if ddp_kwargs and mode not in MULTI_RANK_MODES:
        raise ConfigError(f"DDP options {sorted(ddp_kwargs)} were given but mode={mode!r}")
    _check_new_arguments(mode, parallelize, compile)
    if shards_state(mode):
        if sync_batchnorm:
            model = convert_sync_batchnorm(model, device, warn=is_main)
        return _sharded(model, device, init=init, run=run, parallelize=parallelize, compile=compile, **ddp_kwargs)
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise ConfigError(
            f"ctx.wrap got a model built on the meta device (no values), but mode={mode!r} keeps the whole model "
            "on every rank: materialise it first, e.g. `model.to_empty(device=ctx.device)` and then "
            "`model.reset_parameters()` (or your own init) for every submodule, or build it on the CPU; "
            "mode='fsdp' accepts meta models and materialises only each rank's shards"
        )
    if init is not None:
        raise ConfigError(f"ctx.wrap(model, init=...) is for meta-device models in mode='fsdp', not mode={mode!r}")
    model = model.to(device)
    if compile:
        from . import fsdp  # see `_sharded`

        fsdp.compile_forward(model)
    if mode == "ddp":
        if sync_batchnorm:
            model = convert_sync_batchnorm(model, device, warn=is_main)
        if device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [device.index])
            ddp_kwargs.setdefault("output_device", device.index)
        wrapped = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        wrapped.register_forward_pre_hook(LEDGER.count_ddp_step)  # the hang report's DDP step count
        return _timed(wrapped, run, device)
    if mode == "dp":
        return _timed(DataParallel(model), run, device)
    return _timed(model, run, device)


def _check_new_arguments(mode: Mode, parallelize: Parallelize | None, compile: Any) -> None:
    if not isinstance(compile, bool):
        raise ConfigError(f"ctx.wrap(model, compile=...) takes True or False, got {compile!r}")
    if parallelize is not None and not shards_state(mode):
        raise ConfigError(f"ctx.wrap(model, parallelize=...) is tensor parallelism on a mesh of mode='fsdp', not "
                          f"mode={mode!r}: use @distributed(mode='fsdp', mesh={{'dp_shard': -1, 'tp': 2}})")


def _sharded(model: nn.Module, device: torch.device, *, init: Callable[[nn.Module], None] | None, run: Run | None,
             parallelize: Parallelize | None, compile: bool, **overrides: Any) -> nn.Module:
    """fsdp mode: ``model`` split by ``parallelize`` over the run's ``tp`` dimension, then sharded over its
    data-parallel ones. No ``model.to(device)`` first: fully_shard moves each unit to the device and shards it,
    one unit at a time, so a rank never holds the whole model on its GPU (and cpu_offload keeps the GPU free).
    `distfn.fsdp` is imported here, not with this module: a DDP job never loads it (nor the sharded checkpoint code
    it brings, ~10 ms of CPU per process after torch, on the launch's critical path: issue 46 item 2)."""
    from . import fsdp

    defaults = run.fsdp if run is not None else fsdp.FsdpOptions()
    options = fsdp.parse_options(defaults, **overrides) or defaults
    mesh = run.mesh if run is not None and run.mesh is not None and run.mesh.layout.names != ("dp_shard",) \
        else None  # a 1-D mesh over every rank is fully_shard's own default
    model = fsdp.wrap(model, options, device, init=init, on_forward=run.sync_point if run is not None else None,
                      mesh=mesh, parallelize=parallelize, compile=compile)
    if run is not None:
        run.wrapped.add(model)
    return _timed(model, run, device)


def _timed(model: nn.Module, run: Run | None, device: torch.device) -> nn.Module:
    """``model``, its steps now measured by the run's `distfn.timings.Timings` (data / compute / comm)."""
    if run is not None:
        run.timings.watch(model, device)
    return model


class DataParallel(nn.DataParallel):
    """`nn.DataParallel` whose replicas compute in the caller's autocast dtype (what `mode="dp"` wraps with).

    torch's `parallel_apply` runs each replica in its own thread and re-enters autocast there without a dtype;
    the autocast dtype is per thread, so under `ctx.autocast()` with `precision="bf16"` the replicas would
    compute in float16, CUDA's default (pytorch#125186). Here each replica enters autocast with the dtype that
    was active where `forward` was called.
    """

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        kind = self.src_device_obj.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            replicas = [_UnderAutocast(replica, kind, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class _UnderAutocast:
    """Calls a replica inside `torch.autocast(device_type, dtype)` (in the replica's thread)."""

    def __init__(self, module: Any, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def convert_sync_batchnorm(model: nn.Module, device: torch.device, *, warn: bool = True) -> nn.Module:
    """``model`` with its BatchNorm layers turned into ``SyncBatchNorm`` (statistics over all ranks).

    On CPU the model is returned unchanged with a warning (when ``warn``): torch's SyncBatchNorm raises on CPU
    tensors in training, and a GPU script should still run on CPUs for development, with per-rank statistics.
    """
    if device.type == "cpu":
        if warn and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            logger.warning("sync_batchnorm=True is ignored on CPU (torch's SyncBatchNorm needs a GPU); "
                           "BatchNorm statistics stay per rank")
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)
