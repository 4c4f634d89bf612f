"""torch DCP's view of a checked sharded checkpoint: a ``StorageReader`` that reads through distfn's own storage
readers, on any `distfn.checkpoint.fs` backend (a local disk, by memory map; an object store, by ranged reads).

`distfn.checkpoint.sharded.restore` hands it to ``torch.distributed.checkpoint.load``, whose planner works out
which slice of which saved piece each live tensor (an FSDP2 ``DTensor``'s local shard, or a whole plain tensor)
needs; `ShardReader.read_data` then reads only that: for the row slices of ``Shard(0)`` layouts, only those rows'
bytes (`distfn.checkpoint.storage.Reader.rows`). The metadata comes from `distfn.checkpoint.sharded.read.Checkpoint`,
already checked whole, so nothing is read twice and no file is trusted on its own word.

torch's checkpoint modules cost ~0.3 s to import; this module is imported by the restore only when it runs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import (
    ChunkStorageMetadata,
    LoadPlan,
    LoadPlanner,
    Metadata,
    StorageReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.futures import Future

from .. import format as fmt
from .. import storage
from .read import Checkpoint

__all__ = ["ShardReader"]


class ShardReader(StorageReader):
    """Serves DCP's read requests from the shards of ``checkpoint`` (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self._where: dict[MetadataIndex, str] = {}  # (stored name, piece offsets) -> its file

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: one reader serves one load."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any id: the checkpoint is given to the constructor, already checked."""
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every stored tensor with its full shape and its pieces, from the checked checkpoint."""
        tensors: dict[str, Any] = {}
        for name, (code, full) in self.checkpoint.shapes.items():
            chunks = []
            for file, offsets, shape in self.checkpoint.pieces[name]:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
                self._where[MetadataIndex(name, torch.Size(offsets))] = file
            tensors[name] = TensorStorageMetadata(properties=TensorProperties(dtype=fmt.FROM_CODE[code]),
                                                  size=torch.Size(full), chunks=chunks)
        return Metadata(state_dict_metadata=tensors)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up (the metadata came from `read_metadata`)."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The planner's plan, as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The planners' plans, as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every requested slice, one shard file open at a time, and hand it to the planner."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            index = MetadataIndex(item.storage_index.fqn, torch.Size(item.storage_index.offset or ()))
            per_file.setdefault(self._where[index], []).append(item)
        for file, items in per_file.items():
            with storage.open_reader(self.checkpoint.location.child(file), "cpu") as reader:
                for item in items:
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(_slice(reader, item))
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _slice(reader: storage.Reader, item: Any) -> torch.Tensor:
    """The part of a stored piece that ``item`` asks for: its rows alone when it spans whole rows."""
    name = item.storage_index.fqn
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    shape = [int(s) for s in reader.header.tensors[name]["shape"]]
    if not shape:
        return reader.rows(name, 0, 0)
    rows = reader.rows(name, offsets[0], offsets[0] + lengths[0])
    if offsets[1:] == [0] * (len(shape) - 1) and lengths[1:] == shape[1:]:
        return rows
    index = [slice(None)] + [slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)]
    return rows[tuple(index)]
