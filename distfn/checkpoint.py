"""Checkpoints as one standard ``.safetensors`` file: streamed, atomic, pickle-free, full training state.

Everything here is a pure function of its arguments: no process group, no collective, no rank logic.
:meth:`distfn.Context.save` calls :func:`save` on rank 0 only and :meth:`distfn.Context.load` calls
:func:`load_into` on every rank.

What can be saved
-----------------
``save(obj, path)`` accepts

* a module (bare, ``DistributedDataParallel``, ``DataParallel``, ``torch.compile``\\ d): its state dict is
  stored with the *bare* module's keys (``fc.weight``; never ``module.`` or ``_orig_mod.``);
* a flat ``{name: tensor}`` mapping: stored under the same names;
* a **training state**: any mapping such as ``{"model": model, "optimizer": opt, "scheduler": sched,
  "scaler": scaler, "step": 1200, "rng": RNG}`` whose values are modules, optimizers, LR schedulers,
  ``GradScaler``\\ s, anything else with ``state_dict()``/``load_state_dict()``, tensors, and plain
  JSON-like values (``None``, bools, ints, floats incl. ``nan``/``inf``, strings, lists, tuples, dicts with
  str/int keys, ``torch.dtype``, ``torch.device``, NumPy scalars), nested freely.

File layout
-----------
The file is a normal safetensors file (8-byte little-endian header length, a JSON header padded with spaces
so the data starts 8-byte aligned, then the raw little-endian bytes of every tensor, without holes), so
``safetensors.torch.load_file`` and ``safetensors.safe_open`` read it as is.

* **Tensors** are stored under their dotted *key path*: a bare module or flat dict gives bare names
  (``fc.weight``), a training state prefixes them with the path of keys that leads to them
  (``model.fc.weight``, ``optimizer.state.0.exp_avg``, ``rng.torch``). Tensors that share memory (tied
  weights: same storage, offset, shape, stride and dtype) are stored once, under the first name met.
  Data is ordered by dtype size (largest first), then name, so every tensor is aligned to its element size.
* **Everything else** lives in the header's ``__metadata__`` (a ``str -> str`` map), as JSON:

  ``"format"``
      ``"pt"``, as written by other PyTorch tools (Hugging Face loaders check it).
  ``"distfn.format"``
      the layout version, ``"1"``.
  ``"distfn.tree"``
      the saved object as a JSON tree in which every tensor is replaced by a reference
      ``{"__tensor__": "<stored name>"}``. JSON cannot hold every Python value, so a few tagged objects are
      used: ``{"__tuple__": [...]}``, ``{"__float__": "nan" | "inf" | "-inf"}``,
      ``{"__dtype__": "float32"}``, ``{"__device__": "cuda:0"}``, ``{"__ndarray__": "<stored name>"}``
      and, for mappings whose keys are not all plain strings (optimizer state is keyed by int),
      ``{"__dict__": [[key, value], ...]}``. A module becomes its (bare) state dict, every other stateful
      object the result of its ``state_dict()``.
  ``"distfn.aliases"``
      ``{"<name>": "<stored name>"}`` for tensors stored once but known under several names (tied weights);
      :func:`load` returns the alias names too, pointing at the same tensor.
  ``"distfn.metadata"``
      the caller's ``metadata=`` mapping as JSON; its string values are also copied as plain
      ``__metadata__`` entries so other tools can read them.

No pickle is written or read anywhere; a file can never execute code when loaded.

Durability
----------
:func:`save` writes to a temporary file in the target directory (created if missing), ``fsync``\\ s it,
``os.replace``\\ s it over the target and ``fsync``\\ s the directory: a crash or ``kill -9`` at any moment
leaves either the old complete file or the new complete one. Permissions follow the umask like any newly
created file. Tensors are copied to host memory one at a time (GPU tensors in bounded chunks through one
pinned buffer; CPU tensors are written straight from their memory, non-contiguous ones through one
contiguous copy, and small ones gathered into few writes), so the extra host memory of a save is about one
chunk, not the model. A temporary file left by a writer that was killed is removed by the next save of the
same target from the same host.

Loading
-------
:func:`load` returns ``{name: tensor}``; :func:`load_into` restores objects in place after validating all of
them, and returns the rest of the file decoded (``load_into(path, {})`` decodes everything). CPU tensors are
views of a private, copy-on-write memory map of the file, like ``safetensors.load_file``: nothing is read
before it is used, writing to a tensor never changes the file, and a later save (a rename, so a new file)
never changes tensors already loaded. Pickle files are refused with a one-line conversion.

Random number generators
------------------------
:func:`rng_state` / :func:`set_rng_state` capture and restore Python, NumPy, torch CPU and (initialised)
CUDA generators as tensors and JSON. :data:`RNG` is a stateful stand-in for "this process's generators" to
put in a training state. For one state per rank, the caller gathers :func:`rng_state` from every rank and
saves :func:`combine_rng_states` of the list; on load, :func:`rng_state_for_rank` picks a rank's state.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import pathlib
import random
import re
import secrets
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Self

import attrs
import torch
from loguru import logger
from torch import nn

from distfn.errors import CheckpointError

__all__ = [
    "RNG",
    "combine_rng_states",
    "latest",
    "load",
    "load_into",
    "read_metadata",
    "rng_state",
    "rng_state_for_rank",
    "save",
    "set_rng_state",
    "unwrap_module",
]

FORMAT_VERSION: Final = "1"
_KEY_FORMAT: Final = "distfn.format"
_KEY_TREE: Final = "distfn.tree"
_KEY_ALIASES: Final = "distfn.aliases"
_KEY_METADATA: Final = "distfn.metadata"
_RESERVED_METADATA: Final = frozenset({"format", _KEY_FORMAT, _KEY_TREE, _KEY_ALIASES, _KEY_METADATA})

_TMP_MARK: Final = ".distfn-tmp"
_MAX_HEADER: Final = 100_000_000  # the stock safetensors limit
_WRITE_CHUNK: Final = 64 << 20  # bytes per os.write / per GPU->host copy
_SMALL_WRITE: Final = 4 << 20  # pieces smaller than this are gathered into one write

_DTYPES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        _DTYPES[getattr(torch, _attr)] = _name
_FROM_CODE: Final[dict[str, torch.dtype]] = {code: dtype for dtype, code in _DTYPES.items()}

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------------
# Modules and RNG


def unwrap_module(module: nn.Module) -> nn.Module:
    """Return the bare module inside DDP / DataParallel / ``torch.compile`` wrappers (any nesting).

    Args:
        module: a module, possibly wrapped.

    Returns:
        The innermost module whose ``state_dict()`` keys carry no ``module.`` / ``_orig_mod.`` prefix.
    """
    seen = 0
    while seen < 64:  # bounded: a cycle of wrappers would be a bug elsewhere, not an endless loop here
        seen += 1
        orig = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(orig, nn.Module):
            module = orig
            continue
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        break
    return module


def rng_state() -> dict[str, Any]:
    """Capture this process's random number generator states in a pickle-free form.

    Returns:
        ``{"python": [...], "numpy": {...} (if NumPy is installed), "torch": uint8 tensor,
        "cuda": [uint8 tensor per device] (only if CUDA is already initialised)}``: tensors and JSON-able
        values only, so it can be a value of a training state passed to :func:`save`.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    # Never initialise CUDA just to read its state: a process that has not used CUDA has nothing to restore.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generator states captured by :func:`rng_state` (also after a save/load round trip).

    Args:
        state: the mapping :func:`rng_state` returned. Missing parts are left alone; a CUDA state is
            restored only where CUDA is available (one state per visible device, extra ones ignored).
    """
    if "ranks" in state:
        raise CheckpointError(
            f"this RNG entry holds the states of {len(state['ranks'])} ranks; pick this rank's with "
            "rng_state_for_rank(entry, rank, world_size) first"
        )
    if not any(k in state for k in ("python", "torch", "numpy", "cuda")):
        raise CheckpointError(f"not an RNG state (keys {_describe([str(k) for k in state])}); expected what "
                              "rng_state() returns")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu().clone())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:  # saved with NumPy, restored without it: nothing to restore into
            pass
        else:
            s = state["numpy"]
            np.random.set_state(
                (s["kind"], np.asarray(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
            )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [torch.as_tensor(t, dtype=torch.uint8).cpu().clone() for t in state["cuda"]]
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def combine_rng_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One savable value holding every rank's :func:`rng_state`, given in rank order.

    No collective in here: the caller gathers (``Context`` uses ``gather_object`` when asked to save RNG).

    Returns:
        ``{"world_size": len(states), "ranks": [state of rank 0, state of rank 1, ...]}``.
    """
    return {"world_size": len(states), "ranks": [dict(s) for s in states]}


