"""Rank-aware loguru set-up for workers.

By default INFO and above is shown from rank 0 only and WARNING and above from every rank, each line tagged
with its rank. ``DISTFN_LOG_RANKS=all`` shows every rank at the chosen level, ``DISTFN_LOG_LEVEL`` sets the
level (default INFO). Only loguru's own default handler is replaced; sinks the user added stay.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from loguru import logger

_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> | <level>{level: <7}</level> | "
    "<cyan>rank {extra[rank]}/{extra[world_size]}</cyan> | <level>{message}</level>"
)

# "default": the id of loguru's stock stderr handler (0 at import; a new id once distfn gave it back).
_state: dict[str, Any] = {"handler": None, "default": 0, "removed_default": False}


def _level_no(name: str) -> int:
    try:
        return logger.level(name.upper()).no
    except ValueError:
        logger.warning("DISTFN_LOG_LEVEL={!r} is not a loguru level; using INFO", name)
        return logger.level("INFO").no


def setup(rank: int, world_size: int) -> Any:
    """Install the rank-tagged sink for this process and return ``logger`` bound with the rank."""
    teardown()
    try:
        logger.remove(_state["default"])  # loguru's default stderr handler; would print every rank's INFO untagged
        _state["removed_default"] = True
    except ValueError:
        pass
    min_no = _level_no(os.environ.get("DISTFN_LOG_LEVEL", "INFO"))
    every_rank = os.environ.get("DISTFN_LOG_RANKS", "").strip().lower() == "all"
    warn_no = logger.level("WARNING").no

    def keep(record: Any) -> bool:
        no = record["level"].no
        if no < min_no:
            return False
        return every_rank or rank == 0 or no >= warn_no

    logger.configure(extra={"rank": rank, "world_size": world_size})
    _state["handler"] = logger.add(sys.stderr, level=0, filter=keep, format=_FORMAT)
    return logger.bind(rank=rank, world_size=world_size)


def teardown() -> None:
    """Remove distfn's sink and give loguru its default stderr handler back if distfn took it."""
    handler = _state["handler"]
    if handler is not None:
        try:
            logger.remove(handler)
        except ValueError:
            pass
        _state["handler"] = None
    if _state["removed_default"]:
        _state["default"] = logger.add(sys.stderr)
        _state["removed_default"] = False
