"""Bytes of one safetensors file: the atomic, durable writer and the memory-mapped reader, on any `fs.FileSystem`.

`write` streams a `format.Plan` into a temporary file next to the target (`tmp_name`), makes it durable and
publishes it under the target's name (`fs.FileSystem.commit`: ``fsync``, rename, directory ``fsync`` on a local
disk), so a crash at any moment leaves the old complete file or the new complete one. Temporary names are
``.<target>.<host>.<pid>.<random>.distfn-tmp``; `remove_stale_tmps` removes those a killed writer left. `Reader`
serves a file's tensors as copy-on-write views of one memory map (ranged reads where the backend has no map).
Pickle files are refused (`read_header`) with a one-line conversion.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import pathlib
import re
import secrets
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Final

import torch
from loguru import logger

from ..errors import CheckpointError
from . import format as fmt
from . import fs
from .layout import Location, resolve
from .names import INDEX, PICKLE_SUFFIXES

__all__ = [
    "TMP_MARK",
    "Reader",
    "Staging",
    "dead_leftovers",
    "make_parents",
    "memory_of",
    "open_reader",
    "read_header",
    "remove_stale_tmps",
    "tmp_name",
    "write",
    "write_bytes",
    "write_image",
]

TMP_MARK: Final = ".distfn-tmp"
_WRITE_CHUNK: Final = 64 << 20  # bytes per GPU->host copy
_SMALL_WRITE: Final = 4 << 20  # pieces smaller than this are gathered into one write


# --------------------------------------------------------------------------------------------------
# Writing


def memory_of(flat: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's own memory, without NumPy (not a dependency of distfn).

    The view holds a reference to the tensor (on the ctypes array behind it), so memory made for it (the
    contiguous copy of a strided tensor) lives exactly as long as the view.
    """
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    array._distfn_owner = flat  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def _cpu_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order, as a memoryview over the tensor's own memory when contiguous."""
    return memory_of(tensor.resolve_conj().resolve_neg().contiguous().reshape(-1))


