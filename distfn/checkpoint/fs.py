"""The storage seam: every byte distfn's checkpoints write, rename, list, remove or read goes through a `FileSystem`.

The interface is what a checkpoint needs and nothing more (the shape of torch DCP's ``FileSystemBase`` and
Fabric's ``CheckpointIO``): open a new file for a streaming write, publish a written file or directory under its
final name (`FileSystem.commit`: an atomic rename on a local disk; an object store, which has no rename, writes a
small commit object last instead), list, remove, ask what a path is and how large, and read, by memory map where
the backend has one and by ranged reads otherwise. `LocalFileSystem` is the first implementation; a remote backend
(fsspec) is a second one, and everything above this module (the writer, the readers, ``keep=``, `latest`) works
on it unchanged: `distfn.checkpoint.remote` is that second one (any fsspec URL, with commit objects).

Paths are `pathlib.PurePath` s naming places *in* the file system; turning a user's string into one (``~``, URLs)
is `distfn.checkpoint.layout`'s job.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import mmap
import os
import pathlib
import shutil
import stat
from typing import Any, Final, Literal

__all__ = ["LOCAL", "FileSystem", "Kind", "LocalFileSystem", "ReadHandle", "WriteStream"]

#: What a path names: a regular file, a directory, nothing, or something else (a socket, a device).
Kind = Literal["file", "dir", "missing", "other"]

_WRITE_CHUNK: Final = 64 << 20  # bytes per os.write
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)  # Linux (and a few others); 0: never direct
#: Direct I/O needs the memory address, the file offset and the length aligned to the disk's logical block; the
#: page size is a multiple of every common one (512, 4096).
DIRECT_ALIGN: Final = mmap.PAGESIZE
DIRECT_MIN: Final = 1 << 20  # smaller pieces go through the page cache: too small for the copy to matter


class WriteStream(abc.ABC):
    """A new file being written front to back; invisible under its final name until `FileSystem.commit`."""

    @abc.abstractmethod
    def reserve(self, nbytes: int) -> None:
        """Say how large the file will be (a local disk allocates the blocks now: no ENOSPC half way)."""

    @abc.abstractmethod
    def write(self, data: memoryview) -> None:
        """Append every byte of ``data``."""

    def prefer_direct(self) -> None:
        """Write large page-aligned pieces around the page cache where the backend can (a local disk's
        ``O_DIRECT``): the caller hands buffers laid out like the file (an asynchronous save's staged image), so
        the kernel need not copy them again. A hint: nothing changes in what is written, or where nothing can."""
        return  # a backend without direct I/O: every write goes its usual way

    @abc.abstractmethod
    def close(self) -> None:
        """Make the written bytes durable (``fsync``) and close; raises ``OSError`` when they are not."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close without making anything durable (the caller removes the file)."""


class ReadHandle(abc.ABC):
    """An open file for reading: its size, ranged reads, and a memory map where the backend has one."""

    size: int

    @abc.abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` bytes from ``offset`` (fewer only at the end of the file)."""

    @abc.abstractmethod
    def map(self) -> Any:
        """A private, copy-on-write buffer over the whole file (for zero-copy tensors), or ``None`` when the
        backend can only serve ranged reads (the reader then copies each tensor into fresh memory)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the handle; a map handed out stays valid."""


class FileSystem(abc.ABC):
    """The operations checkpoints need from a storage backend (see the module docstring)."""

    #: Whether directories exist on their own and must be created before a file goes in them (an object store
    #: has none: a prefix exists once an object has it, so a writer creates nothing and checks nothing first).
    directories: bool = True
    #: Whether each process sees its own copy (``memory://``): a multi-process job cannot share checkpoints on it.
    per_process: bool = False

    @abc.abstractmethod
    def kind(self, path: pathlib.PurePath) -> Kind:
        """What ``path`` names, following symlinks."""

    @abc.abstractmethod
    def is_link(self, path: pathlib.PurePath) -> bool:
        """Whether ``path`` itself is a symlink (replaced, never followed, by a save)."""

    @abc.abstractmethod
    def inside(self, path: pathlib.PurePath, directory: pathlib.PurePath) -> bool:
        """Whether ``path``, with every symlink resolved, is still inside ``directory`` (resolved too)."""

    def check_root(self, path: pathlib.PurePath) -> None:
        """Raise ``FileNotFoundError`` naming the cause when the store that would hold ``path`` does not exist (an
        object store's bucket); nothing on a local disk, where a missing directory is just missing."""
        del path  # nothing to check here

    @abc.abstractmethod
    def size(self, path: pathlib.PurePath) -> int:
        """The size of the file at ``path`` in bytes."""

    @abc.abstractmethod
    def listdir(self, directory: pathlib.PurePath) -> list[str]:
        """The names in ``directory`` (``[]`` when it cannot be listed)."""

    @abc.abstractmethod
    def make_dirs(self, directory: pathlib.PurePath) -> None:
        """Create ``directory`` and its missing parents (durably)."""

    @abc.abstractmethod
    def make_dir(self, directory: pathlib.PurePath) -> None:
        """Create the one new directory ``directory`` (its parent exists); ``OSError`` if it exists already."""

    @abc.abstractmethod
    def create(self, path: pathlib.PurePath, final: pathlib.PurePath | None = None) -> WriteStream:
        """A new file at ``path`` (which must not exist), open for a streaming write.

        ``final`` is the name `publish` will give it. A local disk writes ``path`` and renames it; an object store,
        which cannot rename, uploads straight to ``final`` (invisible until published) and keeps ``path`` as a
        small lease that lets a later save clean up after a killed writer.
        """

    def publish(self, stream: WriteStream, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        """Publish the file ``stream`` (closed) wrote at ``written`` (`create`'s ``path``) as ``target``: `commit`
        here; an object store completes the upload and writes its commit object instead."""
        self.commit(written, target)

    def stage_dir(self, tmp: pathlib.PurePath, target: pathlib.PurePath) -> pathlib.PurePath:
        """Create the place where a new directory that `commit` will publish as ``target`` is written, and return
        it: the new directory ``tmp`` here; an object store writes ``target`` itself (``tmp`` is then its lease)."""
        self.make_dir(tmp)
        return tmp

    @abc.abstractmethod
    def commit(self, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        """Publish the complete file or directory ``written`` as ``target``, atomically and durably: a reader sees
        the previous ``target`` or the new one, never a mix. A file at ``target`` is replaced; a directory at
        ``target`` must have been moved away first."""

    @abc.abstractmethod
    def rename(self, path: pathlib.PurePath, new: pathlib.PurePath) -> None:
        """Move ``path`` to the free name ``new`` (an older checkpoint moved aside before its replacement is
        committed; not atomic on object stores, which is why a checkpoint's visibility hangs on `commit` only)."""

    @abc.abstractmethod
    def remove(self, path: pathlib.PurePath) -> None:
        """Remove a file (or symlink); a missing one is not an error."""

    @abc.abstractmethod
    def remove_tree(self, path: pathlib.PurePath) -> None:
        """Remove a directory and everything in it, as far as possible (never raises)."""

    @abc.abstractmethod
    def remove_dir(self, path: pathlib.PurePath) -> bool:
        """Remove ``path`` if it is an empty directory; whether it was removed."""

    @abc.abstractmethod
    def open(self, path: pathlib.PurePath) -> ReadHandle:
        """``path`` open for reading (``FileNotFoundError``, ``IsADirectoryError`` as the OS raises them)."""

    def read_capped(self, path: pathlib.PurePath, limit: int) -> bytes:
        """The whole (small) file ``path``; ``ValueError`` when it holds more than ``limit`` bytes (an index that is
        a symlink to ``/dev/zero`` must not exhaust memory)."""
        handle = self.open(path)
        try:
            data = handle.read(0, limit + 1)
        finally:
            handle.close()
        if len(data) > limit:
            raise ValueError(f"larger than the {limit}-byte limit")
        return data


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
KICK_BYTES = 32 << 20  # start writeback every this many bytes (0: leave it all to the final fsync)
FALLOCATE = True  # reserve the file's blocks before writing


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (in pieces of at most 64 MiB)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    total = len(view)
    done = 0
    while done < total:
        done += os.write(fd, view[done : done + _WRITE_CHUNK])


class _LocalStream(WriteStream):
    """A local file descriptor. Every ``KICK_BYTES`` written, writeback of that range is started (Linux
    ``sync_file_range(WRITE)``, which does not wait), so the disk works while the next tensors are copied and the
    final ``fsync`` has little left to do; dd and save_file instead leave everything to the final sync."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._kick = KICK_BYTES if _SYNC_FILE_RANGE is not None else 0
        self._offset = 0
        self._kicked = 0
        self._direct = False  # prefer_direct() was called and this file system has not refused O_DIRECT yet

    def prefer_direct(self) -> None:
        self._direct = bool(_O_DIRECT)

    def reserve(self, nbytes: int) -> None:
        if FALLOCATE and nbytes >= (64 << 20) and hasattr(os, "posix_fallocate"):
            # One extent allocation instead of many, and ENOSPC before any data.
            try:
                os.posix_fallocate(self._fd, 0, nbytes)
            except OSError as exc:
                if exc.errno == 28:  # ENOSPC; other errors (a file system without fallocate) are harmless
                    raise

    def write(self, data: memoryview) -> None:
        if self._direct and len(data) >= DIRECT_MIN and self._offset % DIRECT_ALIGN == 0:
            data = self._write_direct(data)
        step = self._kick or len(data) or 1
        for start in range(0, len(data), step):
            piece = data[start : start + step]
            write_all(self._fd, piece)
            self._offset += len(piece)
            if self._kick and self._offset - self._kicked >= self._kick:
                assert _SYNC_FILE_RANGE is not None
                _SYNC_FILE_RANGE(self._fd, self._kicked, self._offset - self._kicked, _SYNC_FILE_RANGE_WRITE)
                self._kicked = self._offset  # a failed kick (an odd file system) is harmless: fsync still follows

    def _write_direct(self, data: memoryview) -> memoryview:
        """Write the largest aligned prefix of ``data`` with ``O_DIRECT`` (from its memory to the disk: the page
        cache's copy of every byte, most of a buffered write's CPU, is not made); return what is left (the tail,
        written through the page cache). Where the file system refuses direct I/O (``EINVAL``: tmpfs, some
        network file systems) or ``data`` is not aligned, everything is left, and this stream stops trying.

        O_DIRECT is switched on and off around the prefix (``fcntl``) on the one descriptor, so the tail and any
        later small piece are ordinary writes; ``close`` still ``fsync`` s (the disk's cache, the file's size)."""
        import fcntl  # POSIX only, and only reached where O_DIRECT exists

        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):  # read-only memory (bytes): never staged for this
            return view
        if address % DIRECT_ALIGN:
            return view
        n = len(view) - len(view) % DIRECT_ALIGN
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError:  # this file system cannot do direct I/O
            self._direct = False
            return view
        done = 0
        try:
            while done < n:
                wrote = os.write(self._fd, view[done : done + min(_WRITE_CHUNK, n - done)])
                done += wrote
                if wrote % DIRECT_ALIGN:  # a short write left the offset unaligned: the rest goes buffered
                    break
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct = False  # refused after all (an odd block size): this piece and the rest go buffered
        finally:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
        self._offset += done
        self._kicked = self._offset  # nothing of the direct part waits in the page cache
        return view[done:]

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class _LocalHandle(ReadHandle):
    """A raw descriptor: ``os.open`` + one ``fstat`` + ``pread`` (a buffered ``open()`` would stat the file again
    and seek before each read: a load is a handful of system calls, and each one shows at 64 MiB)."""

    def __init__(self, path: pathlib.PurePath) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # closed by close()
        try:
            st = os.fstat(self._fd)
            if stat.S_ISDIR(st.st_mode):  # what open() raises for a directory, which os.open opens
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        except BaseException:
            os.close(self._fd)
            raise
        # A character device (/dev/zero) has size 0 but endless bytes: ranged reads stay bounded by `nbytes`.
        self.size = st.st_size

    def read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fd, nbytes, offset)

    def map(self) -> Any:
        if self.size == 0:
            return None
        return mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def fsync_dir(directory: pathlib.PurePath) -> None:
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


class LocalFileSystem(FileSystem):
    """The local (or mounted) file system: ``O_EXCL`` files, ``fsync``, ``rename``, directory ``fsync``, mmap."""

    def kind(self, path: pathlib.PurePath) -> Kind:
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        except OSError:
            return "other"
        if stat.S_ISREG(mode):
            return "file"
        return "dir" if stat.S_ISDIR(mode) else "other"

    def is_link(self, path: pathlib.PurePath) -> bool:
        return os.path.islink(path)

    def inside(self, path: pathlib.PurePath, directory: pathlib.PurePath) -> bool:
        real, root = os.path.realpath(path), os.path.realpath(directory)
        return os.path.dirname(real) == root or real.startswith(root.rstrip(os.sep) + os.sep)

    def size(self, path: pathlib.PurePath) -> int:
        return os.stat(path).st_size

    def listdir(self, directory: pathlib.PurePath) -> list[str]:
        try:
            return os.listdir(directory)
        except OSError:
            return []

    def make_dirs(self, directory: pathlib.PurePath) -> None:
        existing = pathlib.Path(directory)
        while not existing.is_dir() and existing != existing.parent:
            existing = existing.parent
        os.makedirs(directory, exist_ok=True)
        fsync_dir(existing)

    def make_dir(self, directory: pathlib.PurePath) -> None:
        os.mkdir(directory)

    def create(self, path: pathlib.PurePath, final: pathlib.PurePath | None = None) -> WriteStream:
        # 0o666 & ~umask, exactly like open(..., "w"); mkstemp / NamedTemporaryFile would force 0o600.
        return _LocalStream(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))

    def commit(self, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        os.replace(written, target)
        fsync_dir(target.parent)

    def rename(self, path: pathlib.PurePath, new: pathlib.PurePath) -> None:
        os.rename(path, new)

    def remove(self, path: pathlib.PurePath) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: pathlib.PurePath) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_dir(self, path: pathlib.PurePath) -> bool:
        try:
            os.rmdir(path)
        except OSError:
            return False
        return True

    def open(self, path: pathlib.PurePath) -> ReadHandle:
        return _LocalHandle(path)


#: The one local file system (it holds no state).
LOCAL: Final = LocalFileSystem()
