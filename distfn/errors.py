"""The exception types distfn raises, so users can catch them precisely."""

from __future__ import annotations


class DistfnError(Exception):
    """Base class of every error raised by distfn itself."""


class LauncherError(DistfnError, ValueError):
    """The launcher environment is missing or inconsistent (raised before any process group starts)."""


class ConfigError(DistfnError, ValueError):
    """An argument of ``@distributed`` or of the decorated call is invalid."""


class CheckpointError(DistfnError):
    """A checkpoint cannot be written or read as asked."""
