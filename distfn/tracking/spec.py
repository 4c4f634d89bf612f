"""``@distributed(track=...)`` checked at decoration: names, a list of them, or backend objects, as a tuple of
`Backend` settings whose extras are installed.

Imports: `errors`, `tracking.base` and the backends' settings classes (which import nothing heavy: each
backend's package is imported when its run opens, on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .. import tracking
from ..errors import ConfigError
from .base import Backend, check_on_error

#: The built-in backends by name (``track="mlflow"`` is ``track=MLflow()``), each its settings class's name in
#: `distfn.tracking`, imported there when a ``track=`` names it (not at every decoration).
BUILTIN: Final[dict[str, str]] = {"mlflow": "MLflow", "wandb": "WandB", "tensorboard": "TensorBoard", "csv": "CSV"}


def _one(item: Any) -> Backend:
    if isinstance(item, str):
        class_name = BUILTIN.get(item.strip().lower())
        if class_name is None:
            raise ConfigError(f"track={item!r} is not a tracking backend; use one of "
                              f"{', '.join(map(repr, BUILTIN))}, a list of them, or a backend object "
                              "(distfn.tracking.MLflow(...), ...)")
        make: Callable[[], Backend] = getattr(tracking, class_name)
        backend = make()
    elif isinstance(item, type):  # the class itself passes the Protocol check (it has the members) but is none
        raise ConfigError(f"track= got the class {item.__name__}, not a backend object: pass {item.__name__}() "
                          "(with its settings), or a name such as 'csv'")
    elif isinstance(item, Backend):
        backend = item
        _check_members(backend)
    else:
        raise ConfigError(f"track= takes a backend name ({', '.join(map(repr, BUILTIN))}), a list of them or a "
                          f"backend object with name, on_error, log_cfg, check() and open(); got {item!r}")
    backend.check()
    return backend


def _check_members(backend: Backend) -> None:
    """A user-made backend's settings, checked as the built-ins' are (the session relies on them)."""
    what = type(backend).__name__
    try:
        name, on_error, log_cfg = backend.name, backend.on_error, backend.log_cfg
    except Exception as exc:  # a property that raises is the backend's bug: say which
        raise ConfigError(f"track={what} object: reading its name / on_error / log_cfg raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(name, str) or not name:
        raise ConfigError(f"track={what} object: its name is {name!r}; a backend's name is a non-empty str")
    check_on_error(on_error)
    if not isinstance(log_cfg, bool):
        raise ConfigError(f"track={what} object: its log_cfg is {log_cfg!r}; it is True or False")
    if not callable(getattr(backend, "open", None)) or not callable(getattr(backend, "check", None)):
        raise ConfigError(f"track={what} object: open and check are methods")


def parse_track(value: Any) -> tuple[Backend, ...]:
    """``track=`` as the backends' settings (empty: no tracking), each checked (`Backend.check`); a name given
    twice is an error, since the two would write the same run."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    backends = tuple(_one(item) for item in items)
    names = [b.name for b in backends]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"track= names {', '.join(map(repr, twice))} twice; each backend logs one run per job")
    return backends
