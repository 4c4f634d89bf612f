"""Checkpoint URLs and object keys, decided by one rule: what may reach fsspec, and in which form.

An object store takes a key as it is written: ``run/../other/x`` is a key of its own to S3, but the HTTP layer
under s3fs (aiohttp) removes dot segments from the request path, so the request reads ``other/x``; a server or
proxy that decodes ``%2e%2e`` or ``%2F`` sees a different key again; a backslash is a separator to Windows, to
``file://`` on Windows and to some S3-compatible servers; a control character or a lone surrogate cannot be
sent at all (a bare ``UnicodeEncodeError`` from deep in botocore). distfn never writes such keys, so none of them
can name a checkpoint of its own: every one is refused (a `CheckpointError` naming the URL and the fix) or
skipped (a name found by listing).

The rule, applied to every URL a user passes (`parse`), to every key distfn derives from one before it reaches
fsspec (`key_problem`, through `distfn.checkpoint.remote.RemotePath.key`) and to every name a listing returns or
a commit object or lease holds (`name_problem`):

- the scheme is case-insensitive (``S3://`` is ``s3://``);
- empty segments (``a//b``, a trailing ``/``) and ``.`` segments are dropped: the canonical form has none, so
  ``s3://b//run/./ckpt-1`` and ``s3://b/run/ckpt-1`` are the same checkpoint (as they are on a local disk);
- ``..``, a backslash, control characters (C0, DEL, C1), lone surrogates, percent-escapes (``%2e``, ``%2F``,
  any ``%XX``: distfn never decodes them), ``?`` and ``#`` (s3fs cuts a key at ``?versionId=``, HTTP at ``#``) and
  bidirectional controls (a log would show another name) are refused;
- an object store's URL names a bucket first (``s3:///run`` is no bucket, not the bucket ``run``; on S3 and GCS
  the bucket holds no credentials, port or query), ``file://`` an absolute path (``file:///tmp/x``; fsspec reads
  ``file://tmp/x`` as ``./tmp/x``), and a key holds at most `MAX_KEY` bytes (S3's and GCS's limit).

No key that passes has a segment that could climb out of its prefix, so a path joined from a checked directory and
a checked name stays under that directory.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

import attrs

from ..errors import CheckpointError

__all__ = ["MAX_KEY", "Url", "is_url", "key_problem", "name_problem", "parse"]

#: The longest key (in UTF-8 bytes, bucket included) an object store takes: S3's and GCS's limit.
MAX_KEY: Final = 1024
_URL: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_ESCAPE: Final = re.compile(r"%[0-9A-Fa-f]{2}")
#: Characters an HTTP layer or s3fs reads as the end of the key ('?versionId=', '#fragment').
_QUERY: Final = frozenset("?#")
#: Unicode's bidirectional controls (embeddings, overrides, isolates, marks): shown, they reorder a name.
_BIDI: Final = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
#: What a bucket's name holds on S3 and GCS (other protocols, e.g. abfs's ``container@account``, are not checked).
_BUCKET: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BUCKETED: Final = ("s3", "s3a", "gs", "gcs")
#: Protocols whose keys are paths from a root ("/tmp/x"), not "bucket/key": no bucket to name.
_ROOTED: Final = ("file", "local", "memory")


def is_url(text: str) -> bool:
    """Whether ``text`` is written as a URL (``scheme://...``): the remote backend's, where a local path is not."""
    return _URL.match(text) is not None


def _segment_problem(segment: str) -> str | None:
    # one segment of a URL's path or of a key: the same rule for what a user writes and what distfn derives
    if segment == "..":
        return "is '..': it would climb out of its prefix on a server that resolves it: write the key without it"
    return _character_problem(segment)


def _character_problem(text: str) -> str | None:
    if "\\" in text:
        return "holds a backslash (a separator to Windows and to some servers): use '/'"
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            what = "a lone surrogate" if unicodedata.category(ch) == "Cs" else "a control character"
            return f"holds {what} (U+{ord(ch):04X}): no object store sends it as written"
    for ch in text:
        if ch in _QUERY:
            return (f"holds {ch!r}: s3fs reads '?versionId=' as a version query and an HTTP layer reads '#' as a "
                    "fragment, so the request would name another key: leave it out")
        if ch in _BIDI:
            return (f"holds the bidirectional control U+{ord(ch):04X}, which makes a log show another name than "
                    "the one written: leave it out")
    escape = _ESCAPE.search(text)
    if escape is not None:
        return (f"holds the percent-escape '{escape.group()}': distfn never decodes them (a server that does would "
                "read another key, '%2e%2e' is '..'): write the characters themselves")
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one entry of a directory (a listed name, one a commit object or lease holds), or
    ``None``: it must be a non-empty segment other than ``.`` and ``..``, without ``/`` and the characters the rule
    refuses."""
    if not isinstance(name, str):
        return f"is {type(name).__name__}, not a name"
    if name in ("", ".", ".."):
        return f"is {name!r}, not a name"
    if "/" in name:
        return "holds '/'"
    return _character_problem(name)


def key_problem(key: str) -> str | None:
    """Why the fsspec key ``key`` (``bucket/run/ckpt-1`` or ``/tmp/x``) must not be sent, or ``None``: a ``..``
    segment, a refused character, or more than `MAX_KEY` bytes. (``.`` and empty segments cannot occur: the
    paths keys are made from drop them.)"""
    for segment in key.split("/"):
        problem = _segment_problem(segment)
        if problem is not None:
            return f"segment {segment!r} {problem}"
    if not key.startswith("/") and len(key.encode()) > MAX_KEY:  # rooted keys are local paths: the OS decides
        return f"is longer than {MAX_KEY} bytes (the object stores' limit)"
    return None


@attrs.frozen
class Url:
    """A checkpoint URL in canonical form: a lower-case scheme and the key's segments, each checked."""

    scheme: str
    parts: tuple[str, ...]

    @property
    def rooted(self) -> bool:
        """Whether keys are paths from a root (``file://``, ``memory://``) rather than ``bucket/key``."""
        return self.scheme in _ROOTED

    @property
    def text(self) -> str:
        """The canonical URL: ``s3://bucket/run/ckpt-1``, ``file:///tmp/run`` (no empty or ``.`` segments, no
        trailing ``/``)."""
        return f"{self.scheme}://{'/' if self.rooted else ''}{'/'.join(self.parts)}"


def parse(url: str) -> Url:
    """The canonical form of the checkpoint URL ``url`` (see the module docstring).

    Raises:
        CheckpointError: ``url`` is not a URL, names no bucket (or a relative ``file://`` path), or holds a ``..``
            segment, a refused character or too long a key; the message names the URL and the fix.
    """
    if not isinstance(url, str):
        raise CheckpointError(f"a checkpoint URL must be a str, got {type(url).__name__}")
    found = _URL.match(url)
    if found is None:
        raise CheckpointError(f"{url!r} is not a URL (scheme://...)")
    scheme, rest = found.group(1).lower(), found.group(2)
    parts = tuple(p for p in rest.split("/") if p not in ("", "."))
    for part in parts:
        problem = _segment_problem(part)
        if problem is not None:
            raise CheckpointError(f"the checkpoint URL {url!r} cannot be used: its segment {part!r} {problem}")
    if scheme == "file" and not rest.startswith("/"):
        raise CheckpointError(f"the checkpoint URL {url!r} cannot be used: file:// needs an absolute path, "
                              f"file:///{'/'.join(parts) or 'path/to/dir'} (fsspec reads file://x as ./x)")
    if scheme not in _ROOTED and (not parts or rest.split("/")[0] in ("", ".")):
        # s3:///run must not read as the bucket "run": the bucket is the first thing written after '//'
        raise CheckpointError(f"the checkpoint URL {url!r} names no bucket: write {scheme}://bucket/path")
    if scheme in _BUCKETED and _BUCKET.match(parts[0]) is None:
        raise CheckpointError(f"the checkpoint URL {url!r} cannot be used: {parts[0]!r} is not a bucket name "
                              "(letters, digits, '.', '-' and '_'; no credentials, port or query): write "
                              f"{scheme}://bucket/path and pass the endpoint or keys in storage_options")
    parsed = Url(scheme, parts)
    if not parsed.rooted and len("/".join(parts).encode()) > MAX_KEY:
        raise CheckpointError(f"the checkpoint URL {url!r} cannot be used: its key is longer than {MAX_KEY} bytes "
                              "(the object stores' limit): use a shorter name")
    return parsed
