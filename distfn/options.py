"""The validated arguments of ``@distributed``, and the rules that follow from them alone.

This module sits at the bottom of the import graph: it imports nothing from distfn except `errors`, and,
only when the argument is given, `fsdp_options` (plain values, no FSDP runtime) for ``fsdp=`` and `tracking.spec`
(the backends' settings, no tracking package) for ``track=``: each defines attrs classes, whose creation costs
~0.7 ms apiece at import (python -X importtime: ~4 ms together), paid by every decorating script otherwise. So the
decorator, the launcher, the rank bootstrap and the `Context` can all take an `Options` without import cycles.
Every argument is checked here once (a `ConfigError` naming the argument and the fix), and the rules that
depend only on the arguments live here too: which modes run one process (`Options.one_process`), which start a
process group (`Options.multi_rank`) and how many processes to start (`requested_nprocs`, `default_nprocs`).
"""

from __future__ import annotations

import datetime
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, get_args

import attrs
import torch.distributed as dist

from .errors import ConfigError
from .mesh import MeshSpec, parse_text

if TYPE_CHECKING:
    from .tracking.base import Backend

#: A mode of ``@distributed(mode=...)``. The closed sets below are `Literal` types, so strict mypy rejects a
#: misspelled value (``mode == "fdsp"`` is a non-overlapping comparison); ask `Options` (or the predicates
#: below) instead of comparing strings where one exists.
Mode = Literal["ddp", "fsdp", "dp", "single"]

#: A value of ``@distributed(launcher=...)``: ``auto`` detects, the others force one.
LauncherName = Literal["auto", "spawn", "torchrun", "slurm", "mpi", "ray"]

#: A value of ``@distributed(start_method=...)``.
StartMethod = Literal["auto", "fork", "forkserver", "spawn"]

#: A normalised ``precision``: full fp32, bf16 autocast, fp16 autocast + GradScaler.
Precision = Literal["32", "bf16", "16"]

#: Valid values of ``@distributed(mode=...)``.
MODES: Final[tuple[Mode, ...]] = get_args(Mode)

#: Modes that run exactly one process (no process group).
ONE_PROCESS_MODES: Final[tuple[Mode, ...]] = ("single", "dp")

#: Modes with one process per device and a process group.
MULTI_RANK_MODES: Final[tuple[Mode, ...]] = ("ddp", "fsdp")

#: The default ``timeout`` of collectives and rendezvous.
DEFAULT_TIMEOUT: Final = datetime.timedelta(minutes=30)

#: Valid values of ``@distributed(start_method=...)``.
START_METHODS: Final[tuple[StartMethod, ...]] = get_args(StartMethod)

#: Valid values of ``@distributed(launcher=...)``: ``auto`` detects, the others force one.
LAUNCHERS: Final[tuple[LauncherName, ...]] = get_args(LauncherName)

#: Accepted values of ``@distributed(precision=...)``: full fp32, bf16 autocast, fp16 autocast + GradScaler.
PRECISIONS: Final[tuple[Precision, ...]] = get_args(Precision)
_PRECISION_ALIASES: Final = {32: "32", 16: "16", "fp32": "32", "float32": "32", "fp16": "16", "float16": "16",
                             "bfloat16": "bf16"}
#: Lightning Fabric's precision names and the distfn value closest to each, for the did-you-mean of a port:
#: "-mixed" is autocast with float32 weights, as distfn's "bf16"/"16"; "-true" casts the whole model, which
#: distfn's precision never does (the weights stay float32).
_FABRIC_PRECISIONS: Final[dict[str, Precision]] = {
    "bf16-mixed": "bf16", "16-mixed": "16", "32-true": "32", "bf16-true": "bf16", "16-true": "16",
}

#: The environment variable that overrides ``nprocs=`` (read by `requested_nprocs` only: under an external
#: launcher the launcher's world size wins, and one-process modes name it in their error).
NPROCS_ENV: Final = "DISTFN_NPROCS"

#: The other environment variables that override an argument of ``@distributed`` at call time (`with_env`), and
#: how their text becomes the argument's value before the argument's own check. They win over the decorator's
#: arguments and over ``fn.options(...)``: they are the operator's last word, e.g. ``DISTFN_PRECISION=bf16``.
ENV_OVERRIDES: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    "DISTFN_PRECISION": ("precision", str.strip),
    "DISTFN_BACKEND": ("backend", str.strip),
    "DISTFN_START_METHOD": ("start_method", str.strip),
    "DISTFN_TIMEOUT": ("timeout", float),
    "DISTFN_MAX_RESTARTS": ("max_restarts", int),
    "DISTFN_REQUEUE": ("requeue", lambda text: parse_flag(text)),
    "DISTFN_LAUNCHER": ("launcher", str.strip),
    "DISTFN_MESH": ("mesh", parse_text),
    "DISTFN_KEEP_ALIVE": ("keep_alive", lambda text: parse_flag(text)),
}