class Staging:
    """One reusable host buffer (pinned where CUDA is used) for device->host copies in bounded chunks.

    Args:
        chunk_bytes: the buffer's size, the most bytes one copy moves (64 MiB by default).
    """

    def __init__(self, chunk_bytes: int = _WRITE_CHUNK) -> None:
        self._buffer: torch.Tensor | None = None
        self._chunk = chunk_bytes

    def chunks(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of ``tensor`` (any device), as successive views of the one buffer (at most 64 MiB)."""
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        size = flat.numel()
        want = min(size, self._chunk)
        if self._buffer is None or self._buffer.numel() < want:
            self._buffer = torch.empty(want, dtype=torch.uint8, pin_memory=tensor.device.type == "cuda")
        step = self._buffer.numel()
        for start in range(0, size, step):
            n = min(step, size - start)
            part = self._buffer[:n]
            part.copy_(flat[start : start + n])  # synchronous: the buffer is reused right after the write
            yield memory_of(part)


class _Sink:
    """Writes to a `fs.WriteStream`: large pieces straight from their memory, small ones gathered first.

    Models hold many tiny tensors (biases, norms); one system call (or one upload part) each would dominate their
    cost.
    """

    def __init__(self, stream: fs.WriteStream) -> None:
        self._stream = stream
        self._small = bytearray()

    def write(self, data: memoryview) -> None:
        if len(data) < _SMALL_WRITE:
            self._small += data
            if len(self._small) >= _SMALL_WRITE:
                self.flush()
            return
        self.flush()
        self._stream.write(data)

    def flush(self) -> None:
        if self._small:
            self._stream.write(memoryview(self._small))
            self._small = bytearray()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def tmp_name(target: Location, mark: str = TMP_MARK) -> Location:
    """A fresh temporary location next to ``target`` for this process: ``.<name>.<host>.<pid>.<random><mark>``
    (``mark``: ``.distfn-tmp`` for files; sharded saves use their own for directories).

    The host and pid let a later save recognise (and remove) what a killed writer left; the random part keeps two
    concurrent writers of the same target apart. The name is cut to fit NAME_MAX.
    """
    return target.sibling(f".{target.name[:120]}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{mark}")


#: A leftover whose pid runs is removed all the same once nothing in it changed for this long (a writer writes
#: without pause, so its file's time moves): that pid is no longer its writer's.
STALE_AFTER_S: Final = 3600.0
#: The mark of a sharded save's hidden directory (`distfn.checkpoint.sharded.spec.PARTIAL`, which imports this
#: module's package): a file save removes those a killed sharded save left too, and the reverse.
_PARTIAL_MARK: Final = ".distfn-partial"


def dead_leftovers(directory: Location, mark: str = TMP_MARK) -> list[tuple[str, int]]:
    """``(name, pid)`` of the `tmp_name` s with ``mark`` in ``directory`` whose writer on this host no longer runs.

    Every target name counts (``ckpt-7.safetensors``'s leftovers are found by the save of ``ckpt-8``); never a live
    writer's, never another host's (its pid means nothing here). The writer no longer runs when its pid does not,
    is a zombie, or (a local file system, where a leftover's modification time is known) belongs to a process
    started after the leftover last changed (the pid was reused: a container's pids start again at 1), or when
    the leftover has not changed for `STALE_AFTER_S`.
    """
    pattern = re.compile(r"^\..+\." + re.escape(_host()) + r"\.(\d+)\.[0-9a-f]{8}" + re.escape(mark) + "$")
    names = directory.fs.listdir(directory.path)
    found = [(name, int(m.group(1))) for name in names if (m := pattern.match(name)) is not None]
    return [(name, pid) for name, pid in found if pid != os.getpid() and _writer_gone(directory, name, pid)]


def remove_stale_tmps(directory: Location) -> None:
    """Remove what writers on this host which no longer run left in ``directory`` (`dead_leftovers`): the
    temporary files of file saves and the hidden directories of sharded saves."""
    for name, pid in dead_leftovers(directory):
        directory.fs.remove(directory.path / name)
        logger.debug("removed {} left by a killed writer (pid {})", name, pid)
    for name, pid in dead_leftovers(directory, _PARTIAL_MARK):
        directory.fs.remove_tree(directory.path / name)
        logger.debug("removed {} left by a killed sharded save (pid {})", name, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive but not ours (EPERM)
        return True
    return _proc_stat(pid)[0] not in ("Z", "X")  # a zombie writes nothing: killed, not reaped yet


def _proc_stat(pid: int) -> tuple[str, float | None]:
    """``(state, start time as a Unix time)`` of ``pid`` from ``/proc`` (Linux); ``("?", None)`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": comm may hold spaces and ")"
        with open("/proc/stat", "rb") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return "?", None


def _writer_gone(directory: Location, name: str, pid: int) -> bool:
    """Whether the leftover ``name`` (its pid ``pid``) has no live writer (see `dead_leftovers`)."""
    if not _alive(pid):
        return True
    if not isinstance(directory.fs, fs.LocalFileSystem):
        return False  # no modification time to compare: only a pid that does not run tells
    path = os.path.join(directory.path, name)
    try:
        changed = os.stat(path).st_mtime
        if os.path.isdir(path):  # a sharded save's directory: its files change, not the directory itself
            with os.scandir(path) as entries:
                changed = max([changed, *(e.stat(follow_symlinks=False).st_mtime for e in entries)])
    except OSError:
        return False  # gone already, or unreadable: leave it
    if time.time() - changed > STALE_AFTER_S:
        return True
    started = _proc_stat(pid)[1]
    return started is not None and started > changed + 2.0  # 2 s: /proc's boot time is whole seconds


def make_parents(target: Location) -> list[pathlib.PurePath]:
    """Create the directory that will hold ``target`` and its missing parents; return those created, deepest
    first (`remove_dirs` undoes them when the save fails).

    Raises:
        CheckpointError: a parent is a file (``'afile' is a file, not a directory``), or cannot be created.
    """
    store, directory = target.fs, target.path.parent
    if not store.directories:  # an object store: nothing to create (each level looked up would cost a request)
        return []
    missing = []
    d = directory
    while (kind := store.kind(d)) != "dir" and d != d.parent:
        if kind != "missing":
            raise CheckpointError(f"cannot save '{target}': '{d}' is a file, not a directory")
        missing.append(d)
        d = d.parent
    if not missing:
        return []
    try:
        store.make_dirs(directory)
    except OSError as exc:
        remove_dirs(target.fs, missing)
        raise CheckpointError(f"cannot create the directory '{directory}' for the checkpoint: {exc}") from exc
    return missing


def remove_dirs(store: fs.FileSystem, created: list[pathlib.PurePath]) -> None:
    """Remove the directories `make_parents` created, deepest first, while empty (another writer may have
    started using them)."""
    for d in created:
        if not store.remove_dir(d):
            return


def write(plan: fmt.Plan, target: Location, *, fetch: Callable[[fmt.Entry], torch.Tensor] | None = None,
          direct: bool = False) -> None:
    """Write ``plan`` to ``target`` atomically and durably (temporary file, durable write, commit).

    ``fetch``, when given, produces each entry's tensor just before it is written (the entries then hold
    stand-ins, e.g. meta tensors): `distfn.checkpoint.sharded.read.consolidate` assembles one full tensor at a
    time this way, so host memory stays near the largest tensor. ``direct``: the plan's buffers are laid out like
    the file from a page boundary (`write_image`), so large pieces may go to the disk around the page cache
    (`fs.WriteStream.prefer_direct`).

    Missing parent directories are created (and removed again if the save fails). Temporary files that killed
    writers left in the directory are removed first. A symlink at ``target`` is replaced by the new file (like
    ``mv``); the file it pointed to is left as it was.

    Raises:
        CheckpointError: an I/O failure; the previous file at ``target``, if any, is then intact.
    """
    store = target.fs
    created = make_parents(target)
    remove_stale_tmps(target.parent)
    tmp = tmp_name(target)
    try:
        stream = store.create(tmp.path, final=target.path)
    except OSError as exc:
        remove_dirs(store, created)
        raise CheckpointError(f"cannot create a temporary file next to '{target}': {exc}") from exc
    if direct:
        stream.prefer_direct()
    try:
        try:
            _write_plan(stream, plan, fetch)
        except BaseException:
            stream.abort()
            raise
        stream.close()
        store.publish(stream, tmp.path, target.path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # cleaning up must not hide why the write failed (a server gone)
            store.remove(tmp.path)
        remove_dirs(store, created)
        if isinstance(exc, OSError):
            raise CheckpointError(f"writing '{target}' failed ({exc}); the previous file, if any, is intact") from exc
        raise


def write_bytes(data: bytes, target: Location) -> None:
    """Write the small file ``data`` (a sharded checkpoint's index) to ``target`` exactly as `write` does."""
    write(fmt.Plan(data, (), len(data)), target)


def write_image(image: memoryview, target: Location) -> None:
    """Write ``image``, a whole file's bytes in one buffer starting at a page boundary (an asynchronous save's
    staged copy: `distfn.checkpoint.background.Saves.stage_file`), to ``target`` exactly as `write` does, in a
    few large writes; on a local disk the aligned bulk goes around the page cache (``O_DIRECT``), so the write
    costs the CPU almost nothing."""
    write(fmt.Plan(image, (), len(image)), target, direct=True)  # type: ignore[arg-type]  # Plan.header: bytes


def _write_plan(stream: fs.WriteStream, plan: fmt.Plan, fetch: Callable[[fmt.Entry], torch.Tensor] | None) -> None:
    stream.reserve(plan.total)
    if not plan.entries:  # one buffer (an index, a staged image): nothing to gather, one write as it is
        stream.write(memoryview(plan.header))
        return
    sink = _Sink(stream)
    sink.write(memoryview(plan.header))
    staging = Staging()
    for entry in plan.entries:
        if entry.nbytes == 0:
            continue
        tensor = entry.tensor if fetch is None else fetch(entry)
        if tensor.device.type == "cpu":
            sink.write(_cpu_bytes(tensor))
        else:
            for chunk in staging.chunks(tensor):
                sink.write(chunk)
        del tensor  # a fetched tensor is freed before the next one is assembled
    sink.flush()


# --------------------------------------------------------------------------------------------------
# Reading


def _refuse_pickle(path: pathlib.PurePath, why: str) -> CheckpointError:
    out = path.with_suffix(".safetensors")
    return CheckpointError(
        f"'{path}' is not a safetensors file ({why}); it looks like a pickle-based torch.save file. distfn only "
        "loads safetensors because unpickling a file can execute arbitrary code. If you trust this file, "
        "convert it once with:\n"
        f"    python -c \"import torch; from distfn import checkpoint; checkpoint.save(torch.load('{path}', "
        f"map_location='cpu', weights_only=True), '{out}')\""
    )


def _open(loc: Location) -> fs.ReadHandle:
    """``loc`` open for reading, with the file-system errors users meet as `CheckpointError`."""
    try:
        return loc.fs.open(loc.path)  # the caller closes it
    except FileNotFoundError as exc:
        # an object store says why (an object without its commit object); a local disk's text adds nothing
        why = f": {exc}" if str(exc).startswith(str(loc)) else ""
        raise CheckpointError(f"no checkpoint at '{loc}'{why}") from None
    except IsADirectoryError:
        raise CheckpointError(f"'{loc}' is a directory without {INDEX}: not a checkpoint; pass a "
                              ".safetensors file or a sharded checkpoint directory (see distfn.latest)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open '{loc}': {exc}") from None


def _looks_like_pickle(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def _is_json(raw: bytes) -> bool:
    try:
        fmt.strict_json(raw)  # bounded: a header nested 100,000 deep is "not JSON", never a RecursionError
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def read_header(path: str | os.PathLike[str] | Location, opened: fs.ReadHandle | None = None) -> fmt.Header:
    """Read and check the header of ``path`` (through ``opened`` when given).

    Raises:
        CheckpointError: a missing file, a directory, a pickle file (with the conversion), a truncated or
            corrupt file.
    """
    loc = resolve(path)
    with contextlib.ExitStack() as stack:
        f = opened
        if f is None:
            f = _open(loc)
            stack.callback(f.close)
        size = f.size
        head = f.read(0, 9)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if not (2 <= n <= fmt.MAX_HEADER and 8 + n <= size and head[8:9] == b"{"):
            if _looks_like_pickle(head):
                raise _refuse_pickle(loc.path, "it starts with a zip/pickle signature")
            if loc.path.suffix.lower() in PICKLE_SUFFIXES:
                raise _refuse_pickle(loc.path, "its first bytes are not a safetensors header")
            raise CheckpointError(f"'{loc}' is not a complete safetensors file ({size} bytes, header length "
                                  f"{n}); it may be truncated or of another format")
        raw = f.read(8, n)
    if loc.path.suffix.lower() in PICKLE_SUFFIXES and not _is_json(raw):
        raise _refuse_pickle(loc.path, "its header is not JSON")
    return fmt.parse_header(loc.path, raw, size)


class Reader:
    """Serves the tensors of one open file.

    CPU tensors are views of one private (copy-on-write) memory map of the file, as ``safetensors.load_file``
    does: nothing is read until used, no byte is copied twice, writing to a tensor never changes the file, and
    a later save, which replaces the file by rename, never changes a loaded tensor. Tensors whose offset is not
    aligned to their element size (possible in files of other tools), and every tensor of a backend without
    memory maps, are read into fresh memory instead.
    """

    def __init__(self, path: str | os.PathLike[str] | Location, device: torch.device) -> None:
        self.device = device
        self._file = _open(resolve(path))
        try:
            self.header = read_header(path, self._file)  # the same open file as the mapping: no race
            self._map = self._file.map()
        except BaseException:
            self._file.close()
            raise
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    def close(self) -> None:
        """Close the file; the mapping lives on with the tensors that use it."""
        self._file.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        """The stored tensor names, in header order."""
        return list(self.header.tensors)

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """The stored tensor ``name`` on ``device`` (default: the reader's), read once per device."""
        device = self.device if device is None else device
        cached = self._cache.get((name, device))
        if cached is not None:
            return cached
        span = self.header.spans.get(name)
        if span is None:
            raise CheckpointError(f"'{self.header.path}' has no tensor '{name}' (corrupt metadata?)")
        out = self._read(name, span)
        if device.type != "cpu":
            out = out.to(device)
        self._cache[(name, device)] = out
        return out

    def _read(self, name: str, span: fmt.Span) -> torch.Tensor:
        # The span was checked by `format.parse_header` (known dtype, shape, byte count, inside the file): nothing
        # to parse or check again per tensor.
        dtype, shape, begin, end = span
        itemsize = dtype.itemsize
        numel = (end - begin) // itemsize
        start = self.header.data_start + begin
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if self._map is not None and start % itemsize == 0:
            # Its own storage (offset 0, exactly its bytes) over the shared mapping, which it keeps alive. A 1-d
            # tensor is frombuffer's shape already: view() would cost as much again as building it.
            out = torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start)
            return out if len(shape) == 1 else out.view(shape)
        out = torch.empty(shape, dtype=dtype)
        if self._map is not None:
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=start)
        else:
            data = self._file.read(start, end - begin)
            if len(data) != end - begin:
                raise CheckpointError(f"'{self.header.path}' is truncated at tensor '{name}'")
            raw = _read_only_view(data)
        out.reshape(-1).view(torch.uint8).copy_(raw)
        return out

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along the first dimension) of the stored tensor ``name``, on the CPU, reading only
        their bytes: a view of the memory map, or one ranged read of a remote object (a resharding load reads
        only the rows of its slice). Not cached."""
        span = self.header.spans.get(name)
        if span is None:
            raise CheckpointError(f"'{self.header.path}' has no tensor '{name}' (corrupt metadata?)")
        dtype, shape, offset, _ = span
        if not shape:
            return self._read(name, span)
        itemsize = dtype.itemsize
        row = math.prod(shape[1:]) * itemsize
        begin = self.header.data_start + offset + start * row
        count, out_shape = (stop - start) * row, [stop - start, *shape[1:]]
        if count == 0:
            return torch.empty(out_shape, dtype=dtype)
        if self._map is not None and begin % itemsize == 0:
            return torch.frombuffer(self._map, dtype=dtype, count=count // itemsize, offset=begin).view(out_shape)
        data = self._file.read(begin, count) if self._map is None else bytes(self._map[begin:begin + count])
        if len(data) != count:
            raise CheckpointError(f"'{self.header.path}' is truncated at tensor '{name}'")
        return torch.frombuffer(bytearray(data), dtype=dtype).view(out_shape)


def _read_only_view(data: bytes) -> torch.Tensor:
    """A uint8 tensor over ``data`` without a copy (a remote read's bytes, only copied into a fresh tensor next:
    copying them into a bytearray first would cost one more pass over every byte loaded)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def open_reader(path: str | os.PathLike[str] | Location, device: str | torch.device) -> Reader:
    """A `Reader` of ``path`` (resolved by `distfn.checkpoint.layout.resolve`) serving tensors on ``device``."""
    return Reader(resolve(path), torch.device(device))
