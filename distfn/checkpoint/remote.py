"""Checkpoints on object storage: a second `distfn.checkpoint.fs.FileSystem`, over fsspec (``s3://``, ``gs://``,
``az://``, ``memory://``, ``file://``: any fsspec protocol).

Object stores have no rename and no directories, so this backend keeps the writer's and the readers' code
unchanged by meaning the same operations differently:

- **new files are uploaded under their final name** (`FileSystem.create`'s ``final``), streamed through fsspec's
  file objects in parts of `PART_BYTES` (multipart on S3: the object appears whole, atomically, only when the
  upload is completed, and the previous object under that name stays readable until then). The temporary name the
  writer picked becomes a small **lease** object naming the upload and its writer's host and pid, so that a later
  save removes what a killed writer left (exactly as it removes a killed local writer's temporary file), never
  anything committed;
- **a file exists only once its commit object exists**: `publish` completes the upload, checks the object's size
  against the bytes streamed, and only then writes ``.<name>.distfn-commit`` (a few bytes of JSON holding that
  size and the object's identity, its ETag or modification time). `kind` says ``"missing"`` for an object without
  a commit object of its size and identity, so `distfn.latest`, `distfn.load` and resumes never see a partial
  upload, nor an object another writer replaced after its commit;
- **a re-save of a committed name** uploads beside it (``.<name>.<host>.<pid>.<random>.distfn-data``), switches
  the commit object to that object (the one atomic step: the old checkpoint is readable until then, the new one
  from then on), copies it onto the name (server-side) and commits that; a writer killed at any request leaves
  one of the two whole. Two writers of one name: each checks after its commit that the object is still the one it
  committed, else commits what is there (the other's whole upload) and raises, so one wins whole;
- **a new directory is written in place** (`stage_dir` returns the target itself, with a lease); a sharded
  checkpoint is visible once its index is committed, which its writer does last, after every rank's shard is
  committed. Replacing an existing directory removes it first (an object store cannot swap directories).

Paths are `RemotePath` s: POSIX paths whose text is the URL, so every message names ``s3://bucket/key``. Storage
options (endpoint, credentials) come from fsspec's usual configuration (``FSSPEC_S3_ENDPOINT_URL``, config files,
the environment of the storage library) or from the ``storage_options=`` of the call. Nothing remembers them
between calls: each `RemotePath` carries the file system it was resolved on (`RemotePath.store`, built with that
call's options), so a path a save returned, passed back to a load, reads where it was written, and a URL given as
text without options always means fsspec's configuration, whatever an earlier call passed for that bucket.

fsspec is an optional dependency (the ``distfn[s3]`` extra): it is imported when the first URL is resolved,
never by ``import distfn`` (a local-only user does not pay its ~0.1 s import, nor need it installed).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import socket
import threading
from collections.abc import Mapping
from typing import Any, ClassVar, Final, TypeGuard

from loguru import logger

from ..errors import CheckpointError
from . import fs, urls
from .names import INDEX
from .retries import S3_CONFIG, as_checkpoint_error, attempts, explain

__all__ = ["COMMIT_SUFFIX", "PART_BYTES", "RemoteFileSystem", "RemotePath", "locate"]

#: Bytes per uploaded part: one part is all the host memory a streaming upload holds (plus the copy being sent). S3
#: takes parts of 5 MiB to 5 GiB and at most 10,000 of them, so a file over `_MAX_PARTS` parts of this size gets
#: larger parts (`_Upload.reserve`).
PART_BYTES = 16 << 20
_MAX_PARTS: Final = 9_000
#: The commit object of ``<dir>/<name>`` is ``<dir>/.<name>`` + this suffix.
COMMIT_SUFFIX: Final = ".distfn-commit"
_LEASE_KEY: Final = "distfn-lease"
_DATA: Final = ".distfn-data"  # a re-save's upload beside its target: ``.<name>.<host>.<pid>.<random>.distfn-data``
_FORMAT: Final = "distfn-commit-2"
_SMALL: Final = 1 << 16  # commit objects and leases are far smaller than this
# Reads go through one cached block fetched from the offset asked for: _BLOCK bytes for a small read (the header, a
# tiny tensor), _SEQUENTIAL bytes for a read that starts where the previous one ended (a load reads its tensors in
# file order, so one ranged GET serves several), never more than that: a larger read, or a small read elsewhere
# than the block, is one ranged GET of exactly its bytes. The block is the only extra memory a read holds.
_DIRECT: Final = 1 << 20
_BLOCK: Final = 1 << 20
_SEQUENTIAL: Final = 64 << 20
_EXTRAS: Final = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}



class RemotePath(pathlib.PurePosixPath):
    """A path on a remote file system: ``/bucket/run/ckpt-7`` inside, ``s3://bucket/run/ckpt-7`` as text.

    One subclass per protocol (`of`) carries it, so ``path / name``, ``.parent`` and ``.with_name`` keep it (they
    build paths of their own class). ``os.fspath`` gives the URL too: a `RemotePath` passed back to
    `distfn.load` or ``ctx.load`` names the same object. It has no local file-system methods (it is not a
    `pathlib.Path`): use distfn's functions, or fsspec, to read what it names.
    """

    protocol: ClassVar[str] = ""
    #: fsspec's root marker for the protocol: "" (object stores: keys have no leading slash) or "/".
    root: ClassVar[str] = ""
    #: The file system this path was resolved on (with the storage options of that call): one subclass per
    #: `RemoteFileSystem`, so every path derived from this one keeps it.
    store: ClassVar[RemoteFileSystem | None] = None

    @staticmethod
    def of(store: RemoteFileSystem, root: str) -> type[RemotePath]:
        """The `RemotePath` class of the paths of ``store`` (made once per file system)."""
        return type(f"RemotePath[{store.protocol}]", (RemotePath,),
                    {"protocol": store.protocol, "root": root, "store": store})

    @property
    def key(self) -> str:
        """The path as the fsspec file system names it (``bucket/run/ckpt-7``, or ``/tmp/x`` for ``file://``).

        Every request distfn sends names its object through this, so this is where the URL rule
        (`distfn.checkpoint.urls`) holds for derived paths too: a key with a ``..`` segment, a backslash, a control
        character or a percent-escape is never sent, whatever built it.

        Raises:
            CheckpointError: the key breaks the rule (naming the URL and why).
        """
        key = self._unchecked()
        problem = urls.key_problem(key)
        if problem is not None:
            raise CheckpointError(f"{(self.protocol + '://' + key)!r} cannot be used: its key {problem}")
        return key

    def _unchecked(self) -> str:
        text = pathlib.PurePosixPath.__str__(self)
        return text if self.root == "/" else text.lstrip("/")

    def __truediv__(self, name: Any) -> RemotePath:
        # pathlib would start again at an absolute name: a name joined to a directory stays inside it
        if isinstance(name, str) and name.startswith("/"):
            raise CheckpointError(f"{self}/{name!r}: an absolute name cannot be joined to a directory")
        return super().__truediv__(name)

    def __str__(self) -> str:
        return f"{self.protocol}://{self._unchecked()}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"


# --------------------------------------------------------------------------------------------------
# Errors and retries: `distfn.checkpoint.retries`


def _identity(info: Mapping[str, Any]) -> str | None:
    """What tells two versions of an object apart: its ETag (S3, GCS), else its modification time."""
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if info.get(key):
            return str(info[key])
    return None


# --------------------------------------------------------------------------------------------------
# Streams


class _Upload(fs.WriteStream):
    """A streaming upload through an fsspec file object with ``autocommit=False`` where the backend has it (the
    object then appears only at `RemoteFileSystem.commit`). Data is handed over in pieces that fill the file's
    buffer to exactly one part, so at most one part (and the copy being sent) is held."""

    def __init__(self, store: RemoteFileSystem, path: RemotePath, lease: RemotePath | None,
                 target: RemotePath | None = None, previous: RemotePath | None = None) -> None:
        self._store, self.path, self.lease = store, path, lease
        #: The name the file is published under (``path`` itself, or the target a re-save's hidden upload serves).
        self.target = target or path
        #: The hidden data object the target's commit named when this save began (removed once it is replaced).
        self.previous = previous
        self.written = 0
        self._file: Any = attempts("opening for writing", path, lambda: store.open_for_write(path))
        self.part = PART_BYTES

    def reserve(self, nbytes: int) -> None:
        """Choose the part size (nothing to allocate: a bucket's quota fails the upload, which is then aborted)."""
        mib = 1 << 20
        per_part = -(-nbytes // _MAX_PARTS)  # rounded up, then to whole MiB
        self.part = max(PART_BYTES, -(-per_part // mib) * mib)
        if getattr(self._file, "blocksize", None) is not None:
            self._file.blocksize = self.part  # read by fsspec at each write; nothing is buffered yet

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done, total = 0, len(view)
        while done < total:
            buffered = self._file.buffer.tell() if getattr(self._file, "buffer", None) is not None else 0
            step = max(1, min(total - done, self.part - buffered))
            try:
                self._file.write(view[done:done + step])
            except Exception as exc:  # the storage library retried already: say what failed
                raise explain(exc, self.path) from exc
            done += step
        self.written += total

    def close(self) -> None:
        """Upload the last part (the object is completed by `RemoteFileSystem.commit`)."""
        try:
            self._file.close()
        except Exception as exc:
            raise explain(exc, self.path) from exc

    def complete(self) -> None:
        """Make the uploaded object exist (S3: complete the multipart upload)."""
        if callable(getattr(self._file, "commit", None)) and not getattr(self._file, "autocommit", True):
            attempts("completing the upload of", self.path, self._file.commit)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            if callable(getattr(self._file, "discard", None)) and not getattr(self._file, "autocommit", True):
                self._file.discard()  # S3: abort the multipart upload (its parts are freed)
            else:
                self._file.close()


class _Download(fs.ReadHandle):
    """Ranged reads of one committed object through a read-ahead block (see `_SEQUENTIAL`); no memory map."""

    def __init__(self, store: RemoteFileSystem, path: RemotePath, size: int) -> None:
        self._store, self._path, self.size = store, path, size
        self._block: tuple[int, bytes] = (0, b"")
        self._end = -1  # where the last read ended

    def read(self, offset: int, nbytes: int) -> bytes:
        with as_checkpoint_error():  # a server gone mid-load: the URL and the cause, not a bare ConnectionError
            return self._read(offset, nbytes)

    def _read(self, offset: int, nbytes: int) -> bytes:
        end = min(offset + nbytes, self.size)
        if end <= offset:
            return b""
        sequential, self._end = offset == self._end, end
        start, block = self._block
        if start <= offset and end <= start + len(block):
            return block[offset - start:end - start]
        ahead = _SEQUENTIAL if sequential else _BLOCK if end - offset < _DIRECT else 0
        if end - offset >= ahead:
            return self._store.read_range(self._path, offset, end)
        block = self._store.read_range(self._path, offset, min(self.size, offset + ahead))
        self._block = (offset, block)
        return block[:end - offset]

    def map(self) -> Any:
        return None

    def close(self) -> None:
        self._block = (0, b"")


# --------------------------------------------------------------------------------------------------
# The file system


class RemoteFileSystem(fs.FileSystem):
    """An fsspec file system as a checkpoint store, with commit objects (see the module docstring).

    Args:
        target: the fsspec file system (``fsspec.filesystem("s3", ...)``).
        protocol: the URL scheme its paths are shown with.
    """

    def __init__(self, target: Any, protocol: str) -> None:
        self._fs = target
        self.protocol = protocol
        self.path_type = RemotePath.of(self, "/" if getattr(target, "root_marker", "") == "/" else "")
        self._local = "file" in _protocols(target) or "local" in _protocols(target)
        self.directories = self._local
        #: ``memory://``: each process has its own; a multi-process job cannot share a checkpoint through it.
        self.per_process = protocol == "memory"
        self._s3 = protocol in ("s3", "s3a")
        self._leases: dict[pathlib.PurePath, pathlib.PurePath] = {}  # this process's in-place directories -> lease
        self._ignored: set[tuple[pathlib.PurePath, str]] = set()  # hostile listed names, warned about once
        self._lock = threading.Lock()

    # -- paths and small objects ----------------------------------------------------------------------
    def path(self, key: str) -> RemotePath:
        """The `RemotePath` of an fsspec path of this file system."""
        return self.path_type("/" + key.lstrip("/"))

    @staticmethod
    def _key(path: pathlib.PurePath) -> str:
        if isinstance(path, RemotePath):
            return path.key
        raise TypeError(f"{path!r} is not a path of a remote file system")

    def commit_object(self, path: pathlib.PurePath) -> RemotePath:
        """Where the commit object of the file ``path`` lives."""
        return self.path(self._key(path.with_name(f".{path.name}{COMMIT_SUFFIX}")))

    def _info(self, path: pathlib.PurePath) -> dict[str, Any] | None:
        key = self._key(path)

        def call() -> dict[str, Any] | None:
            self._fs.invalidate_cache(key)  # another rank may have written it: never trust a listing cache
            try:
                info: dict[str, Any] = self._fs.info(key)
            except FileNotFoundError:
                return None
            return info

        info = attempts("looking up", path, call)
        if self._s3 and info is not None and info.get("type") == "file" and not info.get("ETag"):
            # every S3 object has an ETag; a web server (an nginx page, a proxy's login form) answers a HEAD with a
            # plain 200: taken for an object, it made `latest` say "no checkpoint" instead of naming the mistake
            raise OSError(f"the server for {path} does not answer like an S3 service (an object without an ETag, "
                          f"content type {info.get('ContentType') or 'unknown'}): is endpoint_url the address of "
                          "the S3 API?")
        return info

    def _read_small(self, path: pathlib.PurePath) -> Any:
        """The JSON in the small object ``path``, or ``None`` when it is absent or not ours."""
        key = self._key(path)

        def call() -> bytes | None:
            try:
                return bytes(self._fs.cat_file(key, start=0, end=_SMALL))
            except FileNotFoundError:
                return None

        raw = attempts("reading", path, call)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _put_small(self, path: pathlib.PurePath, value: Any, *, shown: pathlib.PurePath | None = None) -> None:
        """Write the small JSON object ``path`` (errors name ``shown``, the checkpoint it serves, when given)."""
        data = json.dumps(value).encode()
        attempts("writing", shown or path, lambda: self._fs.pipe_file(self._key(path), data))

    def _delete(self, path: pathlib.PurePath) -> None:
        key = self._key(path)

        def call() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(key)

        attempts("removing", path, call)

    def read_range(self, path: RemotePath, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object ``path`` (one ranged GET)."""
        return bytes(attempts("reading", path, lambda: self._fs.cat_file(path.key, start=start, end=end)))

    def open_for_write(self, path: RemotePath) -> Any:
        """An fsspec file object for a streaming upload to ``path`` (``autocommit=False`` where supported)."""
        if self._local:
            self._fs.makedirs(self._key(path.parent), exist_ok=True)
        try:
            return self._fs.open(path.key, "wb", block_size=PART_BYTES, autocommit=False)
        except (TypeError, NotImplementedError):  # a backend without deferred commits: visibility is the marker's
            return self._fs.open(path.key, "wb", block_size=PART_BYTES)

    # -- FileSystem -------------------------------------------------------------------------------------
    def kind(self, path: pathlib.PurePath) -> fs.Kind:
        with as_checkpoint_error():
            info = self._info(path)
            if info is None:
                return "missing"
            if info.get("type") == "directory":
                return "dir"
            if info.get("type") != "file":
                return "other"
            return "file" if self._committed(path, info) is not None else "missing"

    def _committed(self, path: pathlib.PurePath, info: Mapping[str, Any]) -> tuple[RemotePath, int] | None:
        """Where the committed bytes of ``path`` (whose fsspec ``info`` is given) are, and their size: ``path``
        itself, or the hidden object a re-save's commit names (`commit_stream`); ``None`` without a commit object
        whose size (and identity, `_identity`) are those of the object it names."""
        marker = self._read_small(self.commit_object(path))
        if not isinstance(marker, dict) or not isinstance(marker.get("size"), int):
            return None
        data, data_info = self.path(self._key(path)), info
        named = marker.get("object")
        if isinstance(named, str) and named != path.name:
            if not _hidden(named):
                return None  # only a hidden sibling written by a re-save: a commit object never points elsewhere
            data = self.path(self._key(path.with_name(named)))
            found = self._info(data)
            if found is None or found.get("type") != "file":
                return None
            data_info = found
        if marker["size"] != data_info.get("size"):
            return None
        if marker.get("id") is not None and marker.get("id") != _identity(data_info):
            return None  # another upload replaced the object after its commit object was written
        return data, marker["size"]

    def is_link(self, path: pathlib.PurePath) -> bool:
        return self._local and fs.LOCAL.is_link(pathlib.Path(self._key(path)))

    def inside(self, path: pathlib.PurePath, directory: pathlib.PurePath) -> bool:
        if self._local:  # file://: real files, real symlinks: the local rule (a shard linked outside is refused)
            return fs.LOCAL.inside(pathlib.Path(self._key(path)), pathlib.Path(self._key(directory)))
        return directory in path.parents

    def check_root(self, path: pathlib.PurePath) -> None:
        if self._local:
            return
        bucket = self._key(path).split("/", 1)[0]
        if bucket and self._info(self.path(bucket)) is None:
            raise FileNotFoundError(f"the bucket '{bucket}' of {path} does not exist (or these credentials cannot "
                                    "see it); create it first, or fix the URL")

    def size(self, path: pathlib.PurePath) -> int:
        info = self._info(path)
        if info is None:
            raise FileNotFoundError(f"no such object: {path}")
        return int(info.get("size") or 0)

    def listdir(self, directory: pathlib.PurePath) -> list[str]:
        """The names under ``directory``: only entries the server lists *under* its prefix, each a name the URL
        rule accepts (`urls.name_problem`). An object another writer named ``run/../other/x`` is listed by S3 as
        ``run/..``: it is skipped (with one warning), so `latest` and ``distfn ls`` never read outside."""
        key = self._key(directory)
        under = key.rstrip("/") + "/"

        def call() -> list[str]:
            self._fs.invalidate_cache(key)
            try:
                return [str(entry).rstrip("/") for entry in self._fs.ls(key, detail=False)]
            except (FileNotFoundError, NotADirectoryError):
                return []

        with as_checkpoint_error():
            entries = attempts("listing", directory, call)
        names = []
        for entry in entries:
            name = entry[len(under):]
            problem = urls.name_problem(name) if entry.startswith(under) else "is not under the prefix listed"
            if problem is None:
                names.append(name)
            elif entry != key.rstrip("/") and (directory, entry) not in self._ignored:  # a file lists itself
                self._ignored.add((directory, entry))
                logger.warning("ignoring the object {!r} listed in {}: its name {} (distfn never writes such a name; "
                               "another writer put it there)", entry, directory, problem)
        return names

    def make_dirs(self, directory: pathlib.PurePath) -> None:
        if self._local:
            self._fs.makedirs(self._key(directory), exist_ok=True)
            return
        self.check_root(directory)  # an object store has prefixes, but buckets exist

    def make_dir(self, directory: pathlib.PurePath) -> None:
        self.make_dirs(directory)

    def create(self, path: pathlib.PurePath, final: pathlib.PurePath | None = None) -> fs.WriteStream:
        target = final if final is not None else path
        if not isinstance(target, RemotePath) or not isinstance(path, RemotePath):
            raise TypeError(f"{path!r} is not a path of a remote file system")
        lease, upload, previous = None, target, None
        if target != path:  # the writer's temporary name: a lease naming the upload and its writer
            lease = path
            # a re-save of a committed name uploads beside it, so that the old checkpoint stays readable until the
            # new one's commit object names it (`commit_stream`): no moment with neither
            before = self._read_small(self.commit_object(target))
            if isinstance(before, dict):
                upload = self.path(self._key(path.with_name(path.name.rsplit(".", 1)[0] + _DATA)))
                named = before.get("object")
                if _hidden(named):
                    previous = self.path(self._key(target.with_name(named)))
            self._put_small(lease, {_LEASE_KEY: target.name, "data": upload.name, "host": socket.gethostname(),
                                    "pid": os.getpid()}, shown=target)
        try:
            return _Upload(self, upload, lease, target, previous)
        except BaseException:
            if lease is not None:
                self._delete(lease)
            raise

    def commit_stream(self, stream: fs.WriteStream) -> None:
        """Complete the upload of ``stream``, check its size, write its commit object, drop its lease.

        A re-save (uploaded beside the target) then switches the commit object to the new object (the one atomic
        step: before it the old checkpoint is the one readable, after it the new one), copies it onto the target
        (server-side) and commits that. Last, the object is checked to be still the one committed: a writer that
        finds another's upload in its place (two writers of one name at once) commits what is there, whole, and
        raises, so that one save wins whole and the other is an error.
        """
        if not isinstance(stream, _Upload):
            raise TypeError("not a stream of this file system")
        stream.complete()
        info = self._info(stream.path) or {}
        size = int(info.get("size") or 0)
        if size != stream.written:
            raise OSError(f"{stream.target} holds {size} bytes after the upload, {stream.written} were sent (another "
                          "writer saved it at the same time, or the upload was cut); not committed")
        commit, target = self.commit_object(stream.target), stream.target
        mine = {"size": size, "id": _identity(info), "format": _FORMAT}
        if stream.path != target:
            self._put_small(commit, {**mine, "object": stream.path.name}, shown=target)  # the switch
            try:
                attempts("copying to", target, lambda: self._fs.copy(stream.path.key, target.key))
            except FileNotFoundError:  # a later save of this name replaced ours and removed it: that one is kept
                raise OSError(f"{target} was saved by another writer at the same time: its checkpoint is the one "
                              "kept, this save is lost (one writer per name)") from None
            info = self._info(target) or {}
            mine = {"size": int(info.get("size") or 0), "id": _identity(info), "format": _FORMAT}
        self._put_small(commit, mine, shown=target)
        now = self._info(target)
        if now is None or now.get("size") != mine["size"] or _identity(now) != mine["id"]:
            if now is not None and now.get("type") == "file":  # another writer's complete upload: kept, whole
                self._put_small(commit, {"size": now.get("size"), "id": _identity(now), "format": _FORMAT})
            raise OSError(f"{target} was saved by another writer at the same time: its checkpoint is the one kept, "
                          "this save is lost (one writer per name)")
        for leftover in (stream.path if stream.path != target else None, stream.previous, stream.lease):
            if leftover is not None:
                self._delete(leftover)

    def commit(self, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        # files are committed by `commit_stream` (called by `publish`); what remains is a directory written in
        # place: its index was committed last, the lease goes
        if written != target:
            raise OSError(f"cannot rename {written} to {target} on {self.protocol}:// (object stores have no rename)")
        with self._lock:
            lease = self._leases.pop(target, None)
        if lease is not None:
            self._delete(lease)

    def stage_dir(self, tmp: pathlib.PurePath, target: pathlib.PurePath) -> pathlib.PurePath:
        if not isinstance(target, RemotePath) or not isinstance(tmp, RemotePath):
            raise TypeError(f"{target!r} is not a path of a remote file system")
        if self.kind(target) != "missing":
            logger.info("replacing {}: an object store cannot swap directories, so the old one is removed first",
                        target)
            self.remove_tree(target)
        self._put_small(tmp, {_LEASE_KEY: target.name, "dir": True, "host": socket.gethostname(),
                              "pid": os.getpid()})
        with self._lock:
            self._leases[target] = tmp
        return target

    def rename(self, path: pathlib.PurePath, new: pathlib.PurePath) -> None:
        raise OSError(f"cannot rename {path} on {self.protocol}:// (object stores have no rename)")

    def remove(self, path: pathlib.PurePath) -> None:
        if self._released(path):
            return
        info = self._info(path)
        found = self._committed(path, info) if info is not None and info.get("type") == "file" else None
        # the commit object first: a half-removed checkpoint is never taken for a committed one
        self._delete(self.commit_object(path))
        self._delete(path)
        if found is not None and found[0] != path:
            self._delete(found[0])  # the hidden object a re-save's commit named

    def _released(self, path: pathlib.PurePath) -> bool:
        """When ``path`` is a lease (a writer's temporary name, given to `remove` or `remove_tree` by the cleaning of
        killed writers' leftovers), clean what its writer left (`_release`); whether it was one."""
        if not path.name.startswith("."):
            return False
        lease = self._lease(path)
        if lease is None:
            return False
        self._release(path, lease)
        return True

    def _lease(self, path: pathlib.PurePath) -> dict[str, Any] | None:
        info = self._info(path)
        if info is None or info.get("type") != "file" or int(info.get("size") or 0) > _SMALL:
            return None
        value = self._read_small(path)
        return value if isinstance(value, dict) and isinstance(value.get(_LEASE_KEY), str) else None

    def _release(self, path: pathlib.PurePath, lease: dict[str, Any]) -> None:
        """Clean what the (dead) writer of the lease ``path`` left: its unfinished upload, or the directory it was
        writing in place when its index was never committed. A committed checkpoint is never touched."""
        name = str(lease[_LEASE_KEY])
        if urls.name_problem(name) is None and not name.startswith("."):
            target = path.with_name(name)
            # a committed checkpoint is never touched: not a committed file (a lease of either kind may name one, a
            # dead writer's or a hand-made one), not a directory whose index is committed
            if lease.get("dir") and self.kind(target) != "file" and self.kind(target / INDEX) != "file":
                self.remove_tree(target)
            elif not lease.get("dir"):
                self._abort_uploads(target)
                data = lease.get("data")
                if _hidden(data) and data != name:
                    hidden = path.with_name(data)
                    self._abort_uploads(hidden)
                    info = self._info(target)
                    found = self._committed(target, info) if info is not None else None
                    if found is None or found[0] != hidden:  # never the object a commit names
                        self._delete(hidden)
        self._delete(path)

    def _abort_uploads(self, path: pathlib.PurePath, *, under: bool = False) -> None:
        """S3: abort the unfinished multipart uploads to ``path`` (``under``: to the keys under it), which hold
        storage until then."""
        if not callable(getattr(self._fs, "list_multipart_uploads", None)):
            return  # other stores expire unfinished uploads themselves (GCS, Azure: about a week)
        key = self._key(path)
        bucket, _, prefix = key.partition("/")
        with contextlib.suppress(Exception):  # best effort: cleaning must never fail a save
            for upload in self._fs.list_multipart_uploads(bucket):
                name = str(upload.get("Key", ""))
                if name.startswith(prefix + "/") if under else name == prefix:
                    self._fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])

    def remove_tree(self, path: pathlib.PurePath) -> None:
        key = self._key(path)
        with contextlib.suppress(Exception):  # never raises, as the interface says
            if self._released(path) or self._info(path) is None:
                return
            index = self.commit_object(path / INDEX)
            self._delete(index)  # the checkpoint's commit object first
            self._fs.rm(key, recursive=True)
        with contextlib.suppress(Exception):
            self._abort_uploads(path, under=True)
        with self._lock:
            lease = self._leases.pop(path, None)
        if lease is not None:
            with contextlib.suppress(Exception):
                self._delete(lease)

    def remove_dir(self, path: pathlib.PurePath) -> bool:
        if self._local:
            try:
                self._fs.rmdir(self._key(path))
            except OSError:
                return False
            return True
        return not self.listdir(path)  # a prefix without objects does not exist on an object store

    def open(self, path: pathlib.PurePath) -> fs.ReadHandle:
        if not isinstance(path, RemotePath):
            raise TypeError(f"{path!r} is not a path of a remote file system")
        with as_checkpoint_error():  # no access, no server: the user's news, not a missing file
            info = self._info(path)
            committed = self._committed(path, info) if info is not None and info.get("type") == "file" else None
        if info is not None and info.get("type") == "directory":
            raise IsADirectoryError(f"{path} is a directory")
        if info is None:
            raise FileNotFoundError(f"no committed object at {path}")
        if committed is None:
            raise FileNotFoundError(f"{path} exists but has no commit object ({self.commit_object(path).name} of its "
                                    "size): a writer that did not finish, or a file not written through a URL (a "
                                    "checkpoint saved to a local path is read through that path, not file://)")
        return _Download(self, committed[0], committed[1])

    def publish(self, stream: fs.WriteStream, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        self.commit_stream(stream)


def _hidden(name: object) -> TypeGuard[str]:
    """Whether ``name`` (read from a commit object or a lease: untrusted) is a re-save's hidden sibling upload."""
    return (isinstance(name, str) and name.startswith(".") and name.endswith(_DATA)
            and urls.name_problem(name) is None)


def _protocols(target: Any) -> tuple[str, ...]:
    proto = getattr(target, "protocol", ())
    return (proto,) if isinstance(proto, str) else tuple(proto)


# --------------------------------------------------------------------------------------------------
# URL -> (file system, path)

#: The file systems made so far, by fsspec's token (which covers the protocol and every option): one
#: `RemoteFileSystem` (and one `RemotePath` class) per distinct set of options, never shared between two sets.
_STORES: dict[str, RemoteFileSystem] = {}
_STORES_LOCK = threading.Lock()


def _fsspec(url: str) -> Any:
    try:
        return importlib.import_module("fsspec")
    except ImportError:
        raise CheckpointError(f"cannot open {url}: checkpoints at URLs need fsspec: pip install 'distfn[s3]' (fsspec "
                              "and s3fs; for gs:// add gcsfs, for az:// adlfs)") from None


def locate(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[RemoteFileSystem, RemotePath]:
    """The file system and path a URL names (``s3://bucket/run/ckpt-7``).

    Args:
        url: any fsspec URL, taken in its canonical form (`distfn.checkpoint.urls.parse`: ``S3://b//run/`` is
            ``s3://b/run``).
        storage_options: passed to the fsspec file system (``endpoint_url``, ``key``, ``secret``, ...), for this
            call only. ``None``: fsspec's configuration alone.

    Raises:
        CheckpointError: fsspec (or the protocol's library) is not installed, naming the extra to install; the
            URL breaks `distfn.checkpoint.urls`' rule (a ``..`` segment, a backslash, a control character, a
            percent-escape, no bucket), naming the URL and the fix.
    """
    parsed = urls.parse(url)  # the one rule: a canonical URL or a CheckpointError, before fsspec sees anything
    fsspec = _fsspec(url)
    protocol = parsed.scheme
    if protocol in ("http", "https"):  # fsspec's HTTP file system reads only, and lists nothing: no checkpoints
        raise CheckpointError(f"cannot use {url}: checkpoints need a store that can be written and listed (s3://, "
                              "gs://, az://, file://, ...), not plain HTTP")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointError(f"cannot open {url}: storage_options= must be a mapping of the fsspec file system's "
                              f"options such as {{'endpoint_url': 'http://host:9000'}}, got "
                              f"{type(storage_options).__name__} {storage_options!r}")
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a") and "config_kwargs" not in {**fsspec.config.conf.get(protocol, {}), **options}:
        options["config_kwargs"] = S3_CONFIG  # bounded waits (see `S3_CONFIG`), unless the user chose their own
    try:
        target = fsspec.filesystem(protocol, **options)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'distfn[{extra}]'" if extra == "s3" else f"install fsspec's library for {protocol}://"
        raise CheckpointError(f"cannot open {url}: {exc} ({hint})") from None
    except (ValueError, TypeError, OSError) as exc:  # an unknown protocol, bad options, a missing native library
        raise CheckpointError(f"cannot open {url}: {type(exc).__name__}: {exc}") from None
    if isinstance(getattr(target, "retries", None), int):
        # s3fs retries each call 5 times more, on top of botocore's attempts and `_attempts`: 75 attempts of a
        # request that times out. botocore's (standard mode) and `_attempts` are enough.
        target.retries = 1
    token = f"{protocol}:{getattr(target, '_fs_token', id(target))}"
    with _STORES_LOCK:
        store = _STORES.get(token)
        if store is None:
            store = _STORES[token] = RemoteFileSystem(target, protocol)
    where = store.path(str(target._strip_protocol(parsed.text)))
    _ = where.key  # checked now: what fsspec made of the canonical URL is refused here, not at the first request
    return store, where
