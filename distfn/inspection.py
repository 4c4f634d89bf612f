"""``distfn inspect CKPT`` and ``distfn ls DIR``: what a checkpoint holds, and which one a resume would take.

`inspect` reads a checkpoint's headers only, through the checkpoint package's own checked readers
(`distfn.checkpoint.storage.read_header` for one file, `distfn.checkpoint.sharded.open_checkpoint` for a sharded
directory): the layout, the step, every tensor's dtype, shape and size, and what ``ctx.resume`` would restore from
it (the training state's entries, each ``ctx.dataloader``'s position, the RNG states, the tracking run it
continues). No tensor is read and nothing is unpickled; a file is checked exactly as a load checks it, so a
damaged one is reported with the error a load would raise.

`listing` lists a directory (or a URL: ``s3://bucket/run``) as `distfn.latest` sees it: the step-numbered
checkpoints newest first, each with why it is or is not a candidate, and the one `distfn.latest` picks (asked of
`distfn.latest` itself, so the answer cannot drift from a resume's).

Everything read here comes from a file and is untrusted: every name shown is escaped (`shown`), so a tensor
named with terminal control characters prints as text.

Output here is for a person at a terminal, so this module prints (the library itself logs).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .checkpoint import api, sharded, storage
from .checkpoint import format as fmt
from .checkpoint.layout import SUFFIX, Location, resolve, step_of, step_of_path
from .checkpoint.sharded.spec import KEY_WORLD
from .errors import CheckpointError
from .loader_state import LoaderState

__all__ = ["CheckpointInfo", "Entry", "Listing", "TensorInfo", "describe", "listing", "render_info",
           "render_listing", "shown"]

#: The metadata key of the tracking record ``ctx.save`` stores (`distfn.tracking.key.RECORD_KEY`; the string is
#: repeated here so that inspecting imports no tracking code).
_TRACKING = "distfn.tracking"
#: The training-state key ``ctx.save(..., rng=True)`` stores the RNG states under.
_RNG = "rng"
_LOADER_FIELDS = frozenset({"epoch", "position", "global_batch", "dataset_len", "world_size"})
_TOO_DEEP = "its header's JSON is nested too deeply to read (damaged, or made to break readers)"
#: Tensors listed by default (``--all``: every one).
TENSORS_SHOWN = 40


def shown(text: Any) -> str:
    """``text`` safe to print: control characters and other unprintable ones escaped (a name read from a file may
    hold ANSI escape sequences or newlines), very long names cut."""
    value = str(text)
    if not value.isprintable():
        value = value.encode("unicode_escape", "backslashreplace").decode("ascii")
    return value if len(value) <= 200 else value[:197] + "..."


def human_bytes(n: int) -> str:
    """``1.5 MiB``: a size for people."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