#: Set by distfn's launcher in the environment of its workers: which attempt of the job they run (see
#: `restart_attempt`).
RESTART_ENV: Final = "DISTFN_RESTART"


# -- argument conversion (each raises ConfigError naming the argument and how to fix it) ------------------------
def closest(value: Any, choices: Sequence[str]) -> str | None:
    """The choice ``value`` was most likely meant to be, or ``None``: the same letters in another case first
    (``'DDP'`` -> ``'ddp'``), then a near spelling (``'dpp'`` -> ``'ddp'``, ``'nproc'`` -> ``'nprocs'``)."""
    if not isinstance(value, str):
        return None
    folded = {choice.casefold(): choice for choice in choices}
    if value.strip().casefold() in folded:
        return folded[value.strip().casefold()]
    near = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.7)
    return near[0] if near else None


def _did_you_mean(name: str, value: Any, choices: Sequence[str]) -> str:
    """``" (did you mean mode='ddp'?)"`` when `closest` finds one, else ``""``: appended to a bad value's error."""
    guess = closest(value, choices)
    return f" (did you mean {name}={guess!r}?)" if guess is not None else ""


def check_mode(mode: Any) -> Mode:
    """``mode`` unchanged when it is one of `MODES`."""
    for known in MODES:
        if mode == known:
            return known
    raise ConfigError(f"mode={mode!r} is not a distfn mode; valid modes are: {', '.join(map(repr, MODES))}"
                      + _did_you_mean("mode", mode, MODES))


def runs_one_process(mode: Mode) -> bool:
    """``mode`` runs exactly one process without a process group (``single``, ``dp``)."""
    return mode in ONE_PROCESS_MODES


def shards_state(mode: Mode) -> bool:
    """``mode`` shards parameters, gradients and optimizer state over the ranks (``fsdp``)."""
    return mode == "fsdp"


def check_nprocs(nprocs: Any, source: str = "nprocs") -> int | None:
    """A positive process count (a string only when it comes from the environment, ``source`` names it)."""
    if nprocs is None:
        return None
    if isinstance(nprocs, str) and source != "nprocs":
        try:
            nprocs = int(nprocs.strip())
        except ValueError:
            raise ConfigError(f"{source}={nprocs!r} is not an integer; set it to a process count such as 2") from None
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise ConfigError(f"{source} must be a positive int, got {nprocs!r} ({type(nprocs).__name__})")
    if nprocs < 1:
        raise ConfigError(f"{source}={nprocs} must be at least 1")
    return nprocs


def check_backend(backend: str | None) -> str | None:
    """A ``torch.distributed`` backend in canonical form: lower case (``"NCCL"`` -> ``"nccl"``), per-device forms
    sorted by device (``"cuda:nccl,cpu:gloo"`` -> ``"cpu:gloo,cuda:nccl"``), and a per-device form that is one
    backend's own device map collapsed to its name (``"cuda:nccl"`` -> ``"nccl"``, as torch reads ``"nccl"``).

    So every later test of the backend (``== "nccl"``, NCCL-only groups) sees one spelling.
    """
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend.strip():
        raise ConfigError(f"backend must be a string such as 'gloo' or 'nccl', got {backend!r}")
    known = [b.lower() for b in dist.Backend.backend_list]

    def checked(name: str) -> str:
        if name not in known:
            raise ConfigError(f"backend={backend!r}: {name!r} is not a torch.distributed backend here; "
                              f"available: {', '.join(known)}")
        return name

    text = backend.strip().lower()
    if ":" not in text:
        return checked(text)
    pairs: dict[str, str] = {}
    for part in text.split(","):
        device, sep, name = (p.strip() for p in part.partition(":"))
        if not sep or not device or not name or ":" in name or device in pairs:
            raise ConfigError(f"backend={backend!r}: {part.strip()!r} is not a 'device:backend' pair of its own; "
                              "write one pair per device type, e.g. 'cpu:gloo,cuda:nccl'")
        pairs[device] = checked(name)
    for name, devices in dist.Backend.backend_capability.items():
        if pairs == dict.fromkeys(devices, name):
            return name
    return ",".join(f"{device}:{pairs[device]}" for device in sorted(pairs))