def rng_state_for_rank(saved: Mapping[str, Any], rank: int, world_size: int) -> Mapping[str, Any]:
    """This rank's state out of what :func:`combine_rng_states` (or a single :func:`rng_state`) stored.

    A job resumed with another world size gets ``ranks[rank % saved world size]`` and a warning: the run then
    continues reproducibly, but not bit-for-bit like the original one.
    """
    if "ranks" not in saved:
        return saved
    ranks = list(saved["ranks"])
    if not ranks:
        raise CheckpointError("the saved RNG entry holds no rank states")
    if len(ranks) != world_size:
        logger.warning("RNG states were saved by {} ranks, this job has {}: rank {} takes saved rank {}",
                       len(ranks), world_size, rank, rank % len(ranks))
    return ranks[rank % len(ranks)]


class _RNG:
    """A stateful stand-in for "this process's RNG": put it in a training state to save / restore RNG.

    ``save({"model": m, "rng": RNG}, p)`` stores :func:`rng_state`; ``load_into(p, {"model": m, "rng": RNG})``
    calls :func:`set_rng_state`.
    """

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_rng_state(state)

    def __repr__(self) -> str:
        return "distfn.checkpoint.RNG"


RNG: Final = _RNG()


# --------------------------------------------------------------------------------------------------
# Encoding: object -> (JSON tree, tensors to write)


@attrs.frozen
class _Entry:
    """One tensor to write: its stored name, the tensor (detached, any device) and its byte span."""

    name: str
    tensor: torch.Tensor
    code: str
    shape: tuple[int, ...]
    nbytes: int


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


