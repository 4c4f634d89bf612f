"""The job key: what makes every attempt of one job log into the same run, and an unrelated job into a new one.

Where the key lives, by path (the rule docs/tracking.md states):

* **restarts** (``max_restarts=``): distfn's launcher exports ``DISTFN_TRACK_KEY`` (`exported`) once per job,
  around all its attempts, so each attempt's rank 0 reads the same key; the variable is removed again when the
  job ends, so a second call of the function is a new job;
* **Slurm requeue**: the key is ``slurm-<job id>``, which a requeued job keeps (whoever launched the ranks);
* **torchrun** ``--max-restarts``: ``torchrun-<rdzv id>`` when the rendezvous id is set (``--standalone`` makes
  a fresh one per torchrun);
* **a re-run that ``ctx.resume``-s**: ``ctx.save`` stores the key in the checkpoint's metadata under
  `RECORD_KEY` (`record`), and ``ctx.resume`` hands it back (`key_in`) before the run opens;
* otherwise a fresh key: ``<date>-<time>-<6 hex digits>``. Setting ``DISTFN_TRACK_KEY`` yourself joins a run
  on purpose (a Kubernetes pod that restarts, say).

Backends turn the key into their run: a tag MLflow searches by, W&B's run id, TensorBoard's and the CSV
logger's directory name.

Imports: `preemption` (the Slurm job id rule), `tracking.base`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Final

from ..preemption import slurm_job_id
from .base import KEY_ENV, KEY_TAG

#: The environment variable holding the job key (set by distfn's launcher for its workers, or by the user).

#: The key of the tracking record in a checkpoint's ``metadata=`` (written by ``ctx.save`` on rank 0).
RECORD_KEY: Final = "distfn.tracking"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

#: The longest key: a directory name (255 bytes on most file systems), a W&B run id (at most 128 characters)
#: and an MLflow tag value all hold it.
MAX_KEY: Final = 128

#: What a key is: one path component of letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit
#: (so never ``.``, ``..`` or a hidden name), at most `MAX_KEY` long. Backends turn it into a directory under
#: their root, a run id, an MLflow filter string: nothing else may reach them.
_KEY = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_KEY - 1}}}")


def is_key(value: object) -> bool:
    """Whether ``value`` is a valid job key (see `_KEY`): the check a key read back from a file must pass."""
    return isinstance(value, str) and _KEY.fullmatch(value) is not None


def _safe(text: str) -> str:
    """``text`` made a valid key (unsafe characters become ``-``, leading dots and dashes go, long text is cut);
    empty when nothing usable is left."""
    return _UNSAFE.sub("-", text).lstrip(".-_")[:MAX_KEY]


def fresh_key() -> str:
    """A new key, readable and unique enough: ``20261202-013005-3fa9c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def job_key(env: Mapping[str, str]) -> str:
    """This job's key: ``DISTFN_TRACK_KEY``, else the Slurm job's, else torchrun's rendezvous id, else fresh
    (a file and run-id safe string in every case)."""
    given = _safe(env.get(KEY_ENV, "").strip())
    if given:
        return given
    slurm = slurm_job_id(env)
    if slurm:
        return _safe(f"slurm-{slurm}")
    rdzv = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if rdzv and rdzv != "none":  # torchrun's default id without --rdzv-id is the literal "none"
        return _safe(f"torchrun-{rdzv}")
    return fresh_key()


@contextlib.contextmanager
def exported(env: MutableMapping[str, str] | None = None) -> Iterator[str]:
    """Set ``DISTFN_TRACK_KEY`` for the workers started inside (every attempt of one job), then put the variable
    back as it was, so that the next job of this process gets a key of its own."""
    env = os.environ if env is None else env
    before = env.get(KEY_ENV)
    key = job_key(env)
    env[KEY_ENV] = key
    try:
        yield key
    finally:
        if before is None:
            env.pop(KEY_ENV, None)
        else:
            env[KEY_ENV] = before


def tags(key: str, env: Mapping[str, str]) -> dict[str, str]:
    """The tags every backend records: the key, and the Slurm job id under Slurm."""
    out = {KEY_TAG: key}
    slurm = slurm_job_id(env)
    if slurm:
        out["slurm_job_id"] = slurm
    return out


def record(key: str, step: int | None, ids: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """The checkpoint's tracking record: the key, the highest step logged so far, and each backend's run ids
    (for people: continuing needs only the key)."""
    return {"key": key, "step": step, "runs": {name: dict(v) for name, v in ids.items()}}


class BadRecord(ValueError):
    """A checkpoint's tracking record that is there but cannot be used (its key is not a valid key)."""


def key_in(metadata: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """``(key, step)`` of the tracking record in a checkpoint's metadata, or ``None`` (no record).

    The metadata was read back from a file, so nothing in it is trusted: the key must be a valid key (`is_key`:
    one path component, never ``..`` or an absolute path, which would make the CSV and TensorBoard backends
    write outside their root), else `BadRecord`; a step that is not a non-negative int (below 2**63) is no step.
    """
    entry = metadata.get(RECORD_KEY) if isinstance(metadata, Mapping) else None
    if entry is None:
        return None
    key = entry.get("key") if isinstance(entry, Mapping) else None
    if not isinstance(key, str) or not is_key(key):
        # only a str is shown (cut): the repr of a value nested 100,000 deep would raise RecursionError
        shown = (repr(key) if len(key) <= 60 else repr(key[:57]) + "...") if isinstance(key, str) else \
            f"a {type(key).__name__}"
        raise BadRecord(f"its run key {shown} is not a valid key (1-{MAX_KEY} letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit)")
    step = entry.get("step")
    ok = type(step) is int and 0 <= step < 2**63
    return key, step if ok else None
