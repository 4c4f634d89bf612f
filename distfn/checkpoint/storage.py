"""Bytes on disk: the atomic, durable writer and the memory-mapped reader.

`write` puts a `format.Plan` into a temporary file next to the target, ``fsync``s it, renames it over the
target and ``fsync``s the directory, so a crash at any moment leaves the old complete file or the new complete
one. Temporary files are named ``.<target>.<host>.<pid>.<random>.distfn-tmp``; `remove_stale_tmps` removes those
a killed writer left. `Reader` serves a file's tensors as copy-on-write views of one memory map. Pickle files
are refused (`read_header`) with a one-line conversion.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import pathlib
import re
import secrets
import socket
from collections.abc import Iterator
from typing import IO, Any, Final

import torch
from loguru import logger

from ..errors import CheckpointError
from . import format as fmt

__all__ = [
    "TMP_MARK",
    "Reader",
    "Staging",
    "local_path",
    "open_reader",
    "read_header",
    "remove_stale_tmps",
    "tmp_name",
    "write",
    "write_all",
]

TMP_MARK: Final = ".distfn-tmp"
_WRITE_CHUNK: Final = 64 << 20  # bytes per os.write / per GPU->host copy
_SMALL_WRITE: Final = 4 << 20  # pieces smaller than this are gathered into one write
_KICK_BYTES = 32 << 20  # start writeback every this many bytes (0: leave it all to the final fsync)
_FALLOCATE = True  # reserve the file's blocks before writing
_PICKLE_SUFFIXES: Final = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


_URL: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(path: str | os.PathLike[str]) -> pathlib.Path:
    """``path`` as a local path (``~`` expanded); a URL (``s3://``, ``gs://``, ``http://``, any ``scheme://``) is
    a `CheckpointError`, never a local directory named ``s3:``.
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if _URL.match(text):
        raise CheckpointError(
            f"'{text}' is a URL; distfn reads and writes checkpoints on a local or mounted file system only. Save "
            "to a local path (or a mounted bucket) and copy it with your storage tool."
        )
    return pathlib.Path(text).expanduser()


# --------------------------------------------------------------------------------------------------
# Writing


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (in pieces of at most 64 MiB)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    total = len(view)
    done = 0
    while done < total:
        done += os.write(fd, view[done : done + _WRITE_CHUNK])


def _memory(flat: torch.Tensor) -> memoryview:
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
    return _memory(tensor.resolve_conj().resolve_neg().contiguous().reshape(-1))


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
            yield _memory(part)


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the final fsync does all the work
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE: Final = 2


class _Sink:
    """Writes to a file descriptor: large pieces straight from their memory, small ones gathered first.

    Models hold many tiny tensors (biases, norms); one system call each would dominate their cost. Every
    ``kick_bytes`` written, writeback of that range is started (Linux ``sync_file_range(WRITE)``, which does not
    wait), so the disk works while the next tensors are copied and the final ``fsync`` has little left to do;
    dd and save_file instead leave everything to the final sync. ``kick_bytes=0`` turns it off.
    """

    def __init__(self, fd: int, kick_bytes: int) -> None:
        self.fd = fd
        self._small = bytearray()
        self._kick = kick_bytes if _SYNC_FILE_RANGE is not None else 0
        self._offset = 0
        self._kicked = 0

    def write(self, data: memoryview) -> None:
        if len(data) < _SMALL_WRITE:
            self._small += data
            if len(self._small) >= _SMALL_WRITE:
                self.flush()
            return
        self.flush()
        step = self._kick or len(data)
        for start in range(0, len(data), step):
            self._write(data[start : start + step])

    def flush(self) -> None:
        if self._small:
            self._write(memoryview(self._small))
            self._small = bytearray()

    def _write(self, data: memoryview) -> None:
        write_all(self.fd, data)
        self._offset += len(data)
        if self._kick and self._offset - self._kicked >= self._kick:
            assert _SYNC_FILE_RANGE is not None
            _SYNC_FILE_RANGE(self.fd, self._kicked, self._offset - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._offset  # a failed kick (an odd file system) is harmless: fsync still follows


def fsync_dir(directory: pathlib.Path) -> None:
    """``fsync`` a directory, so that renames in it are durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. platforms that cannot open directories; the rename itself already happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def tmp_name(target: pathlib.Path, mark: str = TMP_MARK) -> pathlib.Path:
    """A fresh temporary path next to ``target`` for this process: ``.<name>.<host>.<pid>.<random><mark>``
    (``mark``: ``.distfn-tmp`` for files; sharded saves use their own for directories).

    The host and pid let a later save recognise (and remove) what a killed writer left; the random part keeps two
    concurrent writers of the same target apart. The name is cut to fit NAME_MAX.
    """
    return target.with_name(f".{target.name[:120]}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{mark}")


def dead_leftovers(directory: pathlib.Path, mark: str = TMP_MARK) -> list[tuple[str, int]]:
    """``(name, pid)`` of the `tmp_name` s with ``mark`` in ``directory`` whose writer on this host no longer runs.

    Every target name counts (``ckpt-7.safetensors``'s leftovers are found by the save of ``ckpt-8``); never a live
    writer's, never another host's (its pid means nothing here).
    """
    pattern = re.compile(r"^\..+\." + re.escape(_host()) + r"\.(\d+)\.[0-9a-f]{8}" + re.escape(mark) + "$")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(name, int(m.group(1))) for name in names if (m := pattern.match(name)) is not None]
    return [(name, pid) for name, pid in found if pid != os.getpid() and not _alive(pid)]


def remove_stale_tmps(directory: pathlib.Path) -> None:
    """Remove the temporary files that writers on this host which no longer run left in ``directory``
    (`dead_leftovers`)."""
    for name, pid in dead_leftovers(directory):
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
            logger.debug("removed {} left by a killed writer (pid {})", name, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive but not ours (EPERM)
        return True
    return True


def _make_parents(directory: pathlib.Path) -> list[pathlib.Path]:
    """Create ``directory`` and missing parents; return those created, deepest first (to undo on failure)."""
    missing = []
    d = directory
    while not d.is_dir() and d != d.parent:
        missing.append(d)
        d = d.parent
    if not missing:
        return []
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_dirs(missing)
        raise CheckpointError(f"cannot create the directory '{directory}' for the checkpoint: {exc}") from exc
    fsync_dir(d)
    return missing


def _remove_dirs(created: list[pathlib.Path]) -> None:
    for d in created:  # deepest first; only while empty (another writer may have started using them)
        try:
            d.rmdir()
        except OSError:
            return


def write(plan: fmt.Plan, target: pathlib.Path) -> None:
    """Write ``plan`` to ``target`` atomically and durably (temporary file, fsync, rename, directory fsync).

    Missing parent directories are created (and removed again if the save fails). Temporary files that killed
    writers left in the directory are removed first. A symlink at ``target`` is replaced by the new file (like
    ``mv``); the file it pointed to is left as it was.

    Raises:
        CheckpointError: an I/O failure; the previous file at ``target``, if any, is then intact.
    """
    parent = target.parent
    created = _make_parents(parent)
    remove_stale_tmps(parent)
    tmp = tmp_name(target)
    try:
        # 0o666 & ~umask, exactly like open(..., "w"); mkstemp / NamedTemporaryFile would force 0o600.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        _remove_dirs(created)
        raise CheckpointError(f"cannot create a temporary file next to '{target}': {exc}") from exc
    try:
        try:
            _write_plan(fd, plan)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _remove_dirs(created)
        if isinstance(exc, OSError):
            raise CheckpointError(f"writing '{target}' failed ({exc}); the previous file, if any, is intact") from exc
        raise
    fsync_dir(parent)


def _write_plan(fd: int, plan: fmt.Plan) -> None:
    if _FALLOCATE and plan.total >= (64 << 20) and hasattr(os, "posix_fallocate"):
        # Reserve the space up front: one extent allocation instead of many, and ENOSPC before any data.
        try:
            os.posix_fallocate(fd, 0, plan.total)
        except OSError as exc:
            if exc.errno == 28:  # ENOSPC
                raise
    sink = _Sink(fd, _KICK_BYTES)
    sink.write(memoryview(plan.header))
    staging = Staging()
    for entry in plan.entries:
        if entry.nbytes == 0:
            continue
        if entry.tensor.device.type == "cpu":
            sink.write(_cpu_bytes(entry.tensor))
        else:
            for chunk in staging.chunks(entry.tensor):
                sink.write(chunk)
    sink.flush()


# --------------------------------------------------------------------------------------------------
# Reading


def _refuse_pickle(path: pathlib.Path, why: str) -> CheckpointError:
    out = path.with_suffix(".safetensors")
    return CheckpointError(
        f"'{path}' is not a safetensors file ({why}); it looks like a pickle-based torch.save file. distfn only "
        "loads safetensors because unpickling a file can execute arbitrary code. If you trust this file, "
        "convert it once with:\n"
        f"    python -c \"import torch; from distfn import checkpoint; checkpoint.save(torch.load('{path}', "
        f"map_location='cpu', weights_only=True), '{out}')\""
    )


def _open(path: pathlib.Path) -> IO[bytes]:
    """``open(path, "rb", buffering=0)``, with the file-system errors users meet as `CheckpointError`."""
    try:
        return open(path, "rb", buffering=0)  # the caller closes it
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at '{path}'") from None
    except IsADirectoryError:
        raise CheckpointError(f"'{path}' is a directory; pass a .safetensors file (see distfn.latest)") from None


def _looks_like_pickle(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def read_header(path: pathlib.Path, opened: IO[bytes] | None = None) -> fmt.Header:
    """Read and check the header of ``path`` (through ``opened``, a binary file, when given).

    Raises:
        CheckpointError: a missing file, a directory, a pickle file (with the conversion), a truncated or
            corrupt file.
    """
    with contextlib.ExitStack() as stack:
        f = opened if opened is not None else stack.enter_context(_open(path))
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = f.read(9)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if not (2 <= n <= fmt.MAX_HEADER and 8 + n <= size and head[8:9] == b"{"):
            if _looks_like_pickle(head):
                raise _refuse_pickle(path, "it starts with a zip/pickle signature")
            if path.suffix.lower() in _PICKLE_SUFFIXES:
                raise _refuse_pickle(path, "its first bytes are not a safetensors header")
            raise CheckpointError(f"'{path}' is not a complete safetensors file ({size} bytes, header length "
                                  f"{n}); it may be truncated or of another format")
        f.seek(8)
        raw = f.read(n)
    if path.suffix.lower() in _PICKLE_SUFFIXES and not _is_json(raw):
        raise _refuse_pickle(path, "its header is not JSON")
    return fmt.parse_header(path, raw, size)


class Reader:
    """Serves the tensors of one open file.

    CPU tensors are views of one private (copy-on-write) memory map of the file, as ``safetensors.load_file``
    does: nothing is read until used, no byte is copied twice, writing to a tensor never changes the file, and
    a later save, which replaces the file by rename, never changes a loaded tensor. Tensors whose offset is not
    aligned to their element size (possible in files of other tools) are read into fresh memory instead.
    """

    def __init__(self, path: pathlib.Path, device: torch.device) -> None:
        self.device = device
        self._file = _open(path)
        try:
            self.header = read_header(path, self._file)  # the same open file as the mapping: no race
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self._file.close()
            raise
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

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
        cached = self._cache.get((name, str(device)))
        if cached is not None:
            return cached
        try:
            info = self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"'{self.header.path}' has no tensor '{name}' (corrupt metadata?)") from None
        out = self._read(name, info)
        if device.type != "cpu":
            out = out.to(device)
        self._cache[(name, str(device))] = out
        return out

    def _read(self, name: str, info: dict[str, Any]) -> torch.Tensor:
        dtype = fmt.FROM_CODE[info["dtype"]]
        shape = [int(s) for s in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = math.prod(shape)
        if end - begin != numel * itemsize:
            raise CheckpointError(f"'{self.header.path}': tensor '{name}' has {end - begin} bytes for shape "
                                  f"{shape} of {dtype}")
        start = self.header.data_start + begin
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if start % itemsize == 0:
            # Its own storage (offset 0, exactly its bytes) over the shared mapping, which it keeps alive.
            return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start).view(shape)
        out = torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=start)
        out.reshape(-1).view(torch.uint8).copy_(raw)
        return out


def open_reader(path: str | os.PathLike[str], device: str | torch.device) -> Reader:
    """A `Reader` of ``path`` (``~`` expanded) serving tensors on ``device``."""
    return Reader(local_path(path), torch.device(device))