class _Encoder:
    """Walks an object once, producing the JSON tree and the de-duplicated list of tensors."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.aliases: dict[str, str] = {}
        self._by_name: dict[str, str] = {}  # every tensor name (stored or alias) -> the path that produced it
        self._by_memory: dict[tuple[Any, ...], str] = {}

    def encode(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._tensor(obj, path)}
        if isinstance(obj, nn.Module):
            return self.encode(unwrap_module(obj).state_dict(), path)
        if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, Mapping):
            return self._mapping(obj, path)
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, (*path, i)) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray):
                return {"__ndarray__": self._tensor(torch.from_numpy(obj), path)}
            if isinstance(obj, np.generic):
                return self.encode(obj.item(), path)
        if _is_stateful(obj):
            try:
                state = obj.state_dict()
            except Exception as exc:
                raise CheckpointError(
                    f"cannot save {type(obj).__name__} at '{_path_str(path)}': its state_dict() failed: {exc}"
                ) from exc
            return self.encode(state, path)
        raise CheckpointError(
            f"cannot save the value at '{_path_str(path)}': {type(obj).__qualname__} ({_short_repr(obj)}) is "
            "not a tensor, module, optimizer, scheduler, object with state_dict()/load_state_dict(), or a "
            "JSON-like value (None, bool, int, float, str, list, tuple, dict). Nothing was written."
        )

    def _mapping(self, obj: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
        plain = all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain:
            return {k: self.encode(v, (*path, k)) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise CheckpointError(
                    f"cannot save the mapping at '{_path_str(path)}': key {k!r} of type {type(k).__qualname__} "
                    "is not a str, int, float, bool, None or tuple. Nothing was written."
                )
            items.append([self.encode(k, (*path, "<key>")), self.encode(v, (*path, k))])
        return {"__dict__": items}

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> str:
        name = ".".join(str(p) for p in path)
        where = _path_str(path)
        if not name:
            raise CheckpointError("cannot save a bare tensor: save a mapping such as {'weight': tensor}")
        if name in self._by_name:
            raise CheckpointError(
                f"two values would be stored under the same tensor name '{name}' (key paths "
                f"{self._by_name[name]!r} and {where!r}); rename one of the keys. Nothing was written."
            )
        self._by_name[name] = where
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            if hasattr(tensor, "placements") or hasattr(tensor, "full_tensor"):
                raise CheckpointError(f"cannot save the sharded tensor (DTensor) at '{where}': gather it first "
                                      "(e.g. tensor.full_tensor()). Nothing was written.")
            tensor = tensor.as_subclass(torch.Tensor)  # a plain subclass: keep the data, drop the behaviour
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            kind = "meta" if tensor.is_meta else ("quantized" if tensor.is_quantized else str(tensor.layout))
            raise CheckpointError(f"cannot save the {kind} tensor at '{where}': only dense tensors with data "
                                  "can be stored in safetensors. Nothing was written.")
        code = _DTYPES.get(tensor.dtype)
        if code is None:
            raise CheckpointError(f"cannot save the tensor at '{where}': dtype {tensor.dtype} has no safetensors "
                                  "equivalent. Nothing was written.")
        tensor = tensor.detach()
        if tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                   tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            first = self._by_memory.get(key)
            if first is not None:  # tied / shared: store once
                self.aliases[name] = first
                return first
            self._by_memory[key] = name
        shape = tuple(int(s) for s in tensor.shape)
        self.entries.append(_Entry(name, tensor, code, shape, tensor.numel() * tensor.element_size()))
        return name


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the real error
        text = object.__repr__(obj)
    return text if len(text) <= 80 else text[:77] + "..."


@attrs.frozen
class _Plan:
    """Everything to write: header bytes and tensors in file order."""

    header: bytes
    entries: tuple[_Entry, ...]
    total: int  # file size in bytes


def _plan(obj: Any, metadata: Mapping[str, Any] | None) -> _Plan:
    encoder = _Encoder()
    tree = encoder.encode(obj, ())
    meta: dict[str, str] = {"format": "pt", _KEY_FORMAT: FORMAT_VERSION, _KEY_TREE: _dumps(tree)}
    if encoder.aliases:
        meta[_KEY_ALIASES] = _dumps(encoder.aliases)
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
            raise CheckpointError("metadata= must be a mapping with str keys")
        meta[_KEY_METADATA] = _dumps(_Encoder().encode(dict(metadata), ("<metadata>",)), what="metadata")
        if "__tensor__" in meta[_KEY_METADATA]:
            raise CheckpointError("metadata= must hold JSON-like values only (no tensors); put tensors in obj")
        for k, v in metadata.items():
            if isinstance(v, str) and k not in _RESERVED_METADATA:
                meta[k] = v
    # Largest element size first keeps every tensor aligned to its element size (the data starts 8-aligned).
    entries = sorted(encoder.entries, key=lambda e: (-e.tensor.element_size(), e.name))
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if len(raw) > _MAX_HEADER:
        raise CheckpointError(f"the checkpoint header would be {len(raw)} bytes, over the safetensors limit of "
                              f"{_MAX_HEADER}: too many non-tensor values. Nothing was written.")
    return _Plan(len(raw).to_bytes(8, "little") + raw, tuple(entries), 8 + len(raw) + offset)


def _dumps(value: Any, what: str = "state") -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:  # pragma: no cover - the encoder only emits JSON-able values
        raise CheckpointError(f"cannot encode the {what} as JSON: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Writing


def _write_all(fd: int, data: memoryview) -> None:
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


class _Staging:
    """One reusable host buffer (pinned where CUDA is used) for device->host copies in bounded chunks."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def chunks(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        size = flat.numel()
        want = min(size, _WRITE_CHUNK)
        if self._buffer is None or self._buffer.numel() < want:
            self._buffer = torch.empty(want, dtype=torch.uint8, pin_memory=tensor.device.type == "cuda")
        step = self._buffer.numel()
        for start in range(0, size, step):
            n = min(step, size - start)
            part = self._buffer[:n]
            part.copy_(flat[start : start + n])  # synchronous: the buffer is reused right after the write
            yield _memory(part)


