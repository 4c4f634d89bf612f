"""What a tracking backend is: its settings (`Backend`, checked at decoration) and its open run (`Handle`).

A backend is two objects so that the part that travels is small and safe to pickle: the settings (`Backend`,
an attrs class the launcher ships to every worker and that never imports the tracking package), and the open
run (`Handle`), made by ``Backend.open`` on rank 0 only, in the tracking thread (`distfn.tracking.session`),
which is where the backend's package is imported for the first time.

`RunInfo` is what every backend needs to find or create "the run of this job": the job key that survives
restarts and requeues (`distfn.tracking.key`), the run's display name and the tags to set (the Slurm job id).

Imports: `errors` only, so that `distfn.options` can validate ``track=`` without pulling anything in.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, Protocol, runtime_checkable

import attrs

from ..errors import ConfigError

#: How a run ends: its function returned (FINISHED), raised (FAILED) or was stopped from outside or by a stop
#: signal (KILLED). The names are MLflow's; the other backends map them to their own.
Status = Literal["FINISHED", "FAILED", "KILLED"]

#: What a backend does with what it could not deliver (a server that cannot be reached): keep it, bounded, and
#: send it once the server answers again ("buffer"), or throw it away ("drop"). Either way training goes on.
OnError = Literal["buffer", "drop"]
ON_ERROR: Final[tuple[OnError, ...]] = ("buffer", "drop")

#: The tag (MLflow) / config entry holding the job key, by which a continued run is found.
#: The job key every attempt of one job shares (set by the launcher around its attempts, `tracking.key`).
KEY_ENV: Final = "DISTFN_TRACK_KEY"
KEY_TAG: Final = "distfn.key"

#: One logged row: ``(step, {name: value})``.
Row = tuple[int, dict[str, float]]


@attrs.frozen
class RunInfo:
    """What identifies the run a backend opens (made on rank 0 by the session at the first log call).

    Attributes:
        key: the job key: the same for every attempt of one job (restarts, Slurm requeues, a re-run that
            ``ctx.resume``-s its checkpoint), different for an unrelated job. Backends derive their run id or
            directory from it, or find their run by it.
        name: the run's display name.
        tags: tags to record on the run (``slurm_job_id`` under Slurm, ``distfn.key``).
    """

    key: str
    name: str
    tags: Mapping[str, str] = attrs.field(factory=dict)


@runtime_checkable
class Handle(Protocol):
    """An open run of one backend (rank 0, the tracking thread only).

    ``floor`` is the highest step the run already holds from an earlier attempt of the job (``None``: a new run,
    or one that cannot tell): rows at or below it are replays of steps logged before a restart and are not sent
    again, so the run's steps never go back. ``ids`` names the run for people (stored in checkpoints).
    Every method may raise: the session catches, warns once and buffers or drops.
    """

    @property
    def floor(self) -> int | None: ...
    @property
    def ids(self) -> Mapping[str, str]: ...

    def log_metrics(self, rows: Sequence[Row]) -> None:
        """Send ``rows`` (ascending steps) to the run."""

    def log_params(self, params: Mapping[str, str]) -> None:
        """Record ``params`` (flat, string values) on the run."""

    def close(self, status: Status) -> None:
        """Flush and end the run with ``status``."""


@runtime_checkable
class Backend(Protocol):
    """The settings of one tracking backend, as ``@distributed(track=...)`` takes them (a name is the default
    settings of the built-in backend of that name). A user-made backend implements these members.

    Attributes:
        name: the backend's name in logs and in checkpoint records (``"mlflow"``, ...).
        on_error: what to do with what cannot be delivered (see `OnError`).
        log_cfg: log the job's cfg as the run's parameters when the run opens.
    """

    @property
    def name(self) -> str: ...
    @property
    def on_error(self) -> OnError: ...
    @property
    def log_cfg(self) -> bool: ...

    def check(self) -> None:
        """Raise `ConfigError` at decoration when the backend cannot work here (its extra is missing), without
        importing its package."""

    def open(self, run: RunInfo) -> Handle:
        """Create the job's run, or continue it when it exists (rank 0, the tracking thread)."""


def require(module: str, extra: str, backend: str) -> None:
    """`ConfigError` naming ``distfn[extra]`` when ``module`` cannot be imported; never imports it (an import of
    mlflow or wandb costs seconds and must not happen at decoration, nor on ranks that do not log)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module blocked with sys.modules[name] = None
        found = False
    if not found:
        raise ConfigError(f"track={backend!r} needs the {module!r} package, which is not installed: "
                          f"pip install 'distfn[{extra}]'")


def check_on_error(value: Any) -> OnError:
    """``on_error`` unchanged when it is one of `ON_ERROR`."""
    for known in ON_ERROR:
        if value == known:
            return known
    raise ConfigError(f"on_error={value!r} is not valid; use 'buffer' (keep what could not be sent and retry) or "
                      "'drop' (throw it away)")


def run_directory(root: str, key: str) -> Path:
    """``<root>/<key>``, the folder of a run: ``key`` must be one plain path component (the session only hands
    over valid keys, `distfn.tracking.key.is_key`; this is the last check before a directory is made)."""
    if not key or key in (".", "..") or "/" in key or "\\" in key or "\0" in key or key != key.strip():
        raise ValueError(f"the run key {key!r} is not one plain path component; no directory is made for it")
    return Path(root) / key


def _as_dir(argument: str, value: Any) -> str:
    try:
        text = os.fspath(value)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise ConfigError(f"{argument}={value!r} is not a directory: pass a str or a pathlib.Path")
    return text


def root_setting(value: Any) -> str:
    """``root=`` as a str (a str or an ``os.PathLike``), else a `ConfigError` naming it."""
    return _as_dir("root", value)


def dir_setting(value: Any) -> str | None:
    """``dir=`` as a str, or ``None``; else a `ConfigError` naming it."""
    return None if value is None else _as_dir("dir", value)


def _named(check: Any) -> Any:
    """``check`` as an attrs validator whose `ConfigError` names the class and the argument."""
    def validate(instance: Any, attribute: Any, value: Any) -> None:
        problem = check(value)
        if problem:
            raise ConfigError(f"{type(instance).__name__}({attribute.name}={value!r}): {problem}")
    return validate


#: ``log_cfg=`` is a bool (``"yes"`` is not: any non-empty string is truthy).
is_bool = _named(lambda v: None if isinstance(v, bool) else "this is True or False")
#: ``uri=``, ``experiment=``, ``project=``...: a str or None.
is_text = _named(lambda v: None if v is None or isinstance(v, str) else "this is a str (or None for the default)")


@attrs.frozen(kw_only=True)
class Settings:
    """The settings every built-in backend has (`Backend`'s ``on_error`` and ``log_cfg``)."""

    on_error: OnError = attrs.field(default="buffer", converter=check_on_error)
    log_cfg: bool = attrs.field(default=True, validator=is_bool)
