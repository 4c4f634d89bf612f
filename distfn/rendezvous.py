"""How the ranks of a job meet: the rendezvous address, and joining the default process group.

`distfn.topology` decides everything it can from the environment alone; what needs I/O lives here: a multi-node
MPI run without ``MASTER_ADDR`` agrees on an address over mpi4py (`resolve_rendezvous`), rank 0 picks a free port
and an address other nodes can reach, and `init_process_group` joins the group through the right store or URL
(torchrun's agent store, distfn's own store, or ``tcp://``/``env://``/``file://``).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from loguru import logger

from . import process
from .errors import LauncherError
from .topology import Topology

__all__ = [
    "free_port",
    "init_method_url",
    "init_process_group",
    "leave_process_group",
    "resolve_mpi_rendezvous",
    "resolve_rendezvous",
    "routable_address",
    "torchrun_store",
]


def resolve_rendezvous(topology: Topology) -> Topology:
    """Fill in ``master_addr``/``master_port`` where `distfn.topology.detect` could not decide them alone.

    Only a multi-node MPI run without ``MASTER_ADDR`` needs this; every other topology is returned as is.
    Call it after ``detect`` and before ``init_process_group``.
    """
    if topology.master_addr is not None:
        return topology
    return resolve_mpi_rendezvous(topology)


def resolve_mpi_rendezvous(topology: Topology, comm: Any = None) -> Topology:
    """Agree on a rendezvous with ``mpi4py``: rank 0 broadcasts its address and a free port.

    Args:
        topology: an MPI topology whose ``master_addr`` is None.
        comm: the communicator (default ``mpi4py.MPI.COMM_WORLD``); injectable for tests.

    Raises:
        LauncherError: mpi4py is not installed (with both ways to fix it).
    """
    if topology.master_addr is not None:
        return topology
    if comm is None:
        try:
            # deferred: importing mpi4py.MPI initialises MPI itself; only this rare case may pay for it
            from mpi4py import MPI  # type: ignore[import-not-found,unused-ignore]  # optional extra "mpi"
        except ImportError:
            raise LauncherError(
                "a multi-node MPI run needs MASTER_ADDR (e.g. `mpirun -x MASTER_ADDR=$(hostname) -x "
                "MASTER_PORT=29500 ...`) or mpi4py (`pip install 'distfn[mpi]'`) to agree on a rendezvous"
            ) from None
        comm = MPI.COMM_WORLD
    payload = None
    if comm.Get_rank() == 0:
        payload = (routable_address(), free_port())
    addr, port = comm.bcast(payload, root=0)
    return attrs.evolve(topology, master_addr=addr, master_port=port,
                        reason=f"{topology.reason}; rank 0 broadcast {addr}:{port} over mpi4py")


def routable_address() -> str:
    """An address of this host that other nodes can reach (the default route's, else its name's IP)."""
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            return str(probe.getsockname()[0])
        finally:
            probe.close()
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    """A TCP port that nothing on this host listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_method_url(topology: Topology, init_method: str | None) -> str:
    """The ``init_method`` URL for ``init_process_group``: the user's, else ``env://`` or ``tcp://master``."""
    if init_method is not None:
        return init_method
    if topology.launcher == "torchrun" or topology.master_addr is None:
        # torchrun's agent already holds a store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): only env://
        # knows to join it as a client; tcp:// would try to listen on the same port.
        return "env://"
    host = topology.master_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"tcp://{host}:{topology.master_port}"


def torchrun_store(timeout: datetime.timedelta, env: Mapping[str, str] | None = None) -> Any:
    """torchrun's agent store with a key space of its own for each restart attempt, or ``None``.

    torchrun keeps one store across ``--max-restarts`` attempts and never clears it, so the ranks of a
    restarted attempt can read the previous attempt's addresses and fail with gloo's "Connection refused"
    (reproduced with torch 2.13). Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` separates attempts.
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout)
    return dist.PrefixStore(f"distfn/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def init_process_group(
    topology: Topology,
    backend: str,
    timeout: datetime.timedelta,
    *,
    store: Any = None,
    init_method: str | None = None,
    device: torch.device | None = None,
) -> None:
    """Join the job's default process group (rendezvous through ``store`` when the launcher made one).

    ``device``, the rank's own device, is bound to the group when it is a CUDA device (``device_id=``): NCCL then
    creates its communicator there at once, and ``barrier()`` uses it rather than guessing
    ``global_rank % local_device_count`` (which, with ranks not numbered node by node, opens contexts on GPUs the
    rank does not own: "Duplicate GPU detected").
    """
    kwargs: dict[str, Any] = dict(
        backend=backend, rank=topology.rank, world_size=topology.world_size, timeout=timeout
    )
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    if store is None and init_method is None and topology.launcher == "torchrun":
        store = torchrun_store(timeout)
    if store is not None and init_method is None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method_url(topology, init_method)
    dist.init_process_group(**kwargs)


def leave_process_group(*, failed: bool) -> None:
    """Leave the default process group: destroy it after a normal end, abort it after a failure.

    NCCL's destroy is the normal-exit path and waits for pending work, so a rank that raised with a collective in
    flight would sit there until the watchdog kills it (SIGABRT), and its own exception would be lost. Aborting
    returns at once; the failure has been reported before this is called (`distfn.worker.run`).
    """
    if not dist.is_initialized():
        return
    # torch 2.13 has no public abort; _abort_process_group is what torchtitan and torch's own elastic tests use
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None:
        try:
            abort()
        except Exception:  # noqa: BLE001 - a backend without abort: the plain destroy below
            pass
    if dist.is_initialized():
        dist.destroy_process_group()
    if not gloo_threads_idle():
        logger.debug("gloo's work threads still busy {} s after the process group was left", GLOO_IDLE_WAIT_S)


#: How long leaving the process group waits for gloo's work threads to go idle (normally under a millisecond).
GLOO_IDLE_WAIT_S: Final = 2.0


def gloo_threads_idle(timeout: float = GLOO_IDLE_WAIT_S, *, task_dir: str = "/proc/self/task") -> bool:
    """Wait until every gloo work thread of this process sleeps (at most ``timeout`` s); ``True`` when they do.

    Why: a gloo group outlives ``destroy_process_group`` while anything still holds it (DDP's C++ reducer does,
    for as long as the model lives), and its threads release each finished collective's tensors *after* the
    collective has returned to Python. A thread descheduled there (a loaded machine) may do it during the
    interpreter's finalisation, where taking the GIL ends the thread with ``pthread_exit`` and its unwinding
    through ``noexcept`` frames aborts the process: "terminate called without an active exception", SIGABRT
    after the function returned (read in a core dump of a torchrun rank). A thread that sleeps twice in a row,
    the GIL given up in between (so one waiting for it gets it), has nothing left to release. Linux only (thread
    states in ``/proc``); elsewhere it returns ``True`` at once.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        states = _gloo_thread_states(task_dir)
        if not states:
            return True  # no gloo group left (or another backend): nothing to wait for
        quiet = quiet + 1 if all(state in "SI" for state in states) else 0
        if quiet >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # gives up the GIL: a gloo thread waiting for it finishes its release


def _gloo_thread_states(task_dir: str) -> list[str]:
    """The scheduler states (``R``, ``S``, ...) of this process's gloo work threads (named by torch)."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return []
    found = (process.stat(os.path.join(task_dir, tid, "stat")) for tid in tids)  # None: the thread ended
    states = [state for name, state in filter(None, found) if name.startswith("pt_gloo_runloop")]
    return states