class _Sink:
    """Writes to a file descriptor: large pieces straight from their memory, small ones gathered first.

    Models hold many tiny tensors (biases, norms); one system call each would dominate their cost.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._small = bytearray()

    def write(self, data: memoryview) -> None:
        if len(data) < _SMALL_WRITE:
            self._small += data
            if len(self._small) >= _SMALL_WRITE:
                self.flush()
            return
        self.flush()
        _write_all(self.fd, data)

    def flush(self) -> None:
        if self._small:
            _write_all(self.fd, memoryview(self._small))
            self._small = bytearray()


def _fsync_dir(directory: pathlib.Path) -> None:
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


def _tmp_prefix(target: pathlib.Path) -> str:
    """``.<name>.<host>.``: temporary files of this target written from this host (name cut to fit NAME_MAX)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"
    return f".{target.name[:120]}.{host}."


def _tmp_name(target: pathlib.Path) -> pathlib.Path:
    # The pid lets a later save recognise (and remove) what a killed writer left; the random part keeps two
    # concurrent writers of the same target apart.
    return target.with_name(f"{_tmp_prefix(target)}{os.getpid()}.{secrets.token_hex(4)}{_TMP_MARK}")


def _remove_stale_tmps(target: pathlib.Path) -> None:
    """Remove temporary files a killed writer of *this* target on *this* host left behind."""
    pattern = re.compile(re.escape(_tmp_prefix(target)) + r"(\d+)\.[0-9a-f]{8}" + re.escape(_TMP_MARK) + "$")
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(target.parent / name)
                logger.debug("removed {} left by a killed writer (pid {})", name, pid)
        except OSError:  # alive but not ours (EPERM): leave it
            pass


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
) -> pathlib.Path:
    """Write ``obj`` atomically and durably to ``path`` as one safetensors file.

    No collective and no rank logic in here: the caller decides who writes (``Context.save`` writes from rank
    0 only). Other ranks that must read the file afterwards should wait on ``ctx.barrier()``.

    Args:
        obj: a module (possibly wrapped), a ``{name: tensor}`` mapping, or a training-state mapping (see the
            module documentation for what values may hold).
        path: the target file. Missing parent directories are created.
        metadata: JSON-like values stored in the header (string values also readable by other tools).
        keep: with a step-numbered name such as ``ckpt-1200.safetensors``, keep only the ``keep`` newest files
            with the same prefix in that directory (by step number; the file just written is always kept).

    Returns:
        The path written, absolute.

    Raises:
        CheckpointError: a value that cannot be stored (the message names its key path; raised before anything
            is written), an invalid ``keep``, or an I/O failure (the target is then left untouched).
    """
    target = pathlib.Path(os.fspath(path)).expanduser().absolute()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep= must be a positive int or None, got {keep!r}")
    if keep is not None and _step_of(target.name) is None:
        raise CheckpointError(
            f"keep= needs a step-numbered file name such as 'ckpt-1200.safetensors', got '{target.name}'"
        )
    if target.is_dir():
        raise CheckpointError(f"cannot save to '{target}': it is a directory")
    plan = _plan(obj, metadata)  # every error about the content is raised here, before touching the disk

    parent = target.parent
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create the directory '{parent}' for the checkpoint: {exc}") from exc
        _fsync_dir(parent.parent)
    _remove_stale_tmps(target)
    tmp = _tmp_name(target)
    try:
        # 0o666 & ~umask, exactly like open(..., "w"); mkstemp / NamedTemporaryFile would force 0o600.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
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
        if isinstance(exc, OSError):
            raise CheckpointError(f"writing '{target}' failed ({exc}); the previous file, if any, is intact") from exc
        raise
    _fsync_dir(parent)
    logger.debug("saved {} ({} tensors, {} bytes)", target, len(plan.entries), plan.total)
    if keep is not None:
        _rotate(target, keep)
    return target


def _write_plan(fd: int, plan: _Plan) -> None:
    if plan.total >= (64 << 20) and hasattr(os, "posix_fallocate"):
        # Reserve the space up front: one extent allocation instead of many, and ENOSPC before any data.
        try:
            os.posix_fallocate(fd, 0, plan.total)
        except OSError as exc:
            if exc.errno == 28:  # ENOSPC
                raise
    sink = _Sink(fd)
    sink.write(memoryview(plan.header))
    staging = _Staging()
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
# Step-numbered files


_STEP_RE: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)\.safetensors$")


def _step_of(name: str) -> tuple[str, int] | None:
    m = _STEP_RE.match(name)
    if m is None or name.startswith("."):
        return None
    return m.group("prefix"), int(m.group("step"))


def _rotate(target: pathlib.Path, keep: int) -> None:
    parsed = _step_of(target.name)
    assert parsed is not None
    prefix = parsed[0]
    found = []
    for p in target.parent.iterdir():
        s = _step_of(p.name)
        if s is not None and s[0] == prefix and p.is_file():
            found.append((s[1], p.name, p))
    found.sort(reverse=True)
    kept = 0
    for _, _, p in found:
        if p == target or kept < keep - 1:
            kept += p != target
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            logger.debug("keep={}: removed {}", keep, p)