def check_seed(seed: Any) -> int | None:
    """A non-negative int seed, or ``None``."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int or None, got {seed!r}")
    return seed


def check_timeout(timeout: Any) -> datetime.timedelta:
    """Seconds or a ``timedelta`` as a positive ``timedelta``; ``None`` is `DEFAULT_TIMEOUT`."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not math.isfinite(timeout):  # timedelta(seconds=inf) is a bare OverflowError, nan a bare ValueError
            raise ConfigError(f"timeout must be a finite number of seconds, got {timeout!r}")
        try:
            value = datetime.timedelta(seconds=timeout)
        except OverflowError:
            raise ConfigError(f"timeout={timeout!r} seconds is too large (at most {datetime.timedelta.max})") from None
    else:
        raise ConfigError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ConfigError(f"timeout must be positive, got {timeout!r}")
    return value


def check_devices(devices: Any) -> tuple[int, ...] | None:
    """GPU indices (``"0,5"``, ``[0, 5]`` or one int) as a tuple of distinct non-negative ints."""
    if devices is None:
        return None
    items: Sequence[Any]
    if isinstance(devices, int) and not isinstance(devices, bool):
        items = [devices]
    elif isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, (list, tuple)):
        items = devices
    else:
        raise ConfigError(f"devices must be like '0,5' or [0, 5], got {devices!r}")
    out: list[int] = []
    for d in items:
        try:
            if isinstance(d, bool):
                raise ValueError
            value = int(d)
        except (TypeError, ValueError):
            raise ConfigError(f"devices={devices!r}: {d!r} is not a GPU index") from None
        if value < 0:
            raise ConfigError(f"devices={devices!r}: GPU indices are >= 0, got {value}")
        out.append(value)
    if not out:
        raise ConfigError(f"devices={devices!r} names no GPU; omit it to use all visible GPUs")
    if len(set(out)) != len(out):
        raise ConfigError(f"devices={devices!r} names a GPU twice")
    return tuple(out)


_C = TypeVar("_C", bound=str)


def _check_choice(name: str, value: Any, choices: Sequence[_C]) -> _C:
    for choice in choices:
        if value == choice:
            return choice
    raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(map(repr, choices))}"
                      + _did_you_mean(name, value, choices))


def check_start_method(value: Any) -> StartMethod:
    """One of `START_METHODS`."""
    return _check_choice("start_method", value, START_METHODS)


def check_launcher(value: Any) -> LauncherName:
    """One of `LAUNCHERS`."""
    return _check_choice("launcher", value, LAUNCHERS)


def parse_flag(text: str) -> bool:
    """An on/off environment value: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not 1/true/yes/on or 0/false/no/off")


def check_requeue(value: Any) -> bool:
    """A bool: requeue a Slurm job that stopped on a stop signal (see `distfn.preemption.requeue`)."""
    if not isinstance(value, bool):
        raise ConfigError(f"requeue must be True or False, got {value!r}")
    return value


def check_rank_seeds(value: Any) -> bool:
    """A bool: seed rank r with ``seed + r`` (its own random stream) instead of ``seed`` on every rank."""
    if not isinstance(value, bool):
        raise ConfigError(f"rank_seeds must be True or False, got {value!r}")
    return value


def check_keep_alive(value: Any) -> bool:
    """A bool: keep a self-spawned job's ranks alive between calls (see `distfn.launch.pool`)."""
    if not isinstance(value, bool):
        raise ConfigError(f"keep_alive must be True or False, got {value!r}")
    return value


def check_max_restarts(value: Any) -> int:
    """A non-negative int: how many times a failed self-spawned job is started again."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"max_restarts must be a non-negative int (0: never restart), got {value!r}")
    return value


def check_init_method(init_method: str | None) -> str | None:
    """``None`` or a URL starting with ``env://``, ``tcp://`` or ``file://``."""
    if init_method is None:
        return None
    if not isinstance(init_method, str) or not init_method.startswith(("env://", "tcp://", "file://")):
        raise ConfigError(f"init_method={init_method!r} must start with env://, tcp:// or file://")
    return init_method


