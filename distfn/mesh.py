"""``@distributed(mode="fsdp", mesh={...})``: one named ``DeviceMesh`` for 2-D parallelism (HSDP, FSDP x TP).

The mesh is a mapping from dimension names to sizes. Three names exist, torchtitan's and Accelerate's:

* ``dp_replicate``: data parallel, whole replicas (HSDP's outer dimension; across nodes);
* ``dp_shard``: data parallel, parameters sharded (FSDP's dimension; within a node);
* ``tp``: tensor parallel (one layer's weights split over these ranks; innermost, so consecutive ranks).

Whatever the order of the mapping, the mesh is built outermost first in that order (``dp_replicate``,
``dp_shard``, ``tp``): consecutive ranks then form a tensor-parallel group and then a shard group, which is what
keeps the chatty collectives on a node's fast links. One size may be ``-1``, "the ranks left over". ``"auto"``
is HSDP over the job's nodes: replicate across nodes, shard within one (one node: plain ``dp_shard``).

What lives here: `MeshSpec` (the checked argument, pure: decoration checks it before any process starts),
`Layout` (the spec resolved for one world size: which rank sits where, pure and testable without a process
group) and `build` (the ``DeviceMesh`` itself and the data-parallel group, on every rank at start-up). Importing
it costs nothing beyond attrs: ``torch.distributed.device_mesh`` is imported by `build` only.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from .errors import ConfigError

#: The dimension names a mesh may use, outermost first (the order the mesh is built in).
DIMS: Final = ("dp_replicate", "dp_shard", "tp")
#: The data-parallel dimensions: the batch is split over these, the ranks of one ``tp`` group share theirs.
DP_DIMS: Final = ("dp_replicate", "dp_shard")
#: The value of ``mesh=`` for HSDP over the job's nodes.
AUTO: Final = "auto"

_EXAMPLE: Final = "mesh={'dp_replicate': 2, 'dp_shard': -1} (HSDP) or mesh={'dp_shard': -1, 'tp': 2} (FSDP x TP)"


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ConfigError(f"mesh={{{name!r}: {value!r}}}: a dimension's size is a positive int, or -1 for the ranks "
                          f"left over; e.g. {_EXAMPLE}")
    return value


def _unknown(name: Any) -> ConfigError:
    near = difflib.get_close_matches(str(name).strip().casefold(), DIMS, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"mesh= names the dimension {name!r}, which distfn does not know{hint}; the dimensions are "
                       f"{', '.join(map(repr, DIMS))}, e.g. {_EXAMPLE}")


@attrs.frozen
class MeshSpec:
    """The checked ``mesh=`` argument: sizes by dimension in build order (``-1``: the rest), or ``auto``.

    Attributes:
        sizes: ``((name, size), ...)`` outermost first; empty for ``auto``.
        auto: replicate across nodes, shard within one (resolved by `resolve` from the job's nodes).
    """

    sizes: tuple[tuple[str, int], ...] = ()
    auto: bool = False

    @classmethod
    def parse(cls, value: Any) -> MeshSpec | None:
        """``None``, ``"auto"``, a mapping of `DIMS` to sizes, or a `MeshSpec` (each a `ConfigError` naming the fix
        when it is not valid)."""
        if value is None or isinstance(value, MeshSpec):
            return value
        if isinstance(value, str):
            if value.strip().casefold() == AUTO:
                return cls(auto=True)
            raise ConfigError(f"mesh={value!r} is not a mesh; give 'auto' (HSDP over the job's nodes) or a mapping "
                              f"of dimension sizes, e.g. {_EXAMPLE}")
        if not isinstance(value, Mapping):
            raise ConfigError(f"mesh= takes a mapping of dimension sizes or 'auto', got {type(value).__name__}; "
                              f"e.g. {_EXAMPLE}")
        for name in value:
            if name not in DIMS:
                raise _unknown(name)
        if not value:
            raise ConfigError(f"mesh={{}} names no dimension; omit mesh= for plain FSDP, or e.g. {_EXAMPLE}")
        sizes = tuple((name, _size(name, value[name])) for name in DIMS if name in value)
        if sum(size == -1 for _, size in sizes) > 1:
            raise ConfigError(f"mesh={dict(value)!r}: at most one dimension may be -1 (the ranks left over)")
        return cls(sizes=sizes)

    def describe(self) -> str:
        """``"dp_replicate=2 x dp_shard=-1"`` or ``"auto"``: for logs and ``distfn env``."""
        return AUTO if self.auto else " x ".join(f"{name}={size}" for name, size in self.sizes)

    def resolve(self, world_size: int, *, num_nodes: int = 1, local_world_size: int | None = None) -> Layout:
        """The `Layout` of this spec on ``world_size`` ranks (``auto`` needs the nodes), or a `ConfigError` when
        the sizes cannot fill exactly that many ranks. Pure, and the same answer on every rank."""
        if self.auto:
            local = world_size if local_world_size is None else local_world_size
            if num_nodes <= 1:
                return Layout(("dp_shard",), (world_size,))
            if local * num_nodes != world_size:
                raise ConfigError(f"mesh='auto' replicates across nodes and shards within one, but the job's "
                                  f"{world_size} ranks are not {num_nodes} nodes of {local}: give the sizes, e.g. "
                                  f"mesh={{'dp_replicate': {num_nodes}, 'dp_shard': -1}}")
            return Layout(DP_DIMS, (num_nodes, local))
        fixed = math.prod(size for _, size in self.sizes if size != -1)
        rest = [name for name, size in self.sizes if size == -1]
        if world_size % fixed or (not rest and fixed != world_size):
            fix = (f"make the sizes multiply to {world_size}, or set one of them to -1" if world_size % fixed == 0
                   else f"use sizes whose product divides {world_size}, or run on a number of ranks that "
                        f"{fixed} divides")
            raise ConfigError(f"mesh {self.describe()} does not fit the job's {world_size} ranks (its sizes multiply "
                              f"to {fixed}): {fix}")
        sizes = tuple(world_size // fixed if size == -1 else size for _, size in self.sizes)
        return Layout(tuple(name for name, _ in self.sizes), sizes)


def parse_text(text: str) -> Any:
    """``DISTFN_MESH``'s text as an argument: ``auto``, ``dp_replicate=2,dp_shard=-1`` or the same as JSON."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not JSON: {exc}") from None
    if text.casefold() == AUTO:
        return AUTO
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (p.strip() for p in part.partition("="))
        if not sep:
            raise ValueError(f"{part.strip()!r} is not name=size; write e.g. dp_replicate=2,dp_shard=-1")
        try:
            out[name] = int(size)
        except ValueError:
            raise ValueError(f"{part.strip()!r}: the size {size!r} is not an integer") from None
    return out


@attrs.frozen
class Layout:
    """A mesh resolved on one world size: its dimension names (outermost first) and sizes. Pure: every question
    about which rank sits where is answered here, from the rank alone, as ``DeviceMesh`` lays ranks out
    (row-major: the last dimension varies fastest)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        """The size of dimension ``name`` (1 when the mesh does not have it)."""
        return self.shape[self.names.index(name)] if name in self.names else 1

    @property
    def dp_names(self) -> tuple[str, ...]:
        """The data-parallel dimensions present, outermost first."""
        return tuple(n for n in self.names if n in DP_DIMS)

    @property
    def dp_size(self) -> int:
        """How many different batches one step sees: the product of the data-parallel dimensions."""
        return math.prod(self.size(n) for n in DP_DIMS)

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    def coords(self, rank: int) -> dict[str, int]:
        """``{dimension: index}`` of ``rank`` on the mesh."""
        out: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.shape), strict=True):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in self.names}

    def dp_rank(self, rank: int) -> int:
        """``rank``'s index among the data-parallel ranks (the ranks of one tp group share it)."""
        where = self.coords(rank)
        index = 0
        for name in DP_DIMS:
            index = index * self.size(name) + where.get(name, 0)
        return index

    def groups(self, over: Sequence[str]) -> list[list[int]]:
        """The ranks grouped by their coordinates outside ``over``: each list is one group spanning the
        dimensions ``over`` (``groups(DP_DIMS)``: the data-parallel groups, one per tp index)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            where = self.coords(rank)
            out.setdefault(tuple(v for n, v in where.items() if n not in over), []).append(rank)
        return list(out.values())

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape, strict=True))


@attrs.frozen
class Mesh:
    """One rank's view of the run's mesh (``ctx.run.mesh``).

    Attributes:
        layout: the resolved sizes (pure facts, see `Layout`).
        device_mesh: the ``DeviceMesh`` with the named dimensions (``ctx.mesh``).
        dp_group: the process group of this rank's data-parallel ranks when a ``tp`` dimension splits the world
            (what ``gather_for_metrics`` gathers over), else ``None``: the whole world.
    """

    layout: Layout
    device_mesh: Any
    dp_group: Any = None

    def dp_mesh(self) -> Any:
        """The sub-mesh FSDP shards over: ``(dp_replicate, dp_shard)`` for HSDP, the one data-parallel dimension
        the mesh has, or ``None`` when it has none (``mesh={"tp": 4}``: tensor parallel alone, no FSDP)."""
        names = self.layout.dp_names
        if not names:
            return None
        return self.device_mesh[names if len(names) > 1 else names[0]]

    def tp_mesh(self) -> Any:
        """The ``tp`` sub-mesh, or ``None``."""
        return self.device_mesh["tp"] if "tp" in self.layout.names else None


def build(layout: Layout, device_type: str) -> Mesh:
    """The ``DeviceMesh`` of ``layout`` (every rank calls this at the same point: it makes process groups), and
    the data-parallel group when a ``tp`` dimension splits the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh  # loaded with torch.distributed already (0 ms)

    device_mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names)
    dp_group = None
    if layout.tp_size > 1 and layout.dp_size > 1:
        groups = layout.groups(DP_DIMS)
        dp_group, _ = dist.new_subgroups_by_enumeration(groups)
    return Mesh(layout=layout, device_mesh=device_mesh, dp_group=dp_group)