def latest(directory: PathLike, prefix: str = "ckpt-") -> pathlib.Path | None:
    """The complete step-numbered checkpoint with the highest step in ``directory``.

    Args:
        directory: where to look; a missing directory gives ``None``.
        prefix: the name before the step number (``ckpt-`` matches ``ckpt-1200.safetensors``).

    Returns:
        The path of the newest complete file, or ``None`` when there is none. Files whose header or size is
        inconsistent (e.g. torn copies made by other tools) are skipped with a warning; temporary files of
        distfn's own writers are never considered.
    """
    d = pathlib.Path(os.fspath(directory)).expanduser()
    if not d.is_dir():
        return None
    candidates = []
    for p in d.iterdir():
        s = _step_of(p.name)
        if s is not None and s[0] == prefix and p.is_file():
            candidates.append((s[1], p))
    for _, p in sorted(candidates, reverse=True):
        try:
            _read_header(p)
        except CheckpointError as exc:
            logger.warning("skipping incomplete checkpoint {}: {}", p, exc)
            continue
        return p
    return None


# --------------------------------------------------------------------------------------------------
# Reading


@attrs.frozen
class _Header:
    path: pathlib.Path
    data_start: int
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, str]


_PICKLE_SUFFIXES: Final = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


def _refuse_pickle(path: pathlib.Path, why: str) -> CheckpointError:
    out = path.with_suffix(".safetensors")
    return CheckpointError(
        f"'{path}' is not a safetensors file ({why}); it looks like a pickle-based torch.save file. distfn only "
        "loads safetensors because unpickling a file can execute arbitrary code. If you trust this file, "
        "convert it once with:\n"
        f"    python -c \"import torch; from distfn import checkpoint; checkpoint.save(torch.load('{path}', "
        f"map_location='cpu', weights_only=True), '{out}')\""
    )


def _read_header(path: pathlib.Path, opened: Any = None) -> _Header:
    """Parse and check the header of ``path`` (read through ``opened``, a binary file, when given)."""
    try:
        with contextlib.ExitStack() as stack:
            f = opened if opened is not None else stack.enter_context(open(path, "rb"))
            size = os.fstat(f.fileno()).st_size
            f.seek(0)
            head = f.read(9)
            n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
            if not (2 <= n <= _MAX_HEADER and 8 + n <= size and head[8:9] == b"{"):
                if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04",
                                                                                      b"\x05")):
                    raise _refuse_pickle(path, "it starts with a zip/pickle signature")
                if path.suffix.lower() in _PICKLE_SUFFIXES:
                    raise _refuse_pickle(path, "its first bytes are not a safetensors header")
                raise CheckpointError(f"'{path}' is not a complete safetensors file ({size} bytes, header length "
                                      f"{n}); it may be truncated or of another format")
            f.seek(8)
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at '{path}'") from None
    except IsADirectoryError:
        raise CheckpointError(f"'{path}' is a directory; pass a .safetensors file (see distfn.latest)") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        if path.suffix.lower() in _PICKLE_SUFFIXES:
            raise _refuse_pickle(path, "its header is not JSON") from None
        raise CheckpointError(f"'{path}' has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"'{path}' has a corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    end = 0
    for name, info in header.items():
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            if not 0 <= begin <= stop:
                raise ValueError
            if info["dtype"] not in _FROM_CODE:
                raise CheckpointError(f"'{path}': tensor '{name}' has dtype {info['dtype']}, unknown to this torch")
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"'{path}': corrupt entry for tensor '{name}' in the header") from None
        end = max(end, int(stop))
    if 8 + n + end != size:
        raise CheckpointError(f"'{path}' is incomplete or corrupt: the header describes {8 + n + end} bytes, the "
                              f"file has {size}")
    return _Header(path, 8 + n, header, dict(metadata))


def read_metadata(path: PathLike) -> dict[str, Any]:
    """The ``metadata=`` mapping saved with a checkpoint (or the raw string metadata of a foreign file)."""
    header = _read_header(pathlib.Path(os.fspath(path)))
    if _KEY_METADATA in header.metadata:
        return _decode(json.loads(header.metadata[_KEY_METADATA]), _NoTensors())
    return dict(header.metadata)


class _Reader:
    """Serves the tensors of one open file.

    CPU tensors are views of one private (copy-on-write) memory map of the file, as ``safetensors.load_file``
    does: nothing is read until used, no byte is copied twice, writing to a tensor never changes the file, and
    a later save, which replaces the file by rename, never changes a loaded tensor. Tensors whose offset is not
    aligned to their element size (possible in files of other tools) are read into fresh memory instead.
    """

    def __init__(self, path: pathlib.Path, device: torch.device) -> None:
        self.device = device
        try:
            self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint at '{path}'") from None
        except IsADirectoryError:
            raise CheckpointError(f"'{path}' is a directory; pass a .safetensors file (see distfn.latest)") from None
        try:
            self.header = _read_header(path, self._file)  # the same open file as the mapping: no race
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self._file.close()
            raise
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def close(self) -> None:
        self._file.close()  # the mapping lives on with the tensors that use it

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self.header.tensors)

    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        device = self.device if device is None else device
        cached = self._cache.get((name, str(device)))
        if cached is not None:
            return cached
        try:
            info = self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"'{self.header.path}' has no tensor '{name}' (corrupt metadata?)") from None
        dtype = _FROM_CODE[info["dtype"]]
        shape = [int(s) for s in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = math.prod(shape)
        if end - begin != numel * itemsize:
            raise CheckpointError(f"'{self.header.path}': tensor '{name}' has {end - begin} bytes for shape "
                                  f"{shape} of {dtype}")
        start = self.header.data_start + begin
        if numel == 0:
            out = torch.empty(shape, dtype=dtype)
        elif start % itemsize == 0:
            # Its own storage (offset 0, exactly its bytes) over the shared mapping, which it keeps alive.
            out = torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start).view(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=start)
            out.reshape(-1).view(torch.uint8).copy_(raw)
        if device.type != "cpu":
            out = out.to(device)
        self._cache[(name, str(device))] = out
        return out