@attrs.frozen
class TensorInfo:
    """One stored tensor: its name, safetensors dtype code, full shape and size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen
class CheckpointInfo:
    """What `describe` found in a checkpoint (every field JSON-able through `as_dict`)."""

    path: str
    #: ``"file"`` (one ``.safetensors`` file) or ``"sharded"`` (a directory of shards and an index).
    layout: str
    size: int
    #: The step in the checkpoint's name (what ``ctx.resume`` returns), or ``None``.
    step: int | None
    #: The training state's ``"step"`` entry when it holds an int, else ``None``.
    state_step: int | None
    files: tuple[str, ...]
    #: The world size that wrote a sharded checkpoint (``None`` for one file).
    world_size: int | None
    tensors: tuple[TensorInfo, ...]
    #: Tied names: ``{alias: stored name}``.
    aliases: dict[str, str]
    #: Each top-level entry of the saved object: ``{key: what it holds}``.
    entries: dict[str, str]
    #: ``{key path: loader state}`` for every ``ctx.dataloader`` position found (or ``{"error": ...}``).
    loaders: dict[str, dict[str, Any]]
    #: ``{"ranks": N, "parts": [...]}`` when the state holds RNG states, else ``None``.
    rng: dict[str, Any] | None
    #: The tracking record (``key``, ``step``, ``runs``) when ``ctx.save`` stored one, else ``None``.
    tracking: dict[str, Any] | None
    #: The keys of the ``metadata=`` mapping saved with it (the tracking record excluded).
    metadata_keys: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """The info as JSON-ready data."""
        return attrs.asdict(self, recurse=True)


def _tensors_of_header(header: fmt.Header) -> list[TensorInfo]:
    out = []
    for name, (_, shape, begin, stop) in header.spans.items():
        code = header.tensors[name]["dtype"]
        out.append(TensorInfo(name, str(code), shape, stop - begin))
    return out


def _tensors_of_index(shapes: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[TensorInfo]:
    return [TensorInfo(name, code, shape, math.prod(shape) * fmt.FROM_CODE[code].itemsize)
            for name, (code, shape) in shapes.items()]


def _plain(node: Any) -> dict[Any, Any] | None:
    """`distfn.checkpoint.format.as_plain_dict`, with a key that cannot be one (a list, from a crafted tree) as a
    `CheckpointError`."""
    try:
        return fmt.as_plain_dict(node)
    except TypeError as exc:
        raise CheckpointError(f"corrupt distfn metadata: a mapping key in its tree cannot be a key ({exc})") from None


def _walk(node: Any) -> list[tuple[str, Any]]:
    """Every mapping node of a (checked) saved tree with its dotted key path, without recursion (a tree may be
    deeply nested)."""
    found: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", node)]
    while stack:
        path, item = stack.pop()
        plain = _plain(item) if isinstance(item, dict) else None
        if plain is not None:
            found.append((path, plain))
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in plain.items())
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(item))
        elif isinstance(item, dict) and len(item) == 1 and "__tuple__" in item:
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(item["__tuple__"]))
    return found


def _count_tensors(node: Any, sizes: Mapping[str, int]) -> tuple[int, int]:
    count = total = 0
    stack = [node]
    while stack:
        item = stack.pop()
        name = fmt.ref(item)
        if name is None and isinstance(item, dict) and len(item) == 1 and "__ndarray__" in item:
            name = str(item["__ndarray__"])
        if name is not None:
            count, total = count + 1, total + sizes.get(name, 0)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count, total


def _what(key: str, node: Any, sizes: Mapping[str, int]) -> str:
    """A short description of a top-level entry of a training state."""
    plain = _plain(node) if isinstance(node, dict) else None
    if fmt.ref(node) is not None:
        return "a tensor"
    if plain is None:
        return fmt.kind(node) if isinstance(node, (dict, list)) else f"{shown(json.dumps(node))}"
    count, total = _count_tensors(node, sizes)
    if _LOADER_FIELDS <= set(plain):
        what = "a ctx.dataloader position"
    elif key == _RNG and (isinstance(plain.get("ranks"), list) or "torch" in plain):
        what = "RNG states"
    elif {"state", "param_groups"} <= set(plain):
        what = "optimizer state"
    elif "scale" in plain and "growth_factor" in plain:
        what = "GradScaler state"
    elif "last_epoch" in plain or "base_lrs" in plain:
        what = "LR scheduler state"
    elif count and count == len(plain):
        what = "a module's parameters and buffers"
    else:
        what = f"a mapping of {len(plain)} entries"
    return f"{what} ({count} tensors, {human_bytes(total)})" if count else what


def _loaders(tree: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path, plain in _walk(tree):
        if _LOADER_FIELDS <= {str(k) for k in plain}:
            try:
                out[path or "<root>"] = attrs.asdict(LoaderState.from_dict(plain))
            except CheckpointError as exc:  # what the resume itself would raise
                out[path or "<root>"] = {"error": str(exc)}
    return out


def _rng(tree: Any) -> dict[str, Any] | None:
    plain = _plain(tree) if isinstance(tree, dict) else None
    node = plain.get(_RNG) if plain is not None else None
    saved = _plain(node) if isinstance(node, dict) else None
    if saved is None:
        return None
    ranks = saved.get("ranks")
    states = ranks if isinstance(ranks, list) else [saved]
    parts = sorted({str(k) for s in states if isinstance(s, dict) for k in s})
    return {"ranks": len(states), "parts": parts}


def _tracking(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    record = metadata.get(_TRACKING)
    if not isinstance(record, Mapping):
        return None
    runs = record.get("runs")
    return {"key": record.get("key"), "step": record.get("step"),
            "runs": dict(runs) if isinstance(runs, Mapping) else {}}


def _user_metadata(header: fmt.Header) -> dict[str, Any]:
    """The ``metadata=`` mapping saved with a distfn checkpoint (none: ``{}``), or a foreign file's strings."""
    if fmt.KEY_METADATA in header.metadata:
        return fmt.saved_metadata(header)
    if fmt.KEY_TREE in header.metadata:  # distfn's own, saved without metadata=
        return {}
    return {k: v for k, v in header.metadata.items() if k != "format"}


