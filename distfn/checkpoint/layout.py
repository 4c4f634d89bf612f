"""What a checkpoint path names, decided once: `resolve` turns what the user passed into a `Location`.

A `Location` is a file system (`distfn.checkpoint.fs`) and an absolute path in it, with ``~`` expanded *before*
anything looks at the disk (``ctx.save(state, "~/ck/ckpt-1")`` and ``distfn.load("~/ck/ckpt-1")`` mean the same
directory). `Location.layout` says what is there: one ``.safetensors`` file, a sharded checkpoint directory (it
holds `INDEX`), another directory, or nothing. The names of step-numbered families live here too, for both
layouts: ``<prefix><step>.safetensors`` files and ``<prefix><step>`` directories (`step_of`).

URLs (``s3://``, ``gs://``, ``memory://``, ``file://``: any fsspec protocol) resolve to the remote backend
(`distfn.checkpoint.remote`, over fsspec, with commit objects); everything above this module works on both.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

import attrs
from loguru import logger

from ..errors import CheckpointError
from ..options import Mode, shards_state
from . import fs, remote, urls
from .names import INDEX, STEP_DIR, STEP_FILE, SUFFIX

__all__ = [
    "INDEX",
    "SUFFIX",
    "Layout",
    "Location",
    "check_keep",
    "resolve",
    "rotate",
    "step_of",
    "step_of_path",
    "wants_sharded",
]

#: What a location holds: one file, a sharded checkpoint directory, another directory, nothing, or something
#: that is not a checkpoint at all (a device, a socket).
Layout = Literal["file", "sharded", "dir", "missing", "other"]


@attrs.frozen
class Location:
    """A checkpoint path resolved: the file system, the absolute path in it, and the text the user gave."""

    fs: fs.FileSystem
    #: A `pathlib.Path` on a local disk; a `distfn.checkpoint.remote.RemotePath` (whose text is the URL) remote.
    path: pathlib.PurePath
    given: str
    #: The text ended in a separator (``"out/"``): the user named a directory.
    names_directory: bool = False
    #: `distfn.checkpoint.api.check_file_target` passed for it: a writer handed it does not check (and ask a
    #: remote store) again (``ctx.save`` checks before its collectives, then writes through `distfn.checkpoint.save`).
    checked: bool = attrs.field(default=False, eq=False)

    @property
    def name(self) -> str:
        """The last component (``ckpt-1200.safetensors``)."""
        return self.path.name

    @property
    def parent(self) -> Location:
        """The directory holding this location."""
        return Location(self.fs, self.path.parent, str(self.path.parent))

    def child(self, name: str) -> Location:
        """The entry ``name`` of this directory."""
        return Location(self.fs, self.path / name, str(self.path / name))

    def sibling(self, name: str) -> Location:
        """The entry ``name`` next to this one."""
        return Location(self.fs, self.path.with_name(name), str(self.path.with_name(name)))

    def layout(self) -> Layout:
        """What is at this location now (a directory counts as sharded once it holds `INDEX`)."""
        kind = self.fs.kind(self.path)
        if kind == "dir":
            return "sharded" if self.fs.kind(self.path / INDEX) != "missing" else "dir"
        return kind

    def __str__(self) -> str:
        return str(self.path)


def resolve(path: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The `Location` ``path`` names: ``~`` expanded and made absolute for a local path; a URL
    (``s3://bucket/run``) on its fsspec file system (`distfn.checkpoint.remote.locate`, which takes
    ``storage_options``), never a local directory named ``s3:``.

    A `Location` is returned as it is, and a `distfn.checkpoint.remote.RemotePath` (what a save or `latest` returned
    for a URL) keeps the file system it was resolved on, with that call's options: the options travel with the
    path, nothing remembers them per bucket. ``storage_options`` given with one resolves its URL with those instead.
    """
    if isinstance(path, Location):
        return path
    if isinstance(path, remote.RemotePath) and path.store is not None and storage_options is None:
        return Location(path.store, path, str(path))
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise CheckpointError("the checkpoint path is empty")
    if "\0" in text:  # no file system names such a file; os calls would raise a bare ValueError
        raise CheckpointError(f"the checkpoint path {text!r} holds a NUL byte: pass the path without it")
    trailing = text.endswith(("/", os.sep)) and text.strip("/" + os.sep) != ""
    if urls.is_url(text):  # the scheme test is the URL rule's own (`checkpoint/urls`)
        store, where = remote.locate(text, storage_options)
        return Location(store, where, text, trailing)
    if storage_options is not None:
        raise CheckpointError(f"storage_options= is for URLs (s3://...), not for the local path '{text}'")
    try:
        local = pathlib.Path(text).expanduser().absolute()
    except RuntimeError as exc:  # "~user" for a user this machine does not know
        raise CheckpointError(f"cannot expand '~' in the checkpoint path '{text}' ({exc}): write the path out "
                              "in full") from None
    if ".." in local.parts:
        # The kernel walks a ".." physically (after a symlink, to the link's parent; after a directory not made yet,
        # not at all), where os.path.realpath, which every "is it inside that directory?" check uses, drops a missing
        # part lexically. Creating the parents of such a path as given made the missing part where no check had
        # looked: inside a checkpoint directory (`consolidate(d, "alias/run/../..")` with alias -> d, found by a
        # property test). One meaning for the checks and the writes: the resolved one (the last part kept as it is,
        # a symlink there is the writer's to replace).
        if local.parts[-1] == "..":
            local = pathlib.Path(os.path.realpath(local))
        else:
            local = pathlib.Path(os.path.realpath(local.parent)) / local.name
    return Location(fs.LOCAL, local, text, trailing)


