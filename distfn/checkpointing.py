"""What ``ctx.save`` / ``ctx.load`` / ``ctx.resume`` do, decided here; ``Context``'s methods only forward.

The decisions, each made once:

- **which layout**: a sharded directory (`distfn.checkpoint.layout.wants_sharded`: ``sharded=``, else
  ``mode="fsdp"`` and no ``.safetensors`` suffix), FSDP full state dicts gathered into one file
  (`distfn.fsdp_state`), or one file written by rank 0; a load asks what the path *is*
  (`distfn.checkpoint.layout.Location.layout`), after ``~`` is expanded;
- **the collectives' order**: every rank checks in (the run's `distfn.checkin.CheckIn`) *before* the RNG gather, so a
  rank-0-only call fails there instead of hanging in it;
- **blocking or background**: ``blocking=False`` hands the write to the run's `background.Saves`, whose
  pending save every later call waits for first.

Every rank gets the same resolved path back. Paths that differ across ranks are an error wherever the ranks meet
in a collective anyway (sharded saves, ``rng=True``), and a one-time warning where they do not.

This module is the run's use of the checkpoint library, beside `distfn.context`, not part of it: it needs the run
state (`distfn.run`), the collectives and `distfn.fsdp_state`, which all sit above `distfn.checkpoint`; the
package below imports none of them back (issue 40 item 4).
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal, TypeAlias

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from . import checkpoint, collectives, fsdp_state
from .checkpoint import api, restore
from .checkpoint import sharded as directories
from .checkpoint.layout import Location, check_keep, resolve, step_of_path, wants_sharded
from .checkpoint.sharded.write import Rider
from .errors import CheckpointError, ConfigError
from .options import Mode, shards_state
from .rng import gather_rng_states, rng_state_for_rank, seed_all, set_rng_state
from .run import Run

__all__ = ["IF_PRESENT", "RngRestore", "load_state", "resume_state", "save_state"]

#: ``ctx.load(..., rng=IF_PRESENT)``: restore the RNG states when the checkpoint holds them, go on without them when
#: it does not (what ``ctx.resume`` does). ``rng=True`` stays strict: a checkpoint without them is an error there.
IF_PRESENT: Literal["if-present"] = "if-present"
RngRestore: TypeAlias = bool | Literal["if-present"]
#: ``ctx.resume(..., start=)``: continue when there is a checkpoint, there must be one, there must be none.
Start: TypeAlias = Literal["auto", "resume", "fresh"]
STARTS: tuple[Start, ...] = ("auto", "resume", "fresh")


_PER_RANK = r"rank[-_=.]?0*{rank}(?!\d)"


_WARNED: set[str] = set()  # the one-time warnings this process gave


def _warn_per_rank(given: str, rank: int) -> None:
    if "per-rank" in _WARNED:
        return
    _WARNED.add("per-rank")
    logger.warning("ctx.save('{}') on rank {}: ctx.save writes one checkpoint for the whole job, from rank 0 (this "
                   "rank only gets the path back), so a per-rank name is never written here. For one file per rank "
                   "call distfn.checkpoint.save(obj, path) on every rank.", given, rank)


def _same_path_everywhere(target: Location) -> None:
    """Raise on every rank when the ranks resolved different paths (a collective: call it where one runs anyway)."""
    paths = collectives.gather_object(str(target))
    if len(set(paths)) > 1:
        shown = ", ".join(f"rank {r}: '{p}'" for r, p in enumerate(paths[:4])) + (" ..." if len(paths) > 4 else "")
        raise CheckpointError(f"ctx.save got different paths on different ranks ({shown}); it writes one checkpoint "
                              "for the whole job. Pass the same path on every rank, or call "
                              "distfn.checkpoint.save(obj, path) on every rank for one file per rank.")


def _shared(loc: Location, call: str) -> None:
    """Refuse a per-process store (``memory://``) in a job of several processes: each would save into its own
    memory, every save would "succeed", and a resume would silently start from step 0."""
    if loc.fs.per_process and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError(f"{call}('{loc}'): memory:// is this process's own memory, and this job has "
                              f"{dist.get_world_size()} processes: a checkpoint saved there is invisible to the "
                              "others and lost when the process ends. Use a shared store (s3://, gs://, a local or "
                              "shared directory)")


def save_state(
    obj: nn.Module | Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    mode: Mode,
    rank: int,
    run: Run,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    rng: bool | Mapping[str, Any] | None = None,
    sharded: bool | None = None,
    blocking: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> pathlib.PurePath:
    """``ctx.save``: see its docstring for the contract; the module docstring for the decisions.

    Returns:
        The resolved absolute path, the same on every rank.
    """
    run.saves.wait()  # the previous (asynchronous) save first; its failure is raised here
    if run.tracking is not None:  # rank 0: the tracked run's key, so that a re-run which resumes continues it
        metadata = run.tracking.stamp(metadata)
    target = resolve(path, storage_options)
    _shared(target, "ctx.save")  # on every rank alike, before any collective
    as_directory = wants_sharded(path, mode, sharded)
    if not as_directory:  # checks that need no collective fail on every rank alike, before any collective
        check_keep(keep, target, directory=False)
        target = api.check_file_target(target)  # marked checked: the writer below does not ask the store again
        # with rng=True the ranks meet in a collective below, where different paths are an error instead
        if rng is not True and rank != 0 and re.search(_PER_RANK.format(rank=rank), target.given, re.IGNORECASE):
            _warn_per_rank(target.given, rank)
    checked_in = False
    if rng is not True and rng is not False and rng is not None and not isinstance(rng, Mapping):
        raise ConfigError(f"ctx.save(..., rng={rng!r}): rng takes None (the default: every rank's streams at its "
                          "last ctx.step), True (gathered at the call, every rank calls ctx.save), False (none) or "
                          "an RNG state to write (distfn.checkpoint.rng_state())")
    rider = None
    if rng is not True and rng is not False and isinstance(obj, Mapping) and "rng" not in obj:
        obj, checked_in, rider = _with_streams(obj, rng, run, rank=rank, directory=as_directory,
                                               every_rank=as_directory or shards_state(mode))
    if rng is True:
        if not isinstance(obj, Mapping):
            raise ConfigError("ctx.save(..., rng=True) needs a training-state mapping such as "
                              "{'model': model, 'optimizer': opt, 'step': step}")
        # every rank checks in before the RNG gather: a rank-0-only call must fail there, not hang in it
        checked_in = run.check_in("ctx.save", rng=True)
        with run.collective("gather_object"):  # the run's hook: ledger, deadline, timing (distfn.run)
            obj = {**obj, "rng": gather_rng_states()}
            _same_path_everywhere(target)  # every rank is in a collective here anyway
    if as_directory:
        if not checked_in:
            run.check_in("ctx.save")  # every rank writes its shards: a rank-0-only call fails here
        return directories.save(obj, target, saves=run.saves, metadata=metadata, keep=keep, blocking=blocking,
                                rider=rider, hook=run.collective("gather_object"))
    # the package's public `save`, looked up at the call: what ctx.save writes with is what the docs name (and
    # what a test or a user's wrapper replaces to observe real writes)
    write = checkpoint.save if blocking else functools.partial(run.saves.save_file, save=checkpoint.save)
    if shards_state(mode):
        fsdp_state.save(obj, target, rank=rank, metadata=metadata, keep=keep, checked_in=checked_in, write=write,
                        run=run)
    elif rank == 0:
        write(obj, target, metadata=metadata, keep=keep)
    return target.path


def _with_streams(obj: Mapping[str, Any], rng: Mapping[str, Any] | None, run: Run, *, rank: int, directory: bool,
                  every_rank: bool) -> tuple[Mapping[str, Any], bool, Rider | None]:
    """The state plus the generator states to write, whether the ranks checked in for it, and the sharded save's
    `Rider` that brings them instead: ``rng`` as given, or (default) every rank's at its last ``ctx.step``
    (`distfn.boundary`). A save every rank calls (``every_rank``: sharded, ``mode="fsdp"``) checks in first (a
    call on rank 0 alone is then an error, not a hang) and brings them in one collective: a sharded save
    (``directory``) in its own planning all-gather (the rider), ``mode="fsdp"``'s one file in a gather of their
    own; a one-file save, which rank 0 may make alone, asks the other ranks over the store."""
    if rng is not None:
        return ({**obj, "rng": rng} if rank == 0 else obj), False, None
    if every_rank:
        checked_in = run.check_in("ctx.save", rng=True)  # one check-in, before the one collective
        if directory and _plain_keys(obj):
            return obj, checked_in, _streams_rider(run)
        with run.collective("gather_object"):
            return _with_found(obj, run.boundaries.gathered()), checked_in, None
    return (_with_found(obj, run.boundaries.collect()) if rank == 0 else obj), False, None


def _plain_keys(obj: Mapping[Any, Any]) -> bool:
    """Whether ``obj``'s keys are all str (not ``__``-tagged): a state the streams' entries can be appended to."""
    return all(isinstance(k, str) and not k.startswith("__") for k in obj)


def _streams_rider(run: Run) -> Rider:
    """What a sharded ``ctx.save`` carries in its planning all-gather: this rank's snapshot of its last
    ``ctx.step`` (``None`` before one), turned into the ``rng`` and ``per_rank`` entries (`_with_found`'s) on every
    rank alike, so the save makes one object collective, not a gather of the streams and then the planning's."""
    boundaries = run.boundaries

    def entries(snapshots: list[Any]) -> dict[str, Any] | None:
        found = boundaries.combine(snapshots)
        if found is None:
            return None
        streams, per_rank = found
        return {"rng": streams} if per_rank is None else {"rng": streams, "per_rank": per_rank}

    return Rider(own=boundaries.own(), entries=entries, replaces=frozenset({"rng", "per_rank"}))


def _with_found(obj: Mapping[str, Any], found: tuple[dict[str, Any], dict[str, Any] | None] | None
                ) -> Mapping[str, Any]:
    """``obj`` with every rank's streams of its last ``ctx.step`` and the per-rank values kept there, if found."""
    if found is None:
        return obj
    streams, per_rank = found
    out = {**obj, "rng": streams}
    out.pop("per_rank", None)  # what a resume put there is this rank's alone: the boundary's, every rank's, instead
    if per_rank is not None:
        out["per_rank"] = per_rank
    return out


def load_state(
    path: str | os.PathLike[str] | Location,
    into: nn.Module | Mapping[str, Any],
    *,
    mode: Mode,
    rank: int,
    world_size: int,
    device: torch.device,
    run: Run,
    strict: bool = True,
    rng: RngRestore = False,
    storage_options: Mapping[str, Any] | None = None,
    restored: list[bool] | None = None,
) -> dict[str, Any]:
    """``ctx.load``: the reader is chosen by what ``path`` is (a sharded directory: every rank reads its own
    slices, any world size and mode; a file: FSDP scatter in fsdp mode, else a plain restore).

    ``rng``: False leaves the RNG states alone (a saved ``"rng"`` entry is returned with the other values); True
    restores them and refuses a checkpoint without them; `IF_PRESENT` restores them when saved and goes on
    without them otherwise (a debug log says so). Another string is refused before anything is read.
    ``restored``: a list this call appends whether it restored RNG states to (``ctx.resume``'s log line).
    Per-rank values saved with the streams (``ctx.step(..., per_rank=)``) come back as this rank's alone.
    """
    if isinstance(rng, str) and rng != IF_PRESENT:  # a misspelt mode would otherwise be truthy, i.e. strict
        raise ConfigError(f"ctx.load(..., rng={rng!r}): rng takes True (restore the saved RNG states, an error when "
                          f"the checkpoint has none), {IF_PRESENT!r} (restore them when saved) or False")
    run.saves.wait()  # a pending asynchronous save (perhaps of this very path) lands first
    loc = resolve(path, storage_options)
    if loc.layout() in ("sharded", "dir"):  # a directory is read as a sharded checkpoint (or says why it is not)
        values = directories.load_into(loc, into, device=device, strict=strict)
    elif shards_state(mode):
        values = fsdp_state.load(loc, into, device=device, strict=strict, run=run)
    else:
        values = restore.load_into(loc, into, device=device, strict=strict)
    _per_rank_back(values, into, rank)
    if rng:
        saved = values.pop("rng", None)
        if restored is not None:  # ctx.resume's line says whether the streams were there
            restored.append(saved is not None)
        if saved is not None:
            _restore_streams(saved, rank, world_size, run.rank_seed)
        elif rng != IF_PRESENT:
            raise CheckpointError(f"{loc} holds no RNG states; write it with ctx.save(..., rng=True), or load it with "
                                  f"rng={IF_PRESENT!r} to restore them only when saved")
        else:
            logger.debug("ctx.load: {} holds no RNG states; the generators are left as they are", loc)
    return values


def _per_rank_back(values: dict[str, Any], into: Any, rank: int) -> None:
    """This rank's per-rank values (``ctx.step(..., per_rank=)``) out of every rank's, into ``into["per_rank"]``
    (when the state has that key) and the returned values; ``None`` for a rank the checkpoint has none for."""
    saved = values.get("per_rank")
    if not isinstance(saved, Mapping) or "ranks" not in saved or "world_size" not in saved:
        return
    ranks = list(saved["ranks"])
    mine = dict(ranks[rank]) if rank < len(ranks) and ranks[rank] else None
    values["per_rank"] = mine
    if isinstance(into, MutableMapping) and "per_rank" in into:
        into["per_rank"] = mine


def _restore_streams(saved: Mapping[str, Any], rank: int, world_size: int, rank_seed: int | None) -> None:
    """Restore this rank's generators from the saved entry. Under ``rank_seeds=True`` a rank the checkpoint has no
    stream for (a resume on more ranks) starts its own stream ``seed + rank`` instead of repeating another rank's."""
    ranks = saved.get("ranks")
    if rank_seed is not None and isinstance(ranks, list) and rank >= len(ranks):
        seed_all(rank_seed)
        if rank == len(ranks):  # said once, by the first new rank
            logger.warning("RNG states were saved by {} ranks, this job has {}: ranks {}..{} start their own streams "
                           "(seed + rank, rank_seeds=True); the saved ranks continue theirs", len(ranks), world_size,
                           len(ranks), world_size - 1)
        return
    if rank_seed is not None and isinstance(ranks, list) and world_size < len(ranks) and rank == 0:
        logger.warning("RNG states were saved by {} ranks, this job has {}: the streams of ranks {}..{} end here; "
                       "ranks 0..{} continue theirs", len(ranks), world_size, world_size, len(ranks) - 1,
                       world_size - 1)
    if rank_seed is not None and isinstance(ranks, list):
        set_rng_state(ranks[rank])
        return
    set_rng_state(rng_state_for_rank(saved, rank, world_size))


def resume_state(
    state: nn.Module | Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    mode: Mode,
    rank: int,
    world_size: int,
    device: torch.device,
    run: Run,
    prefix: str = "ckpt-",
    strict: bool = True,
    start: Start = "auto",
    restart: int = 0,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """``ctx.resume``: rank 0 picks the newest complete checkpoint (`distfn.checkpoint.latest`), every rank loads
    that one and restores its RNG states when they were saved; returns its step (0: none, ``state`` untouched).

    ``start``: ``"auto"`` continues when there is a checkpoint; ``"resume"`` refuses a directory without one;
    ``"fresh"`` refuses one that holds checkpoints on the job's first attempt (``restart`` 0 and no
    ``SLURM_RESTART_COUNT``; a restarted or requeued attempt continues its own). Rank 0 logs one line saying what
    it restored, or that the run starts fresh."""
    if start not in STARTS:
        raise ConfigError(f"ctx.resume(..., start={start!r}): start takes 'auto' (continue from the newest "
                          "checkpoint when there is one), 'resume' (there must be one) or 'fresh' (there must be "
                          "none, except in a restarted attempt)")
    run.saves.wait()  # a pending asynchronous save counts: it may be the newest checkpoint
    d = resolve(directory, storage_options)  # on every rank, with its options: the load below uses this location
    _shared(d, "ctx.resume")
    found = api.latest_location(d, prefix=prefix) if rank == 0 else None
    # the entry's name only: every rank rebuilds the location from its own directory (its file system, its options)
    with run.collective("broadcast_object"):  # a collective every rank makes
        name = collectives.broadcast_object(None if found is None else found.name)
    if name is None:
        if start == "resume":
            raise CheckpointError(f"ctx.resume('{d}', start='resume'): no complete checkpoint named {prefix}<step> "
                                  "there; point it at the directory the run saved to, or use start='auto' to start "
                                  "fresh when there is none")
        if rank == 0:
            logger.info("ctx.resume: no checkpoint in {}: a fresh start", d)
        run.boundaries.mark()  # a save before the first ctx.step writes the streams as they are here
        return 0
    last = d.child(name)
    step = step_of_path(last.path) or 0
    # a restarted attempt (ctx.restart) or a requeued Slurm job continues its own checkpoints
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")
    if start == "fresh" and restart == 0 and not requeued:
        raise CheckpointError(f"ctx.resume('{d}', start='fresh'): the directory already holds checkpoints (the newest "
                              f"is {name}, step {step}); a fresh run would continue it. Point the run at an empty "
                              "directory, delete them, or pass start='auto' to continue")
    if run.tracking is not None and run.tracking.active:  # rank 0: continue the run the checkpoint belongs to
        run.tracking.adopt(api.read_metadata(last))
    streams: list[bool] = []
    load_state(last, state, mode=mode, rank=rank, world_size=world_size, device=device, run=run, strict=strict,
               rng=IF_PRESENT, restored=streams)
    # a boundary on every rank: a save before the next ctx.step writes the restored streams (and per-rank values)
    run.boundaries.mark(state.get("per_rank") if isinstance(state, Mapping) else None)
    if rank == 0:
        logger.info("ctx.resume: restored {} (step {}{}); {}", last, step, _position(state),
                    "every rank's random streams restored" if streams[0] else "no random streams saved: fresh ones")
    return step


def _position(state: Any) -> str:
    """``, epoch E, batch B`` of the first data loader in ``state`` (as it will continue), or nothing."""
    if isinstance(state, Mapping):
        for value in state.values():
            if hasattr(value, "state_dict") and hasattr(value, "next_epoch"):
                where = value.state_dict()
                return f", epoch {where['epoch']}, batch {where['batches']}"
    return ""

