"""Checkpoints on object storage: a second `distfn.checkpoint.fs.FileSystem`, over fsspec (``s3://``, ``gs://``,
``az://``, ``memory://``, ``file://``: any fsspec protocol).

Object stores have no rename and no directories, so this backend keeps the writer's and the readers' code
unchanged by meaning the same operations differently:

- **new files are uploaded under their final name** (`FileSystem.create`'s ``final``), streamed through fsspec's
  file objects in parts of `PART_BYTES` (multipart on S3: the object appears whole, atomically, only when the
  upload is completed, and the previous object under that name stays readable until then). The temporary name the
  writer picked becomes a small **lease** object naming the upload and its writer's host and pid, so that a later
  save removes what a killed writer left (exactly as it removes a killed local writer's temporary file);
- **a file exists only once its commit object exists**: `publish` completes the upload, checks the object's size
  against the bytes streamed, and only then writes ``.<name>.distfn-commit`` (a few bytes of JSON holding that
  size). `kind` says ``"missing"`` for an object without a commit object of its size, so `distfn.latest`,
  `distfn.load` and resumes never see a partial upload;
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
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Final, TypeVar

from loguru import logger

from ..errors import CheckpointError
from . import fs
from .names import INDEX

__all__ = ["ATTEMPTS", "COMMIT_SUFFIX", "PART_BYTES", "RemoteFileSystem", "RemotePath", "locate"]

#: Bytes per uploaded part: one part is all the host memory a streaming upload holds (plus the copy being sent). S3
#: takes parts of 5 MiB to 5 GiB and at most 10,000 of them, so a file over `_MAX_PARTS` parts of this size gets
#: larger parts (`_Upload.reserve`).
PART_BYTES = 16 << 20
_MAX_PARTS: Final = 9_000
#: Attempts of one storage request before a throttling answer or a network error becomes a `CheckpointError`.
ATTEMPTS = 5
#: No new attempt starts once this many seconds have passed since the first: with `S3_CONFIG`'s timeouts a server
#: that accepts connections and never answers fails a call within about 80 s (3 botocore attempts of at most
#: 5 + 20 s, then this window is over), not after minutes of layered retries.
RETRY_WINDOW_S = 30.0
#: The botocore settings distfn gives an ``s3://`` file system when neither the call's ``storage_options`` nor
#: fsspec's configuration set ``config_kwargs``: bounded waits (botocore's own default read timeout is 60 s, and
#: s3fs multiplies its attempts by 5). Throttling answers, 5xx and network errors are retried by botocore
#: (``standard`` mode) and by `_attempts`; s3fs's extra layer of attempts is turned off (`locate`).
S3_CONFIG: Final = {"connect_timeout": 5, "read_timeout": 20, "retries": {"mode": "standard", "total_max_attempts": 3}}
#: The commit object of ``<dir>/<name>`` is ``<dir>/.<name>`` + this suffix.
COMMIT_SUFFIX: Final = ".distfn-commit"
_LEASE_KEY: Final = "distfn-lease"
_SMALL: Final = 1 << 16  # commit objects and leases are far smaller than this
# Reads go through one cached block fetched from the offset asked for: _BLOCK bytes for a small read (the header, a
# tiny tensor), _SEQUENTIAL bytes for a read that starts where the previous one ended (a load reads its tensors in
# file order, so one ranged GET serves several), never more than that: a larger read, or a small read elsewhere
# than the block, is one ranged GET of exactly its bytes. The block is the only extra memory a read holds.
_DIRECT: Final = 1 << 20
_BLOCK: Final = 1 << 20
_SEQUENTIAL: Final = 64 << 20
_THROTTLED: Final = ("SlowDown", "Throttl", "RequestLimitExceeded", "TooManyRequests", "reduce your request rate",
                     "503", "429")
_DENIED: Final = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                  "InvalidToken", "Forbidden", "403", "NoCredentials", "Unable to locate credentials")
_EXTRAS: Final = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}

T = TypeVar("T")


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
        """The path as the fsspec file system names it (``bucket/run/ckpt-7``, or ``/tmp/x`` for ``file://``)."""
        text = pathlib.PurePosixPath.__str__(self)
        return text if self.root == "/" else text.lstrip("/")

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"


# --------------------------------------------------------------------------------------------------
# Errors: what a user can act on, naming the URL


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _throttled(exc: BaseException) -> bool:
    return any(mark in _text(exc) for mark in _THROTTLED)


def _transient(exc: BaseException) -> bool:
    """A throttling answer or a network failure: worth another attempt."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, FileExistsError)):
        return False
    names = {t.__name__ for t in type(exc).__mro__}
    network = bool(names & {"ConnectionError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                            "HTTPClientError", "ClientConnectorError", "ServerDisconnectedError", "TimeoutError",
                            "ClientOSError", "IncompleteRead", "ResponseParserError"})
    return network or _throttled(exc)


def explain(exc: BaseException, url: object) -> OSError:
    """``exc`` (from fsspec or its storage library) as an `OSError` whose message names ``url`` and the cause: wrong
    credentials, a missing bucket, an unreachable server, throttling."""
    text = _text(exc)
    if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in text and "bucket" not in text.lower():
        return FileNotFoundError(f"no such object: {url}")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return FileNotFoundError(f"the bucket of {url} does not exist ({text}); create it first, or fix the URL")
    if any(mark in text for mark in _DENIED) or isinstance(exc, PermissionError):
        return PermissionError(f"access to {url} was denied: wrong or missing credentials? ({text}). distfn "
                               "uses fsspec's configuration: the storage library's environment variables and "
                               "config files, FSSPEC_<PROTOCOL>_* variables, or storage_options=")
    if _throttled(exc):
        return ConnectionError(f"the storage service kept throttling requests for {url} after {ATTEMPTS} "
                               f"attempts ({text}); save less often or from fewer ranks, or raise its limits")
    if _transient(exc):
        return ConnectionError(f"cannot reach the storage service for {url} ({text}): is the endpoint right and "
                               "the server up?")
    if isinstance(exc, OSError):
        return exc
    return OSError(f"{url}: {text}")


def _attempts(what: str, url: object, call: Callable[[], T]) -> T:
    """``call()``, again after a throttling answer or a network error (at most `ATTEMPTS` times, backing off,
    each retry logged); any failure left becomes the `explain` ed `OSError`."""
    start = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except Exception as exc:  # the storage libraries raise many types: all are explained
            if attempt == ATTEMPTS or not _transient(exc) or time.monotonic() - start > RETRY_WINDOW_S:
                raise explain(exc, url) from exc
            delay = min(0.1 * 2 ** attempt, 5.0)
            logger.warning("{} {}: {} (attempt {} of {}; retrying in {:.1f} s)", what, url, _text(exc), attempt,
                           ATTEMPTS, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.contextmanager
def _as_checkpoint_error() -> Iterator[None]:
    """For the metadata operations whose callers expect no `OSError` (`kind`, `listdir`): a failure there (no
    access, no server) is the user's news, not a missing file."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(str(exc)) from exc


# --------------------------------------------------------------------------------------------------
# Streams


class _Upload(fs.WriteStream):
    """A streaming upload through an fsspec file object with ``autocommit=False`` where the backend has it (the
    object then appears only at `RemoteFileSystem.commit`). Data is handed over in pieces that fill the file's
    buffer to exactly one part, so at most one part (and the copy being sent) is held."""

    def __init__(self, store: RemoteFileSystem, path: RemotePath, lease: RemotePath | None) -> None:
        self._store, self.path, self.lease = store, path, lease
        self.written = 0
        self._file: Any = _attempts("opening for writing", path, lambda: store.open_for_write(path))
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
            _attempts("completing the upload of", self.path, self._file.commit)

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
        with _as_checkpoint_error():  # a server gone mid-load: the URL and the cause, not a bare ConnectionError
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

        info = _attempts("looking up", path, call)
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

        raw = _attempts("reading", path, call)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _put_small(self, path: pathlib.PurePath, value: Any, *, shown: pathlib.PurePath | None = None) -> None:
        """Write the small JSON object ``path`` (errors name ``shown``, the checkpoint it serves, when given)."""
        data = json.dumps(value).encode()
        _attempts("writing", shown or path, lambda: self._fs.pipe_file(self._key(path), data))

    def _delete(self, path: pathlib.PurePath) -> None:
        key = self._key(path)

        def call() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(key)

        _attempts("removing", path, call)

    def read_range(self, path: RemotePath, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object ``path`` (one ranged GET)."""
        return bytes(_attempts("reading", path, lambda: self._fs.cat_file(path.key, start=start, end=end)))

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
        with _as_checkpoint_error():
            info = self._info(path)
            if info is None:
                return "missing"
            if info.get("type") == "directory":
                return "dir"
            if info.get("type") != "file":
                return "other"
            return "file" if self._committed(path, info) else "missing"

    def _committed(self, path: pathlib.PurePath, info: Mapping[str, Any]) -> bool:
        """Whether the object ``path`` (whose fsspec ``info`` is given) has its commit object, of its size."""
        marker = self._read_small(self.commit_object(path))
        return isinstance(marker, dict) and marker.get("size") == info.get("size")

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
        key = self._key(directory)

        def call() -> list[str]:
            self._fs.invalidate_cache(key)
            try:
                return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in self._fs.ls(key, detail=False)]
            except (FileNotFoundError, NotADirectoryError):
                return []

        with _as_checkpoint_error():
            return _attempts("listing", directory, call)

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
        lease = None
        if target != path:  # the writer's temporary name: a lease naming the upload and its writer
            lease = path
            self._put_small(lease, {_LEASE_KEY: target.name, "host": socket.gethostname(), "pid": os.getpid()},
                            shown=target)
        try:
            return _Upload(self, target, lease)
        except BaseException:
            if lease is not None:
                self._delete(lease)
            raise

    def commit_stream(self, stream: fs.WriteStream) -> None:
        """Complete the upload of ``stream``, check its size, write its commit object, drop its lease."""
        if not isinstance(stream, _Upload):
            raise TypeError("not a stream of this file system")
        stream.complete()
        size = self.size(stream.path)
        if size != stream.written:
            raise OSError(f"{stream.path} holds {size} bytes after the upload, {stream.written} were sent; not "
                          "committed")
        self._put_small(self.commit_object(stream.path), {"size": size, "format": "distfn-commit-1"})
        if stream.lease is not None:
            self._delete(stream.lease)

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
        # the commit object first: a half-removed checkpoint is never taken for a committed one
        self._delete(self.commit_object(path))
        self._delete(path)

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
        if name and "/" not in name and not name.startswith(".") and name not in (".", ".."):
            target = path.with_name(name)
            # a committed checkpoint is never touched: not a committed file (a lease of either kind may name one, a
            # dead writer's or a hand-made one), not a directory whose index is committed
            if lease.get("dir") and self.kind(target) != "file" and self.kind(target / INDEX) != "file":
                self.remove_tree(target)
            elif not lease.get("dir"):
                self._abort_uploads(target)
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
        with _as_checkpoint_error():  # no access, no server: the user's news, not a missing file
            info = self._info(path)
            committed = info is not None and info.get("type") == "file" and self._committed(path, info)
        if info is not None and info.get("type") == "directory":
            raise IsADirectoryError(f"{path} is a directory")
        if info is None:
            raise FileNotFoundError(f"no committed object at {path}")
        if not committed:
            raise FileNotFoundError(f"{path} exists but has no commit object ({self.commit_object(path).name} of its "
                                    "size): a writer that did not finish, or a file not written through a URL (a "
                                    "checkpoint saved to a local path is read through that path, not file://)")
        return _Download(self, path, int(info.get("size") or 0))

    def publish(self, stream: fs.WriteStream, written: pathlib.PurePath, target: pathlib.PurePath) -> None:
        self.commit_stream(stream)


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
        url: any fsspec URL.
        storage_options: passed to the fsspec file system (``endpoint_url``, ``key``, ``secret``, ...), for this
            call only. ``None``: fsspec's configuration alone.

    Raises:
        CheckpointError: fsspec (or the protocol's library) is not installed, naming the extra to install.
    """
    fsspec = _fsspec(url)
    protocol = url.partition("://")[0].lower()
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
    key = target._strip_protocol(url)
    return store, store.path(str(key))
