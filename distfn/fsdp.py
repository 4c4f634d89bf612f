"""``mode="fsdp"``: fully sharded data parallel with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

What lives here, and who calls it:

* `FsdpOptions` / `parse_options`: the ``fsdp={...}`` mapping of ``@distributed``, validated at
  decoration time (``options.Options``); defined in `distfn.fsdp_options`, re-exported here.
* `plan_units` / `wrap`: the wrap policy (``Context.wrap``). Sub-modules become their own FSDP unit
  bottom-up, either by size (``min_params``) or by class (``module_classes``); the root is always sharded last.
* `save` / `load`: full-state-dict checkpoints (``Context.save`` / ``Context.load``), re-exported from
  `distfn.fsdp_state`, which gathers and scatters the full state dicts.
* `is_meta` / `materialize`: models built on the meta device, materialised shard by shard after sharding.
* `required_backend`: the process-group backend a run needs (``worker.run``).

Nothing here is per-run state: the run's options, its save check-in (`distfn.checkin`, which turns a
rank-0-only `ctx.save` into an error instead of a hang) and its wrapped models are on `distfn.run.Run`, handed
in by ``ctx.wrap`` / ``ctx.save`` / ``ctx.load``. Importing this module is cheap (about 5 ms: it loads neither
``torch.distributed.fsdp`` nor ``torch._dynamo``); the first `wrap` imports `torch.distributed.fsdp`, which pulls
in `torch._dynamo` (~1.5 s).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from . import tensor_parallel
from .devices import collective_device
from .errors import ConfigError
from .fsdp_hooks import bracket_final_callback
from .fsdp_options import FsdpOptions, MixedPrecision, parse_options
from .fsdp_state import is_sharded, load, save
from .mesh import Mesh

__all__ = ["FsdpOptions", "MixedPrecision", "bracket_final_callback", "is_meta", "is_sharded", "load", "materialize",
           "parse_options", "plan_units", "required_backend", "save", "wrap"]

# --------------------------------------------------------------------------------------------------
# Wrap policy


def _numel(params: Mapping[int, nn.Parameter]) -> int:
    return sum(p.numel() for p in params.values())


def plan_units(model: nn.Module, options: FsdpOptions) -> list[nn.Module]:
    """The sub-modules of ``model`` to shard as their own FSDP units, children before parents (root excluded).

    Pure: inspects the module tree only, so it is testable without a process group.

    * With ``options.module_classes``: every sub-module that is an instance of one of them (a name matches the
      class's ``__name__`` or ``__qualname__``).
    * Otherwise, bottom-up by size: a sub-module becomes a unit when the parameters it holds that are not already
      in a unit below it number at least ``options.min_params``; what is left goes to the root's unit.

    Never chosen: modules that appear twice in the tree, and modules holding a parameter that is also registered
    outside them (tied weights such as a shared embedding / output matrix): a tied parameter must live in the
    unit that encloses all its users, so it stays with an ancestor (at worst the root).
    """
    # param id -> registrations in the whole tree, counting a module that appears twice twice: a unit must hold
    # every registration of each of its parameters, or a forward outside it would use a sharded parameter.
    owners: dict[int, int] = {}
    seen_modules: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        seen_modules[id(module)] = seen_modules.get(id(module), 0) + 1
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1

    classes = tuple(c for c in options.module_classes if isinstance(c, type))
    names = {c for c in options.module_classes if isinstance(c, str)}
    units: list[nn.Module] = []
    visited: dict[int, dict[int, int]] = {}  # module id -> registrations in its subtree

    def eligible(module: nn.Module, uncovered: Mapping[int, nn.Parameter], inside: Mapping[int, int]) -> bool:
        if seen_modules[id(module)] > 1 or any(inside[i] < owners[i] for i in inside):
            return False
        if options.module_classes:
            kind = type(module)
            return isinstance(module, classes) or kind.__name__ in names or kind.__qualname__ in names
        return _numel(uncovered) >= options.min_params

    def visit(module: nn.Module, is_root: bool) -> tuple[dict[int, nn.Parameter], dict[int, int]]:
        """-> (parameters of this subtree not yet in a unit, registrations of each parameter in the subtree)."""
        uncovered = {id(p): p for p in module._parameters.values() if p is not None}
        inside = dict.fromkeys(uncovered, 1)
        for child in module.children():
            if id(child) in visited:  # a shared sub-module: its parameters were collected under its first parent
                sub_uncovered: dict[int, nn.Parameter] = {}
                sub_inside = visited[id(child)]
            else:
                sub_uncovered, sub_inside = visit(child, False)
            uncovered.update(sub_uncovered)
            for i, n in sub_inside.items():
                inside[i] = inside.get(i, 0) + n
        visited[id(module)] = inside
        if not is_root and uncovered and eligible(module, uncovered, inside):
            units.append(module)
            return {}, inside
        return uncovered, inside

    visit(model, True)
    return units


def wrap(
    model: nn.Module,
    options: FsdpOptions,
    device: torch.device,
    *,
    init: Callable[[nn.Module], None] | None = None,
    on_forward: Callable[[], None] | None = None,
    mesh: Mesh | None = None,
    parallelize: tensor_parallel.Parallelize | None = None,
    compile: bool = False,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: the planned units, then the root.

    ``model`` may still be on the CPU: ``fully_shard`` moves each unit's parameters and buffers to ``device``
    just before sharding them, so the full model never sits on the device at once. A model built under
    ``torch.device("meta")`` is sharded first and then materialised (see `materialize`), so no rank ever holds
    more than its shards.

    Args:
        model: the bare module, on the CPU, on ``device`` or on the meta device.
        options: the run's options with ``ctx.wrap``'s overrides.
        device: this rank's device.
        init: for a meta model, initialises the materialised shards in place (called as ``init(model)`` under
            ``torch.no_grad()``); by default every submodule's ``reset_parameters()``. An error otherwise.
        on_forward: called before every forward of the model (the run's sync point, `distfn.run.Run.sync_point`).
        mesh: the run's named mesh (`distfn.mesh.Mesh`): FSDP shards over its data-parallel dimensions (both:
            HSDP, replicated over ``dp_replicate``, sharded over ``dp_shard``); ``None``: every rank, 1-D.
        parallelize: tensor parallelism applied first on the mesh's ``tp`` dimension (`distfn.tensor_parallel`).
        compile: ``torch.compile`` each unit's ``forward`` (the root's too) before sharding, in place: FSDP's
            hooks stay outside the compiled code and the state dict's keys stay those of the bare module.

    Returns:
        The same module object, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    """
    from torch.distributed.fsdp import fully_shard  # deferred: it loads torch._dynamo (~1.7 s), fsdp runs only

    meta = is_meta(model)
    if init is not None and not meta:
        raise ConfigError("ctx.wrap(model, init=...) initialises a model built on the meta device "
                          "(under `with torch.device('meta'):`); this model already holds its values: drop init=")
    if meta and init is None:
        _check_resettable(model)
    model = _tensor_parallel(model, mesh, parallelize, meta)
    kwargs = options.fully_shard_kwargs(device)
    dp_mesh = mesh.dp_mesh() if mesh is not None else None
    if dp_mesh is not None:
        kwargs["mesh"] = dp_mesh
    units = plan_units(model, options)
    if compile:
        for module in (*units, model):
            compile_forward(module)
    if dp_mesh is not None or mesh is None:
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
    if meta:
        materialize(model, device, init=init, offload=options.cpu_offload)
    if on_forward is not None:
        # Runs before FSDP's own pre-forward all-gather (prepend), so a rank that skipped a save is caught before
        # it blocks in a collective the others will never join.
        model.register_forward_pre_hook(_forward_hook(on_forward), prepend=True)
    total = sum(p.numel() for p in model.parameters())
    local = sum(_local(p).numel() for p in model.parameters())
    logger.debug("fsdp: {} unit(s) + root; {} of {} parameters held on this rank", len(units), local, total)
    return model


def _tensor_parallel(model: nn.Module, mesh: Mesh | None, parallelize: tensor_parallel.Parallelize | None,
                     meta: bool) -> nn.Module:
    """``model`` split over the mesh's ``tp`` dimension by ``parallelize`` (unchanged without one); a ``tp``
    dimension without a plan, or a plan without one, is a `ConfigError` before any collective."""
    tp_mesh = mesh.tp_mesh() if mesh is not None else None
    if parallelize is None:
        if tp_mesh is not None and tp_mesh.size() > 1:
            raise ConfigError(f"mesh has a 'tp' dimension of {tp_mesh.size()} ranks, but ctx.wrap got no plan for it: "
                              "pass ctx.wrap(model, parallelize={'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()}) "
                              "or a function fn(model, mesh) -> model, or drop 'tp' from mesh=")
        return model
    if tp_mesh is None or mesh is None:
        raise ConfigError("ctx.wrap(model, parallelize=...) splits layers over the mesh's 'tp' dimension, but the run "
                          "has none: add it, e.g. @distributed(mode='fsdp', mesh={'dp_shard': -1, 'tp': 2})")
    if meta:
        raise ConfigError("ctx.wrap(model, parallelize=...) needs a model with its values (torch's parallelize_module "
                          "scatters them from the tp group's first rank); build it on the CPU, or materialise it first")
    return tensor_parallel.apply(model, parallelize, mesh.device_mesh, tp_mesh)


def compile_forward(module: nn.Module) -> None:
    """``torch.compile`` ``module.forward`` in place (an attribute of the instance): the module's hooks, FSDP's
    all-gathers among them, run eagerly around the compiled code, and no ``_orig_mod.`` wrapper enters the module
    tree, so checkpoint keys stay the bare module's."""
    module.forward = torch.compile(module.forward)


def _forward_hook(note: Callable[[], None]) -> Callable[[nn.Module, Any], None]:
    """``note`` as a forward pre-hook. It does store I/O: under torch.compile it runs eagerly instead of being
    traced into (``torch.compiler.disable``; torch._dynamo is loaded by then, `wrap` imported fully_shard)."""

    def hook(module: nn.Module, args: Any) -> None:
        note()

    return torch.compiler.disable(hook)


# --------------------------------------------------------------------------------------------------
# Models built on the meta device


def is_meta(model: nn.Module) -> bool:
    """True when some parameter or buffer of ``model`` is on the meta device (shapes only, no values)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _has_real(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule holds a parameter or buffer that is not on the meta device."""
    return any(not t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _own_meta(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters or buffers (children not counted) include one on the meta device."""
    return any(t is not None and t.is_meta for t in itertools.chain(module._parameters.values(),
                                                                     module._buffers.values()))


def _resettable(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``reset_parameters()`` initialises a materialised model: those holding nothing real.

    For a model wholly on the meta device that is every module with the method; in a partly meta one (a real
    backbone next to a meta-built head) the modules holding real values are left alone, so the values stay. A
    module with its own tensors on meta and something real inside it is refused: initialising it would overwrite
    the real values, and skipping it would leave uninitialised memory.
    """
    for name, module in model.named_modules():
        if _own_meta(module) and _has_real(module):
            raise ConfigError(
                f"ctx.wrap got module {name or type(model).__name__!r}, whose own parameters or buffers are on the "
                "meta device while it also holds real values: its reset_parameters() would overwrite those. Build each "
                "module either wholly under `with torch.device('meta'):` or wholly with its values (a real backbone "
                "next to a meta-built head is fine), or pass ctx.wrap(model, init=fn) to initialise it yourself."
            )
    return [m for m in model.modules() if callable(getattr(m, "reset_parameters", None)) and not _has_real(m)]


def _check_resettable(model: nn.Module) -> None:
    """Refuse, before any work, a meta model that ``reset_parameters()`` cannot fully initialise (only the modules
    on the meta device count: the others keep their values)."""
    _resettable(model)  # refuses a module mixing meta and real tensors
    missing = [name or type(model).__name__ for name, module in model.named_modules()
               if _own_meta(module) and not callable(getattr(module, "reset_parameters", None))]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(
            f"ctx.wrap got a model built on the meta device, but {shown} hold(s) parameters or buffers and ha(s/ve) "
            "no reset_parameters() to initialise them after materialisation (their values would be uninitialised "
            "memory). Pass ctx.wrap(model, init=fn), where fn(model) initialises every parameter and buffer in "
            "place, or give those modules a reset_parameters() method."
        )


# The in-place random ops an initialiser uses (nn.init's uniform_/normal_/trunc_normal_, bernoulli_, ...): each
# only reads its target's shape, so drawing a whole tensor and keeping this rank's slice is exact.
_INPLACE_RANDOM: Final = frozenset({"uniform_", "normal_", "bernoulli_", "exponential_", "cauchy_", "log_normal_",
                                    "geometric_", "random_"})


def _slice_of(target: Any) -> tuple[slice, ...] | None:
    """The global index of ``target``'s local tensor (a DTensor sharded by ``Shard``/``Replicate`` only), or None
    when its layout is not a box of the global tensor (a strided shard under FSDP + TP, a partial)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if tuple(shape) != tuple(target._local_tensor.shape):
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _global_draw_mode() -> Any:
    """A dispatch mode that runs an in-place random op on a DTensor whose shard is a CPU tensor as one draw of the
    whole tensor from the CPU generator, of which this rank keeps its slice: the values a single process gives.

    Why it is needed: DTensor's own RNG handling (``OffsetBasedRNGTracker``) exists for CUDA local tensors only; a
    CPU local tensor, on a CPU mesh or offloaded on a CUDA mesh (``cpu_offload``), draws straight from the rank's
    CPU generator (torch/distributed/tensor/_dispatch.py:373-394: the tracker's ``_distribute_region`` moves the
    *CUDA* philox offset, the op itself reads the CPU generator), and every rank's starts the same (distfn's
    ``seed=``, or torch's fixed default), so every shard would get the same values. The cost is one parameter's full
    size of CPU memory, transiently; a layout that is not a box of the global tensor falls back to a per-rank
    stream (distinct shards, not a single process's values)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class GlobalDraw(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            target = args[0] if args else None
            if (func.overloadpacket.__name__ not in _INPLACE_RANDOM or not isinstance(target, DTensor)
                    or target._local_tensor.device.type != "cpu" or kwargs.get("generator") is not None):
                return func(*args, **kwargs)
            where = _slice_of(target)
            local = target._local_tensor
            if where is None:
                rank = dist.get_rank() if dist.is_initialized() else 0
                gen = torch.Generator().manual_seed((torch.initial_seed() * 1_000_003 + rank + 1) % (2**63))
                func(local, *args[1:], **{**kwargs, "generator": gen})
                return target
            whole = torch.empty(target.shape, dtype=target.dtype)
            func(whole, *args[1:], **kwargs)  # the mode is off inside its own __torch_dispatch__
            local.copy_(whole[where])
            return target

    return GlobalDraw()


@contextlib.contextmanager
def _shard_rng(shards: torch.device) -> Iterator[None]:
    """Random initialisation of shards held on ``shards``: on the CPU (a CPU mesh, or a CUDA mesh offloading to the
    CPU) each in-place random op on a DTensor is one global draw sliced per rank (`_global_draw_mode`); shards on a
    GPU have DTensor's own offset-based tracker, which gives each shard its slice of one global draw too.

    The decision is keyed on where the shards live, not on the rank's device: with ``cpu_offload`` on GPUs the rank's
    device is CUDA but the shards are CPU tensors (issue 42, finding 1)."""
    if shards.type != "cpu":
        yield
        return
    with _global_draw_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        yield


def materialize(model: nn.Module, device: torch.device, *, init: Callable[[nn.Module], None] | None = None,
                offload: bool = False) -> None:
    """Give the (sharded) meta tensors of ``model`` real memory and initialise them, in place.

    Only what is on the meta device is touched: a model that is partly real (a loaded backbone next to a head built
    under ``torch.device("meta")``) keeps the real values. Each meta tensor gets empty memory for this rank's shard
    (on the CPU when offloading, where FSDP keeps them; buffers go to ``device``), then ``init(model)``, or the
    ``reset_parameters()`` of each module holding nothing real (see `_resettable`), fills them.
    """
    to_reset = _resettable(model) if init is None else []
    target = torch.device("cpu") if offload else device

    def allocate(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device=target) if t.is_meta else t

    # What Module.to_empty does, but for the meta tensors only (to_empty would replace the real ones with empty
    # memory too). _apply on the root: FSDP2's FSDPModule._apply then re-registers its sharded parameters, as it
    # does after to_empty.
    model._apply(allocate)
    with torch.no_grad(), _shard_rng(target):
        if init is not None:
            init(model)
        else:
            for module in to_reset:
                module.reset_parameters()  # type: ignore[operator]  # callable: _resettable checked
    if offload and device.type != "cpu":
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# The backend of a CPU-offloading run on GPUs: NCCL for the GPU collectives, gloo for those on CPU tensors.
OFFLOAD_BACKEND: Final = "cuda:nccl,cpu:gloo"


def required_backend(opts: FsdpOptions | None, backend: str) -> str:
    """The process-group backend an fsdp run needs, given the one it would otherwise use.

    With `cpu_offload` the sharded gradients and optimizer state live on the CPU, so gradient clipping
    (`ctx.step(opt, max_grad_norm=...)`, whose norm is all-reduced) and the fp16 GradScaler's overflow check
    all-reduce CPU tensors, which NCCL cannot take ("No backend type associated with device type cpu",
    pytorch#148532). A group that is NCCL alone then becomes the per-device `"cuda:nccl,cpu:gloo"`, as Accelerate
    and torchtune do. Any other backend (gloo, or a per-device form that already covers the CPU) is kept.

    Args:
        opts: the run's `fsdp={...}` options (`None`: the defaults, no offloading).
        backend: the backend chosen from `backend=` or the device (`"nccl"` on GPUs).
    """
    if opts is None or not opts.cpu_offload:
        return backend
    if collective_device(backend, torch.device("cuda")) is None:  # the group already takes CPU tensors
        return backend
    return OFFLOAD_BACKEND
