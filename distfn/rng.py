"""Random number generator states: capture and restore them without pickle.

`rng_state` / `set_rng_state` capture and restore Python, NumPy, torch CPU and (initialised) CUDA generators as
tensors and JSON-able values, so they can be saved in a checkpoint. `RNG` is a stateful stand-in for "this
process's generators" to put in a training state. For one state per rank, the caller gathers `rng_state` from
every rank and saves `combine_rng_states` of the list; on load, `rng_state_for_rank` picks a rank's state.

`gather_rng_states` is the one collective here (`Context.save(..., rng=True)` calls it on every rank). Before
it the run checks every rank in (`distfn.checkin`, the ``"ctx.save(..., rng=True)"`` rule with `gather_wait`),
so a call on rank 0 only (under ``if ctx.is_main:``) fails within seconds with a `CheckpointError` naming
``rng=True`` instead of hanging in the gather until the collective timeout. Nothing here touches a file: the
checkpoint package writes.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from loguru import logger

from . import collectives
from .errors import CheckpointError

__all__ = ["RNG", "combine_rng_states", "gather_rng_states", "gather_wait", "raw_rng_state", "rng_state",
           "rng_state_for_rank", "rng_state_of", "seed_all", "set_rng_state"]

#: Seconds rank 0 waits in ``ctx.save(..., rng=True)`` for the other ranks to arrive before it calls the mistake
#: an error (``DISTFN_RNG_SAVE_WAIT`` overrides). Ranks leave their last collective together, so a correct
#: program's ranks arrive within moments of each other; the wait only has to cover work some rank does alone
#: before saving.
DEFAULT_GATHER_WAIT: Final = 20.0


def gather_wait() -> float:
    """Seconds rank 0 waits for the others in ``ctx.save(..., rng=True)``: ``DISTFN_RNG_SAVE_WAIT`` or
    `DEFAULT_GATHER_WAIT` (outside ``mode="fsdp"``, whose ``save_timeout`` covers every checkpoint call)."""
    return float(os.environ.get("DISTFN_RNG_SAVE_WAIT", DEFAULT_GATHER_WAIT))

_PARTS: Final = ("python", "torch", "numpy", "cuda")


def seed_all(seed: int) -> None:
    """Seed ``random``, NumPy and torch (CPU and every CUDA device, lazily) with ``seed``."""
    random.seed(seed)
    _numpy().random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Capture this process's random number generator states in a pickle-free form.

    Returns:
        ``{"python": [...], "numpy": {...}, "torch": uint8 tensor,
        "cuda": [uint8 tensor per device] (only if CUDA is already initialised)}``: tensors and JSON-able
        values only, so it can be a value of a training state passed to `distfn.checkpoint.save`.
    """
    return rng_state_of(raw_rng_state())


def raw_rng_state() -> tuple[Any, ...]:
    """The generators' states as the libraries return them, copied but not converted: the cheap half of
    `rng_state` (what ``ctx.step`` takes at every step; `rng_state_of` converts it when it is saved)."""
    # Never initialise CUDA just to read its state: a process that has not used CUDA has nothing to restore.
    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return _PYTHON_STATE.get(), _NUMPY_STATE.get(), torch.get_rng_state(), cuda


class _PythonState:
    """``random.getstate()``, its 625-int tuple reused while the module's generator has not moved.

    ``getstate`` builds a tuple of 625 Python ints (tens of microseconds, at every step boundary). In CPython the
    generator (``random._inst``) holds its Mersenne Twister as ``int index; uint32_t state[624]`` right after the
    object header; those 2,500 bytes are compared with the ones behind the last tuple, and ``gauss_next`` (a plain
    attribute) is read as it is, so the answer is always ``getstate()``'s. Checked once against ``getstate``
    itself, and only in CPython (where an object's id is its address): elsewhere ``getstate`` is called.
    """

    _BYTES: Final = 4 + 624 * 4

    def __init__(self) -> None:
        self._generator: Any = None  # the random.Random the offset was checked on (held: its id is not reused)
        self._address = 0
        self._raw = b""
        self._internal: tuple[int, ...] | None = None

    def get(self) -> tuple[Any, ...]:
        generator: Any = random._inst  # what random.getstate() reads
        if generator is not self._generator:
            self._generator, self._address, self._internal = generator, self._checked_address(generator), None
        if not self._address:
            return generator.getstate()
        raw = ctypes.string_at(self._address, self._BYTES)
        if raw != self._raw or self._internal is None:
            version, self._internal, gauss = generator.getstate()
            self._raw = raw
            return version, self._internal, gauss
        return generator.VERSION, self._internal, generator.gauss_next

    def _checked_address(self, generator: Any) -> int:
        if sys.implementation.name != "cpython" or type(generator) is not random.Random:
            return 0
        address = id(generator) + object.__basicsize__  # the fields after PyObject_HEAD
        _, internal, _ = generator.getstate()
        raw = ctypes.string_at(address, self._BYTES)
        ints = [*internal[:-1], internal[-1]]
        fits = len(internal) == 625 and raw[:4] == ints[-1].to_bytes(4, sys.byteorder, signed=True) and \
            raw[4:] == b"".join(i.to_bytes(4, sys.byteorder) for i in ints[:-1])
        return address if fits else 0


