"""Sharded checkpoints: a directory of standard ``.safetensors`` shards that every rank writes in parallel.

`write` (the collective writer), `read` (the checked reader, `load` and `consolidate`) and `restore` (in place,
resharding onto any world size and mode) share only the names in `spec`. The layout is specified in
docs/checkpoints.md ("Sharded checkpoints"). No pickle is written or read.
"""

from __future__ import annotations

from ..layout import INDEX
from .read import consolidate, load, open_checkpoint
from .restore import load_into
from .write import save

__all__ = ["INDEX", "consolidate", "load", "load_into", "open_checkpoint", "save"]
