"""Every rank's random streams at its last step boundary, for a checkpoint that rank 0 writes alone.

Why: an exact resume needs every rank's generator states, but the universal idiom saves from rank 0 alone
(``if ctx.is_main: ctx.save(...)``), and a loop that prefetches its next batch has already drawn from the
generators when it reaches the save. So each rank snapshots its generators (`distfn.rng.rng_state`, in memory, no
collective, no store) at every ``ctx.step`` and ``ctx.resume``, the step boundaries every rank passes equally
often, and keeps the
last `RING` snapshots, each numbered by its boundary count (the same number on every rank of an SPMD loop). A
save on rank 0 at boundary ``n`` asks the others for their snapshot ``n`` on the run's channel
(`distfn.rankstore`): each rank's responder thread answers from its ring, waiting for its own main thread when it
is behind. No collective and no hidden wait on the other ranks' main threads: a rank that has finished its function
has posted its last snapshot (`Boundaries.close`), which answers a final save after the loop.

Per-rank values (``ctx.step(opt, per_rank={"X": X, "Y": Y})``, a prefetched batch) are kept with the snapshot of
the same boundary and travel the same way; tensors are encoded by dtype, shape and raw bytes, never pickled.

Cost: one conversion-free copy per ``ctx.step`` of the generators' states that moved since the last one
(`distfn.rng.raw_rng_state`: NumPy's and Python's are reused while unchanged); ``bench/bench_step.py`` times it
in the training loop and compares steps with it on and off (``DISTFN_RNG_CAPTURE=0`` turns it off); the answering
thread of each rank other than 0 blocks in the store's own ``wait`` (no polling); per save on rank 0, one request
and one answer (a few KiB) per rank.

Imports: `errors`, `rankstore`, `rng`.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from loguru import logger

from .errors import CheckpointError, ConfigError
from .rankstore import Channel, poll
from .rng import combine_rng_states, raw_rng_state, rng_state_of

__all__ = ["RING", "Boundaries", "capture_enabled", "decode_answer", "decode_tensor", "encode_tensor"]

#: Snapshots each rank keeps: how far another rank may run ahead of a saving rank 0 (in ``ctx.step`` calls).
RING: Final = 16
_STOP: Final = b"stop"  # what a rank writes under its own request key to end its answering thread
_DTYPES: Final = {str(d).removeprefix("torch."): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}


def capture_enabled() -> bool:
    """Whether ``ctx.step`` snapshots the generators (``DISTFN_RNG_CAPTURE=0`` turns it off)."""
    return os.environ.get("DISTFN_RNG_CAPTURE", "1") != "0"


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: dtype, shape, base64 of its bytes (no pickle)."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"per_rank values of dtype {t.dtype} are not supported; use one of {sorted(_DTYPES)}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def decode_tensor(d: Mapping[str, Any]) -> torch.Tensor:
    """The tensor `encode_tensor` wrote (a `CheckpointError` for anything else)."""
    try:
        dtype, shape, raw = _DTYPES[str(d["dtype"])], [int(s) for s in d["shape"]], base64.b64decode(d["data"])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"a rank's boundary snapshot holds a malformed tensor: {exc}") from exc


def _check_values(values: Any) -> dict[str, torch.Tensor] | None:
    if values is None:
        return None
    if not isinstance(values, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in values.items()):
        raise ConfigError("ctx.step(..., per_rank=...) takes a {name: tensor} mapping, e.g. per_rank={'X': X, "
                          "'Y': Y} for a prefetched batch")
    return dict(values)


def _encode(n: int, state: Mapping[str, Any], values: Mapping[str, torch.Tensor] | None) -> str:
    out: dict[str, Any] = {"n": n, "python": state["python"], "numpy": state["numpy"],
                           "torch": encode_tensor(state["torch"])}
    if "cuda" in state:
        out["cuda"] = [encode_tensor(t) for t in state["cuda"]]
    if values is not None:
        out["values"] = {k: encode_tensor(v) for k, v in values.items()}
    return json.dumps(out)


def decode_answer(raw: bytes) -> tuple[int, dict[str, Any] | None, dict[str, torch.Tensor] | None, str | None]:
    """``(n, rng state, values, why missing)`` of one posted answer; a `CheckpointError` for anything else."""
    try:
        d = json.loads(raw)
        if "missing" in d:
            return int(d["n"]), None, None, str(d["missing"])
        state: dict[str, Any] = {"python": list(d["python"]), "numpy": dict(d["numpy"]),
                                 "torch": decode_tensor(d["torch"])}
        if "cuda" in d:
            state["cuda"] = [decode_tensor(t) for t in d["cuda"]]
        values = {str(k): decode_tensor(v) for k, v in d["values"].items()} if "values" in d else None
        return int(d["n"]), state, values, None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"a rank's boundary snapshot is malformed: {exc!r}") from exc


def _entries_to_save(states: list[Any], values: list[Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Every rank's snapshot as a checkpoint holds it: the combined ``rng`` entry, and the ``per_rank`` values
    entry (``None`` when no rank kept any)."""
    per_rank = None
    if any(v is not None for v in values):
        per_rank = {"world_size": len(values), "ranks": [v or {} for v in values]}
    return combine_rng_states(states), per_rank


