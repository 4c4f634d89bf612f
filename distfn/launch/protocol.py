"""What every rank started by a distfn launcher does around the user's function, and how its launcher reads it.

Written once, used by every launcher of this package (local workers, per-node workers, Ray actors), so that a rank
behaves the same whoever started it:

* **the rank variables**: `export_rank_env` sets torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` /
  ``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (and the restart attempt) for libraries and user code;
* **the store**: the launcher binds the rendezvous port *before* the ranks start (`bind_listener`: no "pick a
  free port and hope" race); whoever hosts the store hosts it on that socket (`host_store`), the others join it
  (`join_store`);
* **one report per rank** (`run_rank`): ``("ok", value)``, ``("exit", Failure)`` for ``sys.exit(0)`` / ``sys.exit()``
  (an early exit: no error unless a peer fails, `classify`) or ``("error", Failure)``; a failure is delivered
  *before* the process group is torn down (NCCL's teardown can wait for the very collective that failed);
* **the value** (`to_cpu`, `compact_views`): tensors detached, on the CPU, holding only their own bytes;
* **the verdict** (`root_cause_first`): after the first failure the launcher waits `SETTLE_WINDOW` for the other
  reports, counts early exits as failures (a rank that left is why its peers lost it), orders the root cause first
  and explains it (`distfn.failures.diagnose`);
* **no orphans** (`die_with_parent`, from `distfn.launch.lifeline`): ``PR_SET_PDEATHSIG``, for the local workers
  and the fork server.

Imports the rank bootstrap (`distfn.worker`), the failure records (`distfn.failures`) and nothing of a launcher.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Final, Literal

import attrs
import torch
import torch.distributed as dist

from .. import preemption, worker
from ..failures import Failure, diagnose, order_failures
from ..options import RESTART_ENV, Options
from ..topology import Topology
from ..tree import tree_map
from .lifeline import die_with_parent as die_with_parent  # re-exported: every launcher's rank side uses it

__all__ = [
    "SETTLE_WINDOW",
    "Message",
    "bind_listener",
    "classify",
    "compact_views",
    "die_with_parent",
    "export_rank_env",
    "host_store",
    "join_store",
    "next_call",
    "root_cause_first",
    "run_rank",
    "to_cpu",
]

#: Seconds a launcher gives the other ranks' reports after the first failure, so that the root cause can be told
#: from its consequences (a rank that raised reports after its peers saw it leave).
SETTLE_WINDOW: Final = 0.5

Kind = Literal["ok", "exit", "error"]
#: A rank's one report: ``("ok", value or None)``, ``("exit", Failure)`` or ``("error", Failure)``.
Message = tuple[Kind, Any]


# -- the rank's environment ----------------------------------------------------------------------------------------
def export_rank_env(topology: Topology, attempt: int | None = None) -> None:
    """Make this rank's place visible the way torchrun does (libraries and user code read these variables);
    ``attempt``: the restart attempt, read back by ``ctx.restart`` (`distfn.options.restart_attempt`)."""
    os.environ.update(RANK=str(topology.rank), LOCAL_RANK=str(topology.local_rank),
                      WORLD_SIZE=str(topology.world_size), LOCAL_WORLD_SIZE=str(topology.local_world_size),
                      MASTER_ADDR=str(topology.master_addr), MASTER_PORT=str(topology.master_port))
    if attempt is not None:
        os.environ[RESTART_ENV] = str(attempt)


def bind_listener(host: str, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on a free port of ``host`` (``"127.0.0.1"``: reachable from this machine only; ``""``:
    from the other nodes), bound before the ranks start so that the port is ours."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(max(128, backlog))
    return listener


def host_store(listener: socket.socket, host: str, world_size: int | None, timeout: datetime.timedelta) -> Any:
    """Host the rendezvous store on ``listener`` (which the store owns from now on and closes)."""
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    listener.detach()
    return store


def join_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """Join the rendezvous store that another process hosts at ``host:port``."""
    return dist.TCPStore(host, port, world_size, False, timeout)


# -- the value -------------------------------------------------------------------------------------------------------
def _own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy when it is a view of a larger storage (pickle sends a tensor's whole storage: a
    2-element slice of a 400 MB tensor would carry 400 MB)."""
    if tensor.layout != torch.strided or tensor.is_nested:
        return tensor
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def compact_views(value: Any) -> Any:
    """``value`` with every tensor inside that views a larger storage replaced by a copy of just its bytes, for
    sending to another process (`cfg` under spawn/forkserver)."""
    return tree_map(lambda v: _own_bytes(v) if isinstance(v, torch.Tensor) else v, value)


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples, namedtuples, dict subclasses) detached, on the
    CPU and holding only its own bytes; containers keep their types (`distfn.tree.tree_map`)."""
    return tree_map(lambda v: _own_bytes(v.detach().cpu()) if isinstance(v, torch.Tensor) else v, value)


# -- the report ------------------------------------------------------------------------------------------------------
def classify(rank: int, exc: BaseException) -> Message:
    """What a rank whose function raised ``exc`` reports: ``sys.exit(0)`` (or no code) is an early exit, anything
    else a failure."""
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return "exit", Failure.from_early_exit(rank, exc)
    return "error", Failure.from_exception(rank, exc)


def run_rank(fn: Callable[..., Any], cfg: Any, opts: Options, topology: Topology, *, store: Any,
             deliver: Callable[[Message], None], pack: Callable[[Any], Any], keep_group: bool = False) -> Message:
    """Run this rank through the bootstrap (`distfn.worker.run`) and deliver its one report.

    ``deliver`` is called exactly once: with the failure as soon as the function failed (before the process group
    goes), else with ``("ok", pack(value))`` on rank 0 and ``("ok", None)`` elsewhere (only rank 0's value reaches
    the caller). ``pack`` may raise (a value that cannot be sent): that is this rank's failure. ``keep_group``:
    see `distfn.worker.run` (a rank of a kept-alive job). Returns the message delivered.
    """
    delivered: list[Message] = []
    if keep_group:  # a kept-alive rank: each call starts from the torch state the first one started from
        if not _baseline:
            _baseline.append(TorchState.now())
            _baseline_env.update(os.environ)
        else:
            _baseline[0].restore()
            _fresh_stop_record()

    def once(message: Message) -> None:
        if not delivered:
            delivered.append(message)
            deliver(message)

    try:
        result = worker.run(fn, cfg, opts, topology, store=store, keep_group=keep_group,
                            report=lambda exc: once(classify(topology.rank, exc)))
        once(("ok", pack(result) if topology.rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        once(classify(topology.rank, exc))
    return delivered[0]


def next_call(conn: Connection, topology: Topology) -> tuple[bytes, bytes, Options] | None:
    """In a rank of a kept-alive job, between calls: free what the last call left (its cycles, CUDA's cached
    blocks), then wait for the next call, ``(pickled function parcel, pickled cfg parcel, options)``, and take on
    what a fresh rank would take from the launching process as it is now: its environment changes (on top of the
    environment the rank's first call started with: what a call set in its own is dropped), its working
    directory and its ``sys.path``; ``None``: the pool ends (the launching process closed the pipe or is gone).
    The parcels are loaded by the caller: a failure to is the call's."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        fn, cfg, opts, changed, gone, cwd, path = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError, KeyboardInterrupt):  # Ctrl-C: the launching process stops the idle ranks too
        return None
    # the environment the first call started with (the rank's own variables included), with the launching
    # process's changes since: what the last call set or removed in its own environment does not carry over
    for name in gone:
        _baseline_env.pop(name, None)
    _baseline_env.update(changed)
    if _baseline_env and os.environ != _baseline_env:
        os.environ.clear()
        os.environ.update(_baseline_env)
    else:
        for name in gone:
            os.environ.pop(name, None)
        os.environ.update(changed)
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass  # removed since (the launching process's cwd too): the function's own paths will say so
    export_rank_env(topology, 0)  # a later call is attempt 0 of a job of its own
    return fn, cfg, opts


@attrs.frozen
class TorchState:
    """The process-wide torch settings a function may change and a fresh rank would not have: grad mode, the default
    dtype, the CPU thread count, deterministic algorithms, float32 matmul precision, anomaly detection and the
    cuDNN / TF32 switches. A kept-alive rank takes them before its first call and puts them back before each later
    one (`run_rank`), so a call that ran ``torch.set_grad_enabled(False)`` does not change the next call's result."""

    grad: bool
    dtype: torch.dtype
    threads: int
    deterministic: bool
    deterministic_warn_only: bool
    matmul_precision: str
    anomaly: bool
    cudnn: tuple[bool, bool, bool]
    cuda_tf32: bool

    @classmethod
    def now(cls) -> TorchState:
        cudnn = torch.backends.cudnn
        return cls(torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads(),
                   torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                   torch.get_float32_matmul_precision(), torch.is_anomaly_enabled(),
                   (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32), torch.backends.cuda.matmul.allow_tf32)

    def restore(self) -> None:
        """Put back each setting that differs, and only those: every later call finds the thread count changed (the
        bootstrap sets it per rank), and ``torch.use_deterministic_algorithms`` imports torch._dynamo and inductor
        at its first call (2 s, and a heap that makes every later ``gc.collect`` 2x slower), so setting every field
        at each call made a kept-alive rank's second call cost a fresh launch's import."""
        now = TorchState.now()
        if now == self:
            return
        if now.grad != self.grad:
            torch.set_grad_enabled(self.grad)
        if now.dtype != self.dtype:
            torch.set_default_dtype(self.dtype)
        if now.threads != self.threads:
            torch.set_num_threads(self.threads)
        if (now.deterministic, now.deterministic_warn_only) != (self.deterministic, self.deterministic_warn_only):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        if now.matmul_precision != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if now.anomaly != self.anomaly:
            torch.set_anomaly_enabled(self.anomaly)
        if now.cudnn != self.cudnn:
            cudnn = torch.backends.cudnn
            cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = self.cudnn
        if now.cuda_tf32 != self.cuda_tf32:
            torch.backends.cuda.matmul.allow_tf32 = self.cuda_tf32


_baseline: list[TorchState] = []  # a kept-alive rank's torch state before its first call
_baseline_env: dict[str, str] = {}  # and its environment then, with the launching process's changes since


def _fresh_stop_record() -> None:
    """A kept-alive rank's later call starts with no stop signal on record, as a fresh rank would: the handler the
    rank installed first thing (`distfn.preemption.install` keeps it for every run) still holds what came during
    or after the last call (a SIGUSR2 sent to the rank itself, ``polled`` from a function that polled)."""
    record = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if isinstance(record, preemption.StopSignals):
        record.signal, record.polled, record.raised, record.stopped = None, False, False, False


# -- the verdict -----------------------------------------------------------------------------------------------------
def root_cause_first(failures: Sequence[Failure], early_exits: Sequence[Failure], *, timeout_s: float,
                     returned: Sequence[int], failed: Sequence[int], forwarded: str | None = None,
                     stacks: Callable[[Failure], dict[int, str]] | None = None,
                     elapsed_s: Callable[[Failure], float] | None = None) -> list[Failure]:
    """The failures of a job, the likely root cause first and explained: a rank that left with ``sys.exit(0)`` is
    why its peers lost it, so once anything failed it counts as a failure too (`distfn.failures.order_failures`,
    `distfn.failures.diagnose`). ``stacks`` and ``elapsed_s`` are asked about the root cause: the live ranks'
    stacks (asked only for a collective timeout) and the seconds from the start of the job to it."""
    ordered = order_failures([*failures, *early_exits])
    first = ordered[0]
    ordered[0] = diagnose(first, timeout_s=timeout_s, forwarded=forwarded, returned=returned, failed=failed,
                          stacks=(lambda: stacks(first)) if stacks is not None else dict,
                          elapsed_s=None if elapsed_s is None else elapsed_s(first))
    return ordered