_PYTHON_STATE: Final = _PythonState()


class _NumpyState:
    """``np.random.get_state()``, reused while NumPy's global generator has not moved.

    ``get_state`` copies the 624 words of the Mersenne Twister one element at a time in NumPy's own code (100 us
    and more: most of a step boundary's snapshot, for a generator many training loops never draw from). The
    generator's C state (``key[624]`` and ``pos``) is read instead as 2,500 raw bytes through NumPy's documented
    ``BitGenerator.ctypes.state_address`` (under a microsecond) and compared with the bytes behind the last state
    returned: every draw moves ``pos`` (or refills ``key``), so equal bytes mean no draw since then. The one
    change those bytes do not show is the legacy cached Gaussian being handed out (``has_gauss`` 1 -> 0 with no
    draw), so a state holding a cached Gaussian is never reused; `set_rng_state` forgets the last state (a restore
    may bring any ``has_gauss``). Checked once against ``get_state`` itself: a NumPy whose layout differs always
    gets ``get_state``.
    """

    _BYTES: Final = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos

    def __init__(self) -> None:
        self._generator: Any = None  # the BitGenerator the address belongs to (held: its id cannot be reused)
        self._address = 0  # 0: no fast path for this generator
        self._raw = b""
        self._state: Any = None

    def forget(self) -> None:
        """Take the next state from ``get_state`` (the generators were just restored)."""
        self._state = None

    def get(self) -> Any:
        np = _numpy()
        try:
            generator = np.random.mtrand._rand._bit_generator
        except AttributeError:  # another NumPy layout: no fast path
            return np.random.get_state()
        if generator is not self._generator:
            self._generator, self._address, self._state = generator, self._checked_address(np, generator), None
        if not self._address:
            return np.random.get_state()
        raw = ctypes.string_at(self._address, self._BYTES)
        if raw != self._raw or self._state is None or self._state[3]:  # moved, first call, or a cached Gaussian
            self._state, self._raw = np.random.get_state(), raw
        return self._state

    def _checked_address(self, np: Any, generator: Any) -> int:
        """The address of ``generator``'s C state if its bytes read as ``get_state`` says they should, else 0."""
        try:
            address = int(generator.ctypes.state_address)
            kind, keys, pos = np.random.get_state()[:3]
            raw = ctypes.string_at(address, self._BYTES)
        except (AttributeError, TypeError, ValueError):
            return 0
        fits = kind == "MT19937" and raw[:-4] == np.asarray(keys, dtype="<u4").tobytes() and \
            int.from_bytes(raw[-4:], "little", signed=True) == int(pos)
        return address if fits and sys.byteorder == "little" else 0


_NUMPY_STATE: Final = _NumpyState()


