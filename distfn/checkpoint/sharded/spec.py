"""The names inside a sharded checkpoint directory, shared by its writer and its reader.

Specified in docs/checkpoints.md ("Sharded checkpoints"): one ``shard-0000R-model-00001-of-00001.safetensors`` per
writing rank (the names torch's ``HuggingFaceStorageWriter`` gives a distributed save's shards, so its
``HuggingFaceStorageReader`` reads these directories), whose ``__metadata__[DCP_SHARDING_INFO]`` gives the offsets of
every slice in its full tensor, and `distfn.checkpoint.layout.INDEX`, written last.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DCP_VERSION", "KEY_LAYOUT", "KEY_TENSORS", "KEY_WORLD", "PARTIAL", "SAVED_OFFSETS", "SHARDING_INFO",
           "shard_file"]

#: The mark of a sharded save's hidden temporary directory (`distfn.checkpoint.storage.tmp_name`).
PARTIAL: Final = ".distfn-partial"
#: Index metadata: every stored tensor's full dtype and shape (JSON).
KEY_TENSORS: Final = "distfn.tensors"
KEY_LAYOUT: Final = "distfn.layout"
KEY_WORLD: Final = "distfn.world_size"
#: Shard metadata, the keys torch's HuggingFaceStorageReader reads the slices' offsets from.
SHARDING_INFO: Final = "DCP_SHARDING_INFO"
SAVED_OFFSETS: Final = "saved_offsets"
DCP_VERSION: Final = "DCP_VERSION"


def shard_file(rank: int) -> str:
    """The file rank ``rank`` writes (shard numbers from 1, as torch's writer numbers them)."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