def describe(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """What the checkpoint at ``path`` (a ``.safetensors`` file, a sharded directory, or a URL of either) holds,
    from its headers alone, checked as a load checks them.

    Raises:
        CheckpointError: nothing there, not a checkpoint, or damaged (the error a load would raise).
    """
    loc = resolve(path, storage_options)
    kind = loc.layout()
    if kind == "sharded":
        checkpoint = sharded.open_checkpoint(loc)
        strings = {k: v for k, v in checkpoint.metadata.items() if isinstance(v, str)}
        header = fmt.Header(loc.path, 0, {}, strings)
        tensors = _tensors_of_index(checkpoint.shapes)
        tree, aliases, files = checkpoint.tree, checkpoint.aliases, checkpoint.files
        size = _size(loc, "sharded") or 0
        world = checkpoint.metadata.get(KEY_WORLD)
        world_size = int(world) if isinstance(world, str) and world.isdigit() and len(world) < 10 else None
    elif kind == "file":
        header = storage.read_header(loc)
        tree = fmt.check(header)
        aliases, tensors = fmt.saved_aliases(header), _tensors_of_header(header)
        files, size, world_size = (loc.name,), loc.fs.size(loc.path), None
    elif kind == "dir":
        raise CheckpointError(f"'{loc}' is a directory without a sharded checkpoint's index: not a checkpoint "
                              f"(to list the checkpoints in it: distfn ls {loc})")
    elif kind == "missing":
        raise CheckpointError(f"no checkpoint at '{loc}'")
    else:
        raise CheckpointError(f"'{loc}' is not a regular file or directory")
    try:
        return _info(loc, kind, header, tree, aliases, files, size, world_size, tensors)
    except CheckpointError as exc:
        raise CheckpointError(str(exc) if str(loc) in str(exc) else f"'{loc}': {exc}") from None


def _info(loc: Location, kind: str, header: fmt.Header, tree: Any, aliases: Mapping[str, str], files: Sequence[str],
          size: int, world_size: int | None, tensors: list[TensorInfo]) -> CheckpointInfo:
    """`describe`'s result from the checked header (and, for a sharded directory, the checked index)."""
    metadata = _user_metadata(header)
    sizes = {t.name: t.nbytes for t in tensors}
    plain = _plain(tree) if isinstance(tree, dict) else None
    if plain and all(fmt.ref(v) is not None for v in plain.values()):  # a bare state dict, or a foreign file
        entries = {"<root>": _what("", tree, sizes)}
    else:
        entries = {shown(k): _what(str(k), v, sizes) for k, v in (plain or {}).items()}
    step_entry = plain.get("step") if plain is not None else None
    state_step = step_entry if isinstance(step_entry, int) and not isinstance(step_entry, bool) else None
    return CheckpointInfo(
        path=str(loc), layout="sharded" if kind == "sharded" else "file", size=size, step=step_of_path(loc.name),
        state_step=state_step, files=tuple(files), world_size=world_size,
        tensors=tuple(sorted(tensors, key=lambda t: t.name)), aliases=dict(aliases), entries=entries,
        loaders=_loaders(tree), rng=_rng(tree), tracking=_tracking(metadata),
        metadata_keys=tuple(sorted(str(k) for k in metadata if k != _TRACKING)))


def _line(key: str, value: Any) -> str:
    return f"  {key:<16} {value}"


def _loader_line(state: Mapping[str, Any]) -> str:
    if "error" in state:
        return f"a ctx.dataloader position that cannot be restored: {shown(state['error'])}"
    return (f"ctx.dataloader at epoch {state['epoch']}, next batch {state['batches']} (position {state['position']} "
            f"of {state['dataset_len']} samples), global batch {state['global_batch']}, seed {state['seed']}, "
            f"shuffle {'on' if state['shuffle'] else 'off'}, saved on {state['world_size']} ranks")


def _rng_line(rng: Mapping[str, Any]) -> str:
    parts = ", ".join(map(shown, rng["parts"]))
    return f"RNG states of {rng['ranks']} rank(s) ({parts}): each rank gets its own back"


def render_info(info: CheckpointInfo, *, every_tensor: bool = False) -> str:
    """The human-readable report of a `describe` result (``every_tensor``: no cut after `TENSORS_SHOWN`)."""
    if info.layout == "sharded":
        where = f"sharded directory: {len(info.files)} shard file(s)"
        where += f", written by {info.world_size} ranks" if info.world_size else ""
    else:
        where = "single file"
    total = sum(t.nbytes for t in info.tensors)
    step = "-" if info.step is None else str(info.step)
    if info.state_step is not None and info.state_step != info.step:
        step += f" (the state's 'step' entry: {info.state_step})"
    out = [f"checkpoint {shown(info.path)}", _line("layout", where), _line("size", human_bytes(info.size)),
           _line("step", step + ("" if info.step is not None else " (no step number in the name)")), "",
           f"tensors ({len(info.tensors)}, {human_bytes(total)})"]
    out += _render_tensors(info, every_tensor)
    out += ["", "what ctx.resume restores", *_render_resume(info)]
    if info.metadata_keys:
        out.append(_line("metadata", ", ".join(map(shown, info.metadata_keys))))
    return "\n".join(out)


def _render_tensors(info: CheckpointInfo, every_tensor: bool) -> list[str]:
    out = []
    width = min(max((len(shown(t.name)) for t in info.tensors), default=0), 60)
    listed = info.tensors if every_tensor else info.tensors[:TENSORS_SHOWN]
    for t in listed:
        out.append(f"  {shown(t.name):<{width}}  {t.dtype:<6} {list(t.shape)!s:<18} {human_bytes(t.nbytes)}")
    if len(listed) < len(info.tensors):
        out.append(f"  ... and {len(info.tensors) - len(listed)} more (distfn inspect --all)")
    if info.aliases:
        out.append(_line("tied names", ", ".join(f"{shown(a)} -> {shown(t)}" for a, t in sorted(info.aliases.items()))))
    return out


def _render_resume(info: CheckpointInfo) -> list[str]:
    out = []
    loaders = dict(info.loaders)
    for key, what in info.entries.items():
        if key in loaders:
            what = _loader_line(loaders.pop(key))
        elif key == _RNG and info.rng is not None:
            what = _rng_line(info.rng)
        out.append(_line(key, what))
    if not info.entries:
        out.append(_line("state", "(no entries)"))
    out += [_line(shown(path), _loader_line(state)) for path, state in loaders.items()]  # nested deeper
    if not info.loaders:
        out.append(_line("(loader)", "no ctx.dataloader position saved: a loader starts at its first batch"))
    if info.rng is None:
        out.append(_line("(RNG)", "not saved: ctx.save(..., rng=True) saves every rank's generators"))
    elif _RNG not in info.entries:
        out.append(_line("(RNG)", _rng_line(info.rng)))
    if info.tracking is not None:
        record = info.tracking
        runs = "; ".join(f"{shown(name)}: " + (", ".join(f"{shown(k)}={shown(v)}" for k, v in ids.items())
                                               if isinstance(ids, Mapping) else shown(ids))
                         for name, ids in record["runs"].items())
        out.append(_line("(tracking)", f"continues run {shown(record['key'])}, last step logged "
                                       f"{shown(record['step'])}" + (f" ({runs})" if runs else "")))
    else:
        out.append(_line("(tracking)", "no run recorded: saved without track=, or not by ctx.save"))
    return out


# -- distfn ls -----------------------------------------------------------------------------------------------------
@attrs.frozen
class Entry:
    """One entry of a listing: its name, step, layout, size, and whether `distfn.latest` could pick it."""

    name: str
    step: int | None
    layout: str
    size: int | None
    #: ``"complete"``, ``"skipped"`` (a candidate that fails a load's checks), ``"other"`` (not a candidate).
    status: str
    why: str


@attrs.frozen
class Listing:
    """What `listing` found: the directory, the prefix, the entries newest first, and `distfn.latest`'s pick."""

    directory: str
    prefix: str
    entries: tuple[Entry, ...]
    latest: str | None
    hidden: int
    #: Why `distfn.latest` itself failed on this directory (a resume from it would fail the same way), or ``None``.
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The listing as JSON-ready data."""
        return attrs.asdict(self, recurse=True)


def _size(loc: Location, layout: str) -> int | None:
    try:
        if layout == "file":
            return loc.fs.size(loc.path)
        return sum(loc.fs.size(loc.child(n).path) for n in loc.fs.listdir(loc.path)
                   if not n.startswith(".") and loc.fs.kind(loc.child(n).path) == "file")
    except (OSError, CheckpointError):
        return None


def _entry(d: Location, name: str, prefix: str) -> Entry | None:
    """The listing's entry for ``name``, classified exactly as `distfn.latest` does (``None``: not a checkpoint's
    name, left out)."""
    loc = d.child(name)
    as_file, as_dir = step_of(name), step_of(name, directory=True)
    if as_file is None and as_dir is None and not name.endswith(SUFFIX):
        return None
    layout = loc.layout()
    if as_file is not None and layout == "file":
        parsed = as_file
    elif as_dir is not None and layout in ("sharded", "dir"):
        parsed = as_dir
    elif layout == "missing":
        step = (as_file or as_dir or ("", None))[1]
        return Entry(name, step, layout, None, "skipped", "nothing readable under this name: on object storage an "
                     "upload without its commit object (a save in progress, or a writer stopped before its "
                     "commit); on a disk a dangling link")
    elif name.endswith(SUFFIX):
        why = "no step number in its name" if as_file is None else f"a {layout}, not a .safetensors file"
        return Entry(name, None if as_file is None else as_file[1], layout, _size(loc, layout), "other",
                     f"{why}: distfn.latest never picks it")
    else:
        return None  # a plain file or directory named like a step (ckpt-3, no suffix): not a checkpoint
    size = _size(loc, layout)
    if parsed[0] != prefix:
        return Entry(name, parsed[1], layout, size, "other",
                     f"prefix '{shown(parsed[0])}', not '{shown(prefix)}' (distfn ls --prefix '{shown(parsed[0])}')")
    try:
        api.verify(loc)
    except CheckpointError as exc:
        return Entry(name, parsed[1], layout, size, "skipped", _one_line(exc).replace(f"'{loc}'", "it"))
    except RecursionError:  # a header's JSON nested past Python's limit: damaged, whatever else it holds
        return Entry(name, parsed[1], layout, size, "skipped", _TOO_DEEP)
    return Entry(name, parsed[1], layout, size, "complete", "")


def listing(directory: str | os.PathLike[str], prefix: str = "ckpt-",
            storage_options: Mapping[str, Any] | None = None) -> Listing:
    """The checkpoints of ``directory`` as `distfn.latest` (with ``prefix``) sees them, newest first.

    Raises:
        CheckpointError: ``directory`` is missing or not a directory.
    """
    d = resolve(directory, storage_options)
    kind = d.fs.kind(d.path)
    if kind == "missing":
        raise CheckpointError(f"no directory at '{d}'")
    if kind != "dir":
        raise CheckpointError(f"'{d}' is not a directory (to see what a checkpoint holds: distfn inspect {d})")
    names = d.fs.listdir(d.path)
    hidden = sum(1 for n in names if n.startswith("."))
    found = [e for e in (_entry(d, n, prefix) for n in names if not n.startswith(".")) if e is not None]
    found.sort(key=lambda e: (e.step if e.step is not None else -1, e.name), reverse=True)
    try:
        picked = api.latest(directory, prefix=prefix, storage_options=storage_options)  # a resume's own answer
    except RecursionError:
        return Listing(str(d), prefix, tuple(found), None, hidden, f"distfn.latest fails here: {_TOO_DEEP}")
    except CheckpointError as exc:
        return Listing(str(d), prefix, tuple(found), None, hidden, f"distfn.latest fails here: {_one_line(exc)}")
    return Listing(str(d), prefix, tuple(found), None if picked is None else picked.name, hidden)


def render_listing(result: Listing) -> str:
    """The human-readable listing of a `listing` result."""
    out = [f"{shown(result.directory)} (prefix '{shown(result.prefix)}', newest first)"]
    if not result.entries:
        out.append("  no checkpoints here")
    width = min(max((len(shown(e.name)) for e in result.entries), default=0), 60)
    picked = next((e for e in result.entries if e.name == result.latest), None)
    for e in result.entries:
        size = human_bytes(e.size) if e.size is not None else "-"
        mark = "*" if e.name == result.latest else " "
        status = e.status if not e.why else f"{e.status}: {shown(e.why)}"
        if e.name == result.latest:
            status = "complete: distfn.latest picks this one"
        elif e.status == "complete" and picked is not None:
            status = "complete (older)" if (e.step or 0) < (picked.step or 0) else \
                f"complete (same step: distfn.latest takes {shown(picked.name)}, the name sorted last)"
        step = "-" if e.step is None else str(e.step)
        out.append(f"{mark} {shown(e.name):<{width}}  step {step:>7}  {e.layout:<7} {size:>10}  {status}")
    if result.hidden:
        out.append(f"  ({result.hidden} hidden entries: writers' temporaries and commit objects, never picked)")
    if result.error is not None:
        out.append(shown(result.error))
    elif result.latest is not None:
        out.append(f"distfn.latest -> {shown(result.latest)}: ctx.resume(state, '{shown(result.directory)}') "
                   "continues from it")
    else:
        out.append(f"distfn.latest -> None: ctx.resume(state, '{shown(result.directory)}') starts from step 0")
    return "\n".join(out)


def run(command: str, target: str, *, prefix: str = "ckpt-", as_json: bool = False,
        every_tensor: bool = False) -> int:
    """``distfn inspect`` / ``distfn ls``: print the report and return the exit status: 1 with a one-line error on
    stderr when the target is missing, not a checkpoint or damaged, or (``ls``) when `distfn.latest` itself fails
    on the directory; else 0."""
    status = 0
    try:
        if command == "inspect":
            info = describe(target)
            text = json.dumps(info.as_dict(), indent=2) if as_json else render_info(info, every_tensor=every_tensor)
        else:
            found = listing(target, prefix)
            text = json.dumps(found.as_dict(), indent=2) if as_json else render_listing(found)
            status = 1 if found.error else 0  # a resume from this directory would fail
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"distfn {command}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except RecursionError:  # a header's JSON nested past Python's limit
        print(f"distfn {command}: '{shown(target)}' is damaged: {_TOO_DEEP}", file=sys.stderr)
        return 1
    except Exception as exc:  # a file built to break a reader in a way no check above foresaw: still one line
        if os.environ.get("DISTFN_DEBUG") == "1":
            raise
        print(f"distfn {command}: cannot read '{shown(target)}': {type(exc).__name__}: {_one_line(exc)} (damaged? "
              "DISTFN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    try:
        print(text, flush=True)  # every value read from the file or the command line is escaped (`shown`)
    except BrokenPipeError:  # `distfn inspect CKPT | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line, unprintable characters escaped (a conversion hint keeps its command,
    joined with '; ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines) or type(exc).__name__
    return text if text.isprintable() else text.encode("unicode_escape", "backslashreplace").decode("ascii")