def rng_state_of(raw: tuple[Any, ...]) -> dict[str, Any]:
    """`rng_state`'s pickle-free form of what `raw_rng_state` took."""
    (version, internal, gauss), (kind, keys, pos, has_gauss, cached), cpu, cuda = raw
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": cpu}
    state["numpy"] = {
        "kind": str(kind),
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generator states captured by `rng_state` (also after a save/load round trip).

    Args:
        state: the mapping `rng_state` returned. Missing parts are left alone; a CUDA state is restored only
            where CUDA is available (one state per visible device, extra ones ignored).

    Raises:
        CheckpointError: ``state`` holds the states of several ranks, or is no RNG state at all.
    """
    if "ranks" in state:
        raise CheckpointError(
            f"this RNG entry holds the states of {len(state['ranks'])} ranks; pick this rank's with "
            "rng_state_for_rank(entry, rank, world_size) first"
        )
    if not any(k in state for k in _PARTS):
        keys = ", ".join(repr(str(k)) for k in list(state)[:8])
        keys += f" and {len(state) - 8} more" if len(state) > 8 else ""
        raise CheckpointError(f"not an RNG state (keys {keys}); expected what rng_state() returns")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu().clone())
    if "numpy" in state:
        _set_numpy(state["numpy"])
        _NUMPY_STATE.forget()
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [torch.as_tensor(t, dtype=torch.uint8).cpu().clone() for t in state["cuda"]]
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def _numpy() -> Any:
    """NumPy, a declared dependency (no fallback without it), imported here rather than at the top only so that
    ``import distfn`` and checkpoint files keep working where it is missing (a torch CPU wheel does not need it;
    tests/test_checkpoint.py holds that promise). It costs nothing: torch has imported it already when it is
    installed."""
    import numpy

    return numpy


def _set_numpy(s: Mapping[str, Any]) -> None:
    np = _numpy()
    np.random.set_state(
        (s["kind"], np.asarray(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
    )


def combine_rng_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One savable value holding every rank's `rng_state`, given in rank order.

    No collective in here: the caller gathers (``Context`` uses ``gather_object`` when asked to save RNG).

    Args:
        states: one `rng_state` per rank, in rank order.

    Returns:
        ``{"world_size": len(states), "ranks": [state of rank 0, state of rank 1, ...]}``.
    """
    return {"world_size": len(states), "ranks": [dict(s) for s in states]}


def rng_state_for_rank(saved: Mapping[str, Any], rank: int, world_size: int) -> Mapping[str, Any]:
    """This rank's state out of what `combine_rng_states` (or a single `rng_state`) stored.

    A job resumed with another world size gets ``ranks[rank % saved world size]`` and one warning, from rank 0,
    listing every rank's choice: the run then continues reproducibly, but not bit-for-bit like the original one.

    Args:
        saved: the stored entry (one state, or the states of every rank).
        rank: this process's rank.
        world_size: the number of ranks of this job.

    Returns:
        The state to pass to `set_rng_state`.
    """
    if "ranks" not in saved:
        return saved
    ranks = list(saved["ranks"])
    if not ranks:
        raise CheckpointError("the saved RNG entry holds no rank states")
    if len(ranks) != world_size:
        # Once per job, from rank 0, with every rank's choice: each rank picks by the same rule, and a warning per
        # rank said one fact world_size times (issue 44 item 7). The other ranks say theirs at debug level.
        shown = ", ".join(f"{r} -> {r % len(ranks)}" for r in range(min(world_size, 8)))
        shown += ", ..." if world_size > 8 else ""
        if rank == 0:
            logger.warning("RNG states were saved by {} ranks, this job has {}: rank r takes saved rank r % {} ({}); "
                           "the run continues reproducibly, not bit for bit", len(ranks), world_size, len(ranks),
                           shown)
        else:
            logger.debug("RNG states were saved by {} ranks, this job has {}: rank {} takes saved rank {}",
                         len(ranks), world_size, rank, rank % len(ranks))
    return ranks[rank % len(ranks)]


class _RNG:
    """A stateful stand-in for "this process's RNG": put it in a training state to save / restore RNG.

    ``save({"model": m, "rng": RNG}, p)`` stores `rng_state`; ``load_into(p, {"model": m, "rng": RNG})`` calls
    `set_rng_state`.
    """

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_rng_state(state)

    def __repr__(self) -> str:
        return "distfn.checkpoint.RNG"


#: This process's generators, as a stateful object for a training state (see `_RNG`).
RNG: Final = _RNG()


def gather_rng_states() -> dict[str, Any]:
    """Every rank's `rng_state`, combined (`combine_rng_states`): a collective, call it on every rank.

    Inside a distfn run, ``ctx.save(..., rng=True)`` checks every rank in first (`distfn.checkin`), so that a
    call on rank 0 only raises `CheckpointError` instead of hanging here for the collective timeout; called
    directly, this is the gather alone. Without a process group it returns this process's state alone.
    """
    if not collectives.active():
        return combine_rng_states([rng_state()])
    return combine_rng_states(collectives.gather_object(rng_state()))