def _open(path: PathLike, device: str | torch.device) -> _Reader:
    return _Reader(pathlib.Path(os.fspath(path)).expanduser(), torch.device(device))


def load(
    path: PathLike, device: str | torch.device = "cpu", *, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Read the tensors of a safetensors file into a plain ``{name: tensor}`` dict.

    Works outside any distributed run (e.g. for inference). Names are as stored: a module's bare keys, or the
    dotted key paths of a training state (``model.fc.weight``). Tied weights come back under all their names,
    as the same tensor. Files written by other tools load too.

    Args:
        path: a ``.safetensors`` file. Pickle files (``torch.save``) are refused with a conversion hint.
        device: where the tensors go.
        prefix: only the tensors under this key path, with it removed: ``load("ckpt-100.safetensors",
            prefix="model")`` is the model's state dict out of a training-state checkpoint.

    Returns:
        The tensors, in the file's header order. CPU tensors are copy-on-write views of a memory map of the
        file (read on first use): another tool must not rewrite the file *in place* while they are in use
        (distfn's own saves replace it by rename, which is safe); ``.clone()`` them to detach from the file.
    """
    with _open(path, device) as reader:
        names = reader.names()
        aliases = json.loads(reader.header.metadata.get(_KEY_ALIASES, "{}"))
        if prefix is not None:
            start = prefix.rstrip(".") + "."
            wanted = {n for n in [*names, *aliases] if n.startswith(start)}
            if not wanted:
                raise CheckpointError(f"'{path}' has no tensors under '{prefix}' (it holds "
                                      f"{_describe(sorted({n.split('.')[0] for n in names}))})")
            names = [n for n in names if n in wanted or n in {aliases.get(w) for w in wanted}]
        stored = {name: reader.get(name) for name in names}
    out = dict(stored)
    for alias, target in aliases.items():
        if target not in stored:
            if prefix is None:
                raise CheckpointError(f"'{path}': the tied name '{alias}' refers to a missing tensor '{target}'")
            continue
        out[alias] = stored[target]
    if prefix is not None:
        out = {n[len(start):]: t for n, t in out.items() if n.startswith(start)}
    return out


# --------------------------------------------------------------------------------------------------
# Decoding and restoring in place


class _NoTensors:
    def get(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        raise CheckpointError(f"unexpected tensor reference {name!r} in metadata")


_TAGS: Final = ("__tensor__", "__ndarray__", "__tuple__", "__float__", "__dtype__", "__device__", "__dict__")


def _decode(node: Any, reader: Any, device: torch.device | None = None) -> Any:
    """Rebuild the Python value of a JSON tree node, reading referenced tensors from ``reader``."""
    if isinstance(node, list):
        return [_decode(v, reader, device) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, value), = node.items()
        if tag == "__tensor__":
            return reader.get(value, device)
        if tag == "__ndarray__":
            return reader.get(value, torch.device("cpu")).numpy()
        if tag == "__tuple__":
            return tuple(_decode(v, reader, device) for v in value)
        if tag == "__float__":
            return float(value)
        if tag == "__dtype__":
            return getattr(torch, value)
        if tag == "__device__":
            return torch.device(value)
        if tag == "__dict__":
            return {_decode(k, reader, device): _decode(v, reader, device) for k, v in value}
    return {k: _decode(v, reader, device) for k, v in node.items()}


def _tree(header: _Header) -> Any:
    """The saved object's JSON tree; a foreign file (no distfn metadata) reads as a flat name -> tensor map."""
    raw = header.metadata.get(_KEY_TREE)
    if raw is None:
        return {name: {"__tensor__": name} for name in header.tensors}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"'{header.path}' has corrupt distfn metadata: {exc}") from None


def _ref(node: Any) -> str | None:
    """The stored tensor name if ``node`` is a tensor reference."""
    if isinstance(node, dict) and len(node) == 1 and "__tensor__" in node:
        return str(node["__tensor__"])
    return None


def _as_plain_dict(node: Any) -> dict[Any, Any] | None:
    """A tree node that encodes a mapping, as a dict of (encoded) children keyed by decoded keys."""
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        (tag, value), = node.items()
        if tag == "__dict__":
            return {_decode(k, _NoTensors()): v for k, v in value}
        if tag in _TAGS:
            return None
    return node


def _child(node: dict[Any, Any], key: Any) -> Any:
    """``node[key]``, or for flat files the entries under ``key.`` gathered into a sub-mapping."""
    if key in node:
        return node[key]
    prefix = f"{key}."
    sub = {k[len(prefix):]: v for k, v in node.items() if isinstance(k, str) and k.startswith(prefix)}
    return sub or None


_WRAPPER_SEGMENTS: Final = ("module", "_orig_mod")


def _strip_wrappers(key: str) -> str:
    parts = key.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_SEGMENTS:
        parts = parts[1:]
    return ".".join(p for i, p in enumerate(parts) if p != "_orig_mod" or i == len(parts) - 1)


def _describe(keys: Sequence[str], limit: int = 8) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


@attrs.define
class _Step:
    """One validated restore, applied after every target has been checked."""

    where: str
    apply: Any  # Callable[[], None]


class _Restorer:
    def __init__(self, reader: _Reader, device: torch.device, strict: bool) -> None:
        self.reader = reader
        self.device = device
        self.strict = strict
        self.steps: list[_Step] = []
        self.file = reader.header.path

    # -- dispatch ---------------------------------------------------------------------------------
    def plan(self, target: Any, node: Any, path: tuple[Any, ...]) -> Any:
        """Validate restoring ``target`` from ``node``; queue the work; return leftovers (for mappings)."""
        where = _path_str(path)
        if isinstance(target, nn.Module):
            self._module(target, node, where)
        elif isinstance(target, torch.optim.Optimizer):
            self._optimizer(target, node, where)
        elif isinstance(target, torch.Tensor):
            self._tensor(target, node, where)
        elif isinstance(target, Mapping):
            return self.mapping(target, node, path)
        elif _is_stateful(target):
            self.steps.append(_Step(where, lambda: target.load_state_dict(_decode(node, self.reader, self.device))))
        else:
            raise CheckpointError(
                f"cannot restore into {type(target).__qualname__} at '{where}': into= takes modules, optimizers, "
                "schedulers, GradScalers, tensors, objects with load_state_dict() and mappings of those. Plain "
                "values (step, epoch, ...) are not restored in place; load_into returns them."
            )
        return None

    def mapping(self, into: Mapping[Any, Any], node: Any, path: tuple[Any, ...]) -> dict[Any, Any]:
        where = _path_str(path)
        children = _as_plain_dict(node)
        if children is None:
            raise CheckpointError(f"'{self.file}': expected a mapping at '{where}' to restore "
                                  f"{_describe([str(k) for k in into])} into, found {_kind(node)}")
        missing = []
        used: set[Any] = set()
        for key, target in into.items():
            if target is None:
                continue
            child = _child(children, key)
            if child is None:
                missing.append(key)
                continue
            used.add(key)
            if key not in children:  # gathered from "key.*" names
                used.update(k for k in children if isinstance(k, str) and k.startswith(f"{key}."))
            self.plan(target, child, (*path, key))
        if missing:
            holds = _describe([str(k) for k in children])
            hint = ""
            if all(_ref(v) is not None for v in children.values()):
                hint = " The file holds a bare state dict; to load a module from it pass into=model."
            msg = f"'{self.file}' has no entry for {_describe([str(k) for k in missing])} (it holds {holds}).{hint}"
            if self.strict:
                raise CheckpointError(msg)
            logger.warning("{} (strict=False: left as they are)", msg)
        return {k: v for k, v in children.items() if k not in used}

    # -- kinds --------------------------------------------------------------------------------------
    def _module(self, target: nn.Module, node: Any, where: str) -> None:
        module = unwrap_module(target)
        children = _as_plain_dict(node)
        if children is None:
            raise CheckpointError(f"'{self.file}': expected a module state dict at '{where}', found {_kind(node)}")
        bad = [k for k, v in children.items() if _ref(v) is None and not str(k).endswith("_extra_state")]
        if bad:
            raise CheckpointError(
                f"'{self.file}' holds a training state ({_describe([str(k) for k in children])}), not a module "
                f"state dict at '{where}'; pass into={{'model': model, ...}} naming the entries to restore."
            )
        expected = module.state_dict()
        file_keys = {str(k): k for k in children}
        if not set(expected) <= set(file_keys) or not set(file_keys) <= set(expected):
            # Files written from a wrapped module (by other tools): 'module.fc.weight', '_orig_mod.fc.weight'.
            stripped = {_strip_wrappers(k): orig for k, orig in file_keys.items()}
            if len(stripped) == len(file_keys) and len(set(stripped) & set(expected)) > len(
                set(file_keys) & set(expected)
            ):
                file_keys = stripped
        missing = [k for k in expected if k not in file_keys]
        if missing:  # a tied weight the file stores once (e.g. files written by other tools) is not missing
            by_memory: dict[tuple[Any, ...], list[str]] = {}
            for k, t in expected.items():
                if isinstance(t, torch.Tensor) and t.numel():
                    by_memory.setdefault((t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                                          tuple(t.shape)), []).append(k)
            tied = {k for group in by_memory.values() if any(g in file_keys for g in group) for k in group}
            missing = [k for k in missing if k not in tied]
        unexpected = [k for k in file_keys if k not in expected]
        prefix = "" if where == "<root>" else f"{where}."
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing from the file: {_describe([prefix + k for k in missing])}")
            if unexpected:
                parts.append(f"unexpected in the file: {_describe([prefix + k for k in unexpected])}")
            msg = f"'{self.file}' does not match the module at '{where}': " + "; ".join(parts)
            if self.strict:
                raise CheckpointError(msg + " (pass strict=False to load the matching keys only)")
            logger.warning("{} (strict=False: loading the matching keys)", msg)
        for key, value in expected.items():
            if key not in file_keys or not isinstance(value, torch.Tensor):
                continue
            name = _ref(children[file_keys[key]])
            shape = list(self.reader.header.tensors.get(name, {}).get("shape", []))
            if shape != list(value.shape):
                raise CheckpointError(
                    f"'{self.file}': shape mismatch at '{prefix}{key}': the file has {shape}, the model has "
                    f"{list(value.shape)}"
                )
        del expected

        def apply() -> None:
            # Read on the CPU: load_state_dict copies each tensor straight into the parameter, on its device.
            state = {k: _decode(children[orig], self.reader, torch.device("cpu")) for k, orig in file_keys.items()
                     if k not in unexpected}
            result = module.load_state_dict(state, strict=False)
            if result.missing_keys and self.strict:  # hooks may add requirements; report them the same way
                still = [k for k in result.missing_keys if k in missing]
                if still:
                    raise CheckpointError(f"'{self.file}': keys missing for '{where}': {_describe(still)}")

        self.steps.append(_Step(where, apply))

    def _optimizer(self, target: torch.optim.Optimizer, node: Any, where: str) -> None:
        children = _as_plain_dict(node)
        groups = children.get("param_groups") if children else None
        if children is None or "state" not in children or not isinstance(groups, list):
            raise CheckpointError(f"'{self.file}': the entry at '{where}' is not an optimizer state "
                                  f"(found {_kind(node)})")
        saved = [len(_as_plain_dict(g).get("params", [])) if _as_plain_dict(g) else 0 for g in groups]
        live = [len(g["params"]) for g in target.param_groups]
        if saved != live:
            raise CheckpointError(
                f"'{self.file}': the optimizer at '{where}' does not match: the file has {len(saved)} param "
                f"group(s) with {saved} parameters, the optimizer has {len(live)} with {live}"
            )

        def apply() -> None:
            # CPU tensors: Optimizer.load_state_dict moves each to its parameter's device and dtype
            # (and keeps 'step' where the optimizer wants it).
            state = _decode(node, self.reader, torch.device("cpu"))
            try:
                target.load_state_dict(state)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"'{self.file}': cannot restore the optimizer at '{where}': {exc}") from exc

        self.steps.append(_Step(where, apply))

    def _tensor(self, target: torch.Tensor, node: Any, where: str) -> None:
        name = _ref(node)
        if name is None:
            raise CheckpointError(f"'{self.file}': expected a tensor at '{where}', found {_kind(node)}")
        shape = list(self.reader.header.tensors.get(name, {}).get("shape", []))
        if shape != list(target.shape):
            raise CheckpointError(f"'{self.file}': shape mismatch at '{where}': the file has {shape}, the "
                                  f"tensor has {list(target.shape)}")

        def apply() -> None:
            with torch.no_grad():
                target.copy_(self.reader.get(name, torch.device("cpu")))

        self.steps.append(_Step(where, apply))