def check_precision(value: Any) -> Precision:
    """Normalise ``precision`` to one of `PRECISIONS` (``32``/``16`` as ints and "fp16"-style names are
    accepted), raising `ConfigError` otherwise."""
    if isinstance(value, bool):
        value = None  # never a precision; falls through to the error
    name = _PRECISION_ALIASES.get(value, value) if isinstance(value, (int, str)) else None
    for known in PRECISIONS:
        if name == known:
            return known
    choices = f"use one of {', '.join(map(repr, PRECISIONS))} (full float32, bfloat16 autocast, float16 autocast " \
              "with a GradScaler)"
    fabric = _FABRIC_PRECISIONS.get(value.strip().casefold()) if isinstance(value, str) else None
    if fabric is not None:
        note = ("" if not value.strip().casefold().endswith("-true") or fabric == "32" else
                f". distfn's {fabric!r} is autocast with float32 weights; for weights in that dtype too, convert "
                "the model yourself (model.to(dtype))")
        raise ConfigError(f"precision={value!r} is a Lightning Fabric name, not distfn's; {choices} "
                          f"(did you mean precision={fabric!r}?){note}")
    raise ConfigError(f"precision={value!r} is not valid; {choices}"
                      + _did_you_mean("precision", value, (*PRECISIONS, *map(str, _PRECISION_ALIASES))))


def check_fsdp(value: Any) -> Any:
    """``fsdp={...}`` -> ``distfn.fsdp_options.FsdpOptions`` (unknown keys are an error naming the valid ones)."""
    if value is None:
        return None
    from .fsdp_options import parse_options  # deferred: only for fsdp= (see the module's docstring)

    return parse_options(value)


def check_mesh(value: Any) -> MeshSpec | None:
    """``mesh=`` -> `distfn.mesh.MeshSpec` (``None``: plain FSDP over every rank)."""
    return MeshSpec.parse(value)


def check_track(value: Any) -> tuple[Backend, ...]:
    """``track=`` -> the backends' settings (`distfn.tracking.spec.parse_track`); ``None``: no tracking."""
    if value is None:
        return ()
    from .tracking.spec import parse_track  # deferred: only for track= (see the module's docstring)

    return parse_track(value)


@attrs.frozen
class Options:
    """The validated arguments of ``@distributed`` (what every worker receives).

    The fields are the keyword arguments of `distfn.distributed`, documented there; each is converted and
    checked on construction, so an `Options` is always valid (``attrs.evolve`` checks again).
    """

    mode: Mode = attrs.field(default="ddp", converter=check_mode)
    nprocs: int | None = attrs.field(default=None, converter=check_nprocs)
    backend: str | None = attrs.field(default=None, converter=check_backend)
    seed: int | None = attrs.field(default=None, converter=check_seed)
    timeout: datetime.timedelta = attrs.field(default=None, converter=check_timeout)
    devices: tuple[int, ...] | None = attrs.field(default=None, converter=check_devices)
    start_method: StartMethod = attrs.field(default="auto", converter=check_start_method)
    launcher: LauncherName = attrs.field(default="auto", converter=check_launcher)
    init_method: str | None = attrs.field(default=None, converter=check_init_method)
    precision: Precision = attrs.field(default="32", converter=check_precision)
    fsdp: Any = attrs.field(default=None, converter=check_fsdp)  # distfn.fsdp_options.FsdpOptions | None
    max_restarts: int = attrs.field(default=0, converter=check_max_restarts)
    requeue: bool = attrs.field(default=False, converter=check_requeue)
    track: tuple[Backend, ...] = attrs.field(default=None, converter=check_track)
    mesh: MeshSpec | None = attrs.field(default=None, converter=check_mesh)
    rank_seeds: bool = attrs.field(default=False, converter=check_rank_seeds)
    keep_alive: bool = attrs.field(default=False, converter=check_keep_alive)

    def __attrs_post_init__(self) -> None:
        if self.rank_seeds and self.seed is None:
            raise ConfigError("rank_seeds=True seeds rank r with seed + r, but no seed= was given; pass both, e.g. "
                              "@distributed(seed=1337, rank_seeds=True)")
        if self.one_process and self.nprocs not in (None, 1):
            raise ConfigError(f"mode={self.mode!r} runs one process, but nprocs={self.nprocs}; "
                              "use mode='ddp' for several processes")
        if self.fsdp is not None and not self.shards_state:
            raise ConfigError(f"fsdp= options were given but mode={self.mode!r}; use mode='fsdp' or drop fsdp=")
        if self.mesh is not None and not self.shards_state:
            raise ConfigError(f"mesh={self.mesh.describe()!r} lays out FSDP's ranks (HSDP, FSDP x TP), but "
                              f"mode={self.mode!r}; use mode='fsdp' or drop mesh=")
        if self.mesh is not None and self.nprocs is not None:
            self.mesh.resolve(self.nprocs)  # a ConfigError now, at decoration, when the sizes cannot fill nprocs
        if self.devices is not None and self.nprocs is not None and self.multi_rank \
                and self.nprocs > len(self.devices) and (self.backend or "nccl") == "nccl":
            raise ConfigError(f"nprocs={self.nprocs} is more than the {len(self.devices)} GPU(s) in "
                              f"devices={self.devices}; NCCL needs one GPU per process")

    @property
    def one_process(self) -> bool:
        """The mode runs exactly one process without a process group (``single``, ``dp``)."""
        return runs_one_process(self.mode)

    @property
    def shards_state(self) -> bool:
        """The mode shards parameters, gradients and optimizer state over the ranks (``fsdp``)."""
        return shards_state(self.mode)

    @property
    def multi_rank(self) -> bool:
        """The mode runs one process per device joined by a process group (``ddp``, ``fsdp``)."""
        return self.mode in MULTI_RANK_MODES