def step_of(name: str, *, directory: bool = False) -> tuple[str, int] | None:
    """``(prefix, step)`` of a step-numbered name, or ``None`` (hidden names never count: writers' temporaries).

    Args:
        name: a file name (``ckpt-1200.safetensors``) or, with ``directory=True``, a sharded checkpoint
            directory's name (``ckpt-1200``).
        directory: which of the two layouts' names to parse.
    """
    m = (STEP_DIR if directory else STEP_FILE).match(name)
    if m is None or name.startswith("."):
        return None
    return m.group("prefix"), int(m.group("step"))


def check_keep(keep: int | None, target: Location, *, directory: bool) -> None:
    """Refuse a ``keep=`` that is not a positive int, or one given with a name that has no step number."""
    if keep is None:
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep= must be a positive int or None, got {keep!r}")
    if step_of(target.name, directory=directory) is None:
        example = "ckpt-1200" if directory else "ckpt-1200.safetensors"
        what = "directory" if directory else "file"
        raise CheckpointError(f"keep= needs a step-numbered {what} name such as '{example}', got '{target.name}'")


def wants_sharded(path: str | os.PathLike[str], mode: Mode, sharded: bool | None) -> bool:
    """The rule of ``ctx.save``: ``sharded=`` when given, else sharded in ``mode="fsdp"`` exactly when the path
    does not end in ``.safetensors`` (``ckpt/step-1200`` is a directory, ``ckpt-1200.safetensors`` one file)."""
    if sharded is not None:
        return bool(sharded)
    return shards_state(mode) and not os.fspath(path).endswith(SUFFIX)


def step_of_path(path: str | os.PathLike[str]) -> int | None:
    """The step number in a checkpoint's name (``ckpt-1200.safetensors`` or a sharded ``ckpt-1200`` directory)."""
    name = pathlib.Path(os.fspath(path)).name
    parsed = step_of(name) or step_of(name, directory=True)
    return None if parsed is None else parsed[1]


def rotate(target: Location, keep: int) -> None:
    """Keep ``target`` and the ``keep - 1`` newest other checkpoints of its family; delete the rest.

    The family is the entries of ``target``'s directory with its layout (files for a file, sharded checkpoint
    directories for a directory) and its prefix (``ckpt-`` in ``ckpt-1200``), ordered by step number.
    """
    directory = target.layout() == "sharded"
    parsed = step_of(target.name, directory=directory)
    if parsed is None:
        check_keep(keep, target, directory=directory)  # raises: no step number
        return
    found = []
    for name in target.fs.listdir(target.path.parent):
        s = step_of(name, directory=directory)
        entry = target.sibling(name)
        if s is not None and s[0] == parsed[0] and name != target.name and entry.layout() == target.layout():
            found.append((s[1], name, entry))
    for _, _, entry in sorted(found, reverse=True)[keep - 1:]:
        if directory:
            target.fs.remove_tree(entry.path)
        else:
            target.fs.remove(entry.path)
        logger.debug("keep={}: removed {}", keep, entry)