class Boundaries:
    """This rank's snapshots at its ``ctx.step`` boundaries; on ranks other than 0, the thread that answers rank
    0's requests for them (see the module docstring).

    Attributes:
        count: the boundaries this rank has passed in this run (``ctx.step`` calls).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, *, enabled: bool | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.enabled = capture_enabled() if enabled is None else enabled
        self.count = 0
        self._ring: collections.deque[tuple[int, tuple[Any, ...], dict[str, torch.Tensor] | None]] = \
            collections.deque(maxlen=RING)
        self._moved = threading.Condition()
        self._channel: Channel | None = None
        self._wait_s = 20.0  # `connect` sets the run's
        self._asked = 0  # rank 0: requests sent so far
        self._stop = threading.Event()
        self._serving = 1  # ranks other than 0: the number of the request the thread waits for
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()
        self._gave_up = False  # rank 0: a rank did not answer once; later saves do not wait for it again

    # -- every rank -------------------------------------------------------------------------------------------
    def mark(self, per_rank: Mapping[str, torch.Tensor] | None = None) -> None:
        """A step boundary: snapshot the generators (and ``per_rank``, held by reference) as boundary ``count``."""
        values = _check_values(per_rank)
        if not self.enabled:
            return
        state = raw_rng_state()  # converted only when a save asks for it
        with self._moved:
            self.count += 1
            self._ring.append((self.count, state, values))
            self._moved.notify_all()

    def _entry(self, n: int) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None] | None:
        with self._moved:
            found = next(((raw, values) for m, raw, values in self._ring if m == n), None)
        return None if found is None else (rng_state_of(found[0]), found[1])

    def connect(self, channel: Channel, *, wait_s: float) -> None:
        """Speak on ``channel`` (the run's ``boundary`` child); on ranks other than 0 start the answering thread."""
        self._channel = channel
        self._wait_s = wait_s
        if self.rank != 0 and self.enabled:
            try:
                own = channel.clone()  # the thread's own connection: two threads must not share a socket
            except (AttributeError, RuntimeError):  # a store that cannot be cloned (an in-process HashStore)
                own = channel
            self._thread = threading.Thread(target=self._serve, args=(own,), daemon=True, name="distfn-boundary")
            self._thread.start()

    def close(self) -> None:
        """The function is over on this rank: post its last snapshot (a final save on rank 0 may still ask for it)
        and stop the thread."""
        self._stop.set()
        with self._moved:
            self._moved.notify_all()
            last = self._ring[-1] if self._ring else None
        if self._channel is not None and self.rank != 0 and last is not None:
            try:
                self._channel.post("final", _encode(last[0], rng_state_of(last[1]), last[2]))
            except Exception as exc:  # noqa: BLE001 - a store already gone: a final save will say so
                logger.debug("boundary: could not post the last snapshot: {}", exc)
        if self._thread is not None:
            try:  # wake the thread out of its wait (a request rank 0 sends later finds the last snapshot instead)
                assert self._channel is not None
                with self._moved:
                    serving = self._serving
                self._channel.set(f"want/{serving}/{self.rank}", _STOP.decode())
            except Exception as exc:  # noqa: BLE001 - a daemon thread: it ends with the process anyway
                logger.debug("boundary: could not wake the answering thread: {}", exc)
            self._thread.join(timeout=2)

    # -- ranks other than 0: the answering thread ---------------------------------------------------------------
    def _serve(self, channel: Channel) -> None:
        try:
            while not self._stop.is_set():
                want = f"want/{self._serving}/{self.rank}"
                channel.block(want)  # no polling: rank 0's request (or this rank's own close) wakes it
                raw = channel.get(want)
                if raw == _STOP or self._stop.is_set():
                    return
                channel.post(f"got/{self._serving}", self._answer(int(raw)))
                with self._moved:  # `close` reads it under the same lock: it wakes the wait this thread enters next
                    self._serving += 1
        except Exception as exc:  # noqa: BLE001 - the store went away (the job is being torn down): nothing to do
            logger.trace("boundary thread of rank {} ends: {}", self.rank, exc)

    def _answer(self, n: int) -> str:
        with self._moved:  # behind rank 0: wait (bounded) for this rank's own boundary n
            self._moved.wait_for(lambda: self.count >= n or self._stop.is_set(), timeout=self._wait_s)
            count = self.count
        entry = self._entry(n)
        if entry is not None:
            return _encode(n, *entry)
        why = (f"it had passed {count} ctx.step boundaries when rank 0 saved at boundary {n}" if count < n else
               f"it was {count - n} ctx.step calls ahead of rank 0, more than the {RING} it keeps")
        return json.dumps({"n": n, "missing": why})

    # -- rank 0, in ctx.save ------------------------------------------------------------------------------------
    def collect(self) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """Rank 0: ``(rng entry, per-rank values entry or None)`` of every rank at boundary `count`, ready to save;
        ``None`` (and one line, once) when some rank's streams cannot be had."""
        if not self.enabled or self._gave_up:
            return None
        n = self.count
        if n == 0:
            self._once("none", "ctx.save: no ctx.step or ctx.resume has run yet, so the ranks' random streams are "
                               "not saved (they are taken at each ctx.step; a loop without ctx.step saves them "
                               "with ctx.save(..., rng=True) called on every rank)")
            return None
        own = self._entry(n)
        assert own is not None  # rank 0's newest entry is boundary n
        states: list[Any] = [own[0]]
        values: list[Any] = [own[1]]
        if self.world_size > 1:
            answers = self._ask(n)
            if answers is None:
                return None
            for _, state, vals, _ in answers:
                states.append(state)
                values.append(vals)
        return _entries_to_save(states, values)

    def gathered(self) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """Every rank, inside a save that every rank calls (``mode="fsdp"``'s one file): like `collect`, but each
        rank's newest snapshot (`own`) travels in one ``all_gather_object`` (the ranks meet in a collective there
        anyway, so the store's request and answer are not needed), combined by `combine`. Call it inside the run's
        collective hook. A sharded save carries `own` in its planning collective instead (no collective here)."""
        from . import collectives  # deferred: collectives imports torch.distributed's object collectives

        return self.combine(collectives.gather_object(self.own()))

    def own(self) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None] | None:
        """This rank's newest snapshot as it travels to the other ranks (picklable), ``None`` before its first
        ``ctx.step`` or with the capture off."""
        return self._entry(self.count) if self.enabled and self.count else None

    def combine(self, entries: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor] | None] | None]
                ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """Every rank's `own`, in rank order, as a checkpoint holds them (see `collect`): the same answer on every
        rank from the same gathered list, ``None`` on every rank alike (one line, once, on rank 0) when a rank has
        no snapshot."""
        if any(e is None for e in entries):
            if self.rank == 0:
                self._once("none", "ctx.save: a rank has passed no ctx.step or ctx.resume yet (or its capture is "
                                   "off), so the ranks' random streams are not saved; ctx.save(..., rng=True) saves "
                                   "them as they are at the call")
            return None
        found = [e for e in entries if e is not None]
        return _entries_to_save([state for state, _ in found], [v for _, v in found])

    def _ask(self, n: int) -> list[Any] | None:
        channel = self._channel
        if channel is None:
            self._once("store", "ctx.save: this job's process group has no store, so the other ranks' random streams "
                                "cannot reach rank 0; save them with ctx.save(..., rng=True) on every rank")
            return None
        self._asked += 1
        asked = self._asked
        others = range(1, self.world_size)
        for r in others:  # one key per rank: each answering thread blocks on its own
            channel.set(f"want/{asked}/{r}", str(n))
        got: dict[int, bytes] = {}
        for _ in poll(self._wait_s):
            got.update(channel.read(f"got/{asked}", [r for r in others if r not in got]))
            for r, raw in channel.read("final", [r for r in others if r not in got]).items():
                if json.loads(raw).get("n") == n:  # a rank that finished: its last boundary is the one asked
                    got[r] = raw
            if len(got) == len(others):
                break
        late = [r for r in others if r not in got]
        if late:  # not asked again: every later save would wait as long
            self._gave_up = True
            self._once("late", f"ctx.save: rank(s) {late} did not send their random streams of ctx.step boundary {n} "
                               f"within {self._wait_s:.0f} s, so this checkpoint and the later ones hold none (a "
                               "resume continues with fresh streams); do all ranks call ctx.step equally often?")
            return None
        try:
            answers = [decode_answer(got[r]) for r in others]
        except CheckpointError as exc:
            self._once("malformed", f"ctx.save: {exc}; this checkpoint holds no random streams")
            return None
        missing = [(r, a[3]) for r, a in zip(others, answers, strict=True) if a[3] is not None]
        if missing:
            self._once("missing", "ctx.save: the random streams of " + "; ".join(
                f"rank {r} ({why})" for r, why in missing) + " cannot be saved, so this checkpoint holds none")
            return None
        return answers

    def say_once(self, key: str, message: str) -> None:
        """Warn ``message`` once per run (per ``key``): what a save could not capture."""
        if self.enabled and self.count:
            self._once(key, message)

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message)