#: The names of the keyword arguments of ``@distributed`` (the fields of `Options`).
PARAMETERS: Final = tuple(a.name for a in attrs.fields(Options))


def make_options(given: Mapping[str, Any], base: Options | None = None) -> Options:
    """`Options` from keyword arguments (on top of ``base``), an unknown name being a `ConfigError`."""
    unknown = sorted(k for k in given if k not in PARAMETERS)
    if unknown:
        verb = "is not an option" if len(unknown) == 1 else "are not options"
        guesses = [f"{guess}= for {name}=" for name in unknown if (guess := closest(name, PARAMETERS)) is not None]
        hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
        raise ConfigError(f"{', '.join(map(repr, unknown))} {verb} of @distributed; valid options are: "
                          f"{', '.join(PARAMETERS)}{hint}")
    return Options(**given) if base is None else attrs.evolve(base, **given)


def with_env(opts: Options, env: Mapping[str, str]) -> Options:
    """``opts`` with the overrides of `ENV_OVERRIDES` that ``env`` sets (empty values are ignored), each checked
    like the argument itself; a bad value is a `ConfigError` naming the variable. (``DISTFN_NPROCS``: see
    `requested_nprocs`.)"""
    changes: dict[str, Any] = {}
    for var, (name, parse) in ENV_OVERRIDES.items():
        text = env.get(var, "")
        if not text.strip():
            continue
        try:
            changes[name] = parse(text)
            attrs.evolve(opts, **{name: changes[name]})
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"{var}={text!r} (overriding {name}=) is not valid: {exc}") from None
    return attrs.evolve(opts, **changes) if changes else opts


def restart_attempt(env: Mapping[str, str]) -> int:
    """Which attempt of the job this process runs, 0 for the first: ``DISTFN_RESTART`` in a worker of distfn's
    launcher (``max_restarts=``), else torchrun's ``TORCHELASTIC_RESTART_COUNT`` (``--max-restarts``)."""
    for var in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"):
        text = env.get(var, "").strip()
        if text.isdigit():
            return int(text)
    return 0


def requested_nprocs(opts: Options, env: Mapping[str, str]) -> int | None:
    """The process count asked for: ``DISTFN_NPROCS`` (validated) over ``nprocs=``, or ``None``."""
    value = env.get(NPROCS_ENV)
    if value is not None and value.strip():
        return check_nprocs(value, NPROCS_ENV)
    return opts.nprocs


def fixed_nprocs(opts: Options, env: Mapping[str, str]) -> int | None:
    """The process count that the options alone decide: the requested count, else 1 for the one-process modes,
    else ``len(devices)``; ``None``: one per GPU (of this machine, or of a Ray cluster)."""
    requested = requested_nprocs(opts, env)
    if requested is not None:
        if opts.one_process and requested != 1:  # nprocs= itself was checked at decoration time
            raise ConfigError(f"{NPROCS_ENV}={requested} but mode={opts.mode!r} runs one process")
        return requested
    if opts.one_process:
        return 1
    if opts.devices is not None:
        return len(opts.devices)
    return None


def default_nprocs(opts: Options, env: Mapping[str, str], visible_gpus: Callable[[], int]) -> int:
    """How many processes a self-spawned job starts: `fixed_nprocs`, else one per visible GPU (at least one).
    ``visible_gpus`` is asked only then (a Ray job passes the cluster's count, which may refuse zero)."""
    fixed = fixed_nprocs(opts, env)
    return fixed if fixed is not None else max(1, visible_gpus())