def _kind(node: Any) -> str:
    if _ref(node) is not None:
        return "a tensor"
    if isinstance(node, dict) and len(node) == 1 and next(iter(node)) in _TAGS:
        return f"a {next(iter(node)).strip('_')}"
    if isinstance(node, dict):
        return f"a mapping with keys {_describe([str(k) for k in node])}"
    if isinstance(node, list):
        return "a list"
    return f"the value {node!r}"


def load_into(
    path: PathLike,
    into: Mapping[str, Any] | nn.Module | torch.optim.Optimizer | Any,
    *,
    device: str | torch.device = "cpu",
    strict: bool = True,
) -> dict[str, Any]:
    """Restore objects in place from a checkpoint and return the values that were not restored in place.

    Every target is validated first (keys, shapes, optimizer structure) and only then restored, so a mismatch
    leaves all targets untouched.

    Args:
        path: a ``.safetensors`` file (written by :func:`save` or by other tools).
        into: a module (possibly wrapped) for a module file (or any single object the file was saved from,
            e.g. an optimizer), or a mapping naming the entries of a training
            state to restore, e.g. ``{"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
            "rng": RNG}``. Values may be modules, optimizers, schedulers, ``GradScaler``\\ s, tensors, objects
            with ``load_state_dict()``, nested mappings of those, or ``None`` (skipped). Module entries accept
            keys prefixed by ``module.`` / ``_orig_mod.``.
        device: where returned tensors (and the state of generic stateful objects) are placed. Module and
            optimizer tensors go to their parameters' devices.
        strict: when true (default) a missing entry, a missing or unexpected module key is an error; when
            false it is logged as a warning and the matching part is restored.

    Returns:
        The file's top-level entries that ``into`` did not name (``step``, ``epoch``, ``best``, ...), decoded:
        tensors on ``device``, other values as saved. ``{}`` when ``into`` is a single object.

    Raises:
        CheckpointError: unreadable or pickle file, missing/unexpected keys (strict), the first shape mismatch
            (naming the key and both shapes), an optimizer with another parameter layout.
    """
    dev = torch.device(device)
    with _open(path, dev) as reader:
        tree = _tree(reader.header)
        restorer = _Restorer(reader, dev, strict)
        if isinstance(into, Mapping):
            leftovers: dict[Any, Any] = restorer.mapping(into, tree, ())
        elif isinstance(into, (nn.Module, torch.Tensor)) or _is_stateful(into):
            restorer.plan(into, tree, ())  # a file saved from this one object (e.g. save(optimizer, path))
            leftovers = {}
        else:
            raise CheckpointError(f"into= must be a module, a stateful object or a mapping of objects to restore, "
                                  f"got {type(into).__qualname__}")
        for step in restorer.steps:
            step.apply()
        result = {k: _decode(v, reader, dev) for k, v in leftovers.items()}
    logger.debug("loaded {} into {}", reader.header.path, _describe([s.where for s in restorer.steps]))
    return result
