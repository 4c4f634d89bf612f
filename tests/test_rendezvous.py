"""How ranks meet (distfn.rendezvous): the mpi4py broadcast of a multi-node MPI rendezvous, the init_method URL
and torchrun's agent store. No network: the communicator is faked and no store is created."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

from distfn.errors import LauncherError
from distfn.rendezvous import (
    _gloo_thread_states,
    free_port,
    gloo_threads_idle,
    init_method_url,
    init_process_group,
    leave_process_group,
    resolve_mpi_rendezvous,
    resolve_rendezvous,
    routable_address,
    torchrun_store,
)
from distfn.topology import Topology

# What detect() returns for rank 3 of `mpirun -np 4` over two nodes inside sbatch, mpi4py installed and no
# MASTER_ADDR (tests/test_topology.py: MPIRUN_IN_SBATCH_2NODES_RANK3_RECORDED).
DEFERRED = Topology(launcher="mpi", rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                    num_nodes=2, master_addr=None, master_port=None,
                    reason="OMPI_COMM_WORLD_RANK=3 and OMPI_COMM_WORLD_SIZE=4 are set (Open MPI); rendezvous to "
                           "be broadcast by mpi4py")


class FakeComm:
    """Stands in for mpi4py's COMM_WORLD: bcast returns what rank 0 sent."""

    def __init__(self, rank: int, sent: Any = None) -> None:
        self.rank, self.sent = rank, sent

    def Get_rank(self) -> int:  # mpi4py's name
        return self.rank

    def bcast(self, obj: Any, root: int = 0) -> Any:
        assert root == 0
        return obj if self.rank == 0 else self.sent


def test_resolve_mpi_rendezvous_with_a_communicator() -> None:
    t = resolve_mpi_rendezvous(DEFERRED, comm=FakeComm(rank=3, sent=("10.1.2.3", 41000)))
    assert (t.master_addr, t.master_port, t.rank) == ("10.1.2.3", 41000, 3) and "mpi4py" in t.reason
    t0 = resolve_mpi_rendezvous(attrs.evolve(DEFERRED, rank=0, local_rank=0, node_rank=0), comm=FakeComm(rank=0))
    assert t0.master_addr and t0.master_port and 1 <= t0.master_port <= 65535


def test_resolve_rendezvous_passes_complete_topologies_through() -> None:
    t = Topology.self_spawned(0, 2, 29400)
    assert resolve_rendezvous(t) is t


def test_resolve_rendezvous_without_mpi4py_explains_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(LauncherError, match=r"MASTER_ADDR.*mpi4py"):
        resolve_rendezvous(DEFERRED)


def test_free_port_and_routable_address() -> None:
    port = free_port()
    assert 1 <= port <= 65535
    assert routable_address().count(".") == 3  # an IPv4 address of this host


def test_init_method_url() -> None:
    spawned = Topology.self_spawned(0, 2, 29400)
    assert init_method_url(spawned, None) == "tcp://127.0.0.1:29400"
    assert init_method_url(spawned, "file:///tmp/x") == "file:///tmp/x"  # the user's wins
    ipv6 = attrs.evolve(spawned, launcher="mpi", master_addr="fe80::1")
    assert init_method_url(ipv6, None) == "tcp://[fe80::1]:29400"
    # torchrun's agent holds a store on MASTER_PORT already: only env:// joins it as a client
    assert init_method_url(attrs.evolve(spawned, launcher="torchrun"), None) == "env://"


def test_torchrun_store_only_with_the_agent_store() -> None:
    timeout = datetime.timedelta(seconds=1)
    assert torchrun_store(timeout, {}) is None
    assert torchrun_store(timeout, {"TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": "29500"}) is None


def test_a_cuda_device_is_bound_to_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """device_id= makes NCCL use the rank's GPU for barrier() too (torch 2.13 distributed_c10d.barrier)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    timeout = datetime.timedelta(seconds=5)
    topo = Topology.self_spawned(1, 2, 29400)
    init_process_group(topo, "nccl", timeout, store=object(), device=torch.device("cuda", 1))
    init_process_group(topo, "gloo", timeout, store=object(), device=torch.device("cpu"))
    init_process_group(topo, "gloo", timeout, store=object())
    assert calls[0]["device_id"] == torch.device("cuda", 1)
    assert "device_id" not in calls[1] and "device_id" not in calls[2]


def _one_rank_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_leaving_after_a_failure_aborts_instead_of_destroying(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed: list[bool] = []
    real_destroy = dist.destroy_process_group

    def destroy(*args: Any) -> None:
        destroyed.append(True)
        real_destroy(*args)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    _one_rank_group()
    leave_process_group(failed=True)  # NCCL's destroy would wait for the collective still in flight
    assert not dist.is_initialized() and destroyed == []
    _one_rank_group()
    leave_process_group(failed=False)
    assert not dist.is_initialized() and destroyed == [True]
    leave_process_group(failed=False)  # no group: nothing to do


def _task_dir(tmp: Path, threads: list[tuple[str, str]]) -> Path:
    """A stand-in for ``/proc/self/task``: one ``stat`` per (name, state), as the kernel writes it."""
    tmp.mkdir(exist_ok=True)
    for tid, (name, state) in enumerate(threads, start=100):
        (tmp / str(tid)).mkdir()
        (tmp / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 1 1 0 -1 4194560 0 0\n")
    return tmp


def test_leaving_a_gloo_group_waits_until_its_threads_have_nothing_left_to_release(tmp_path: Path) -> None:
    """A gloo thread that releases a finished collective's tensors during the interpreter's finalisation aborts the
    process: leaving the group waits (bounded) until each of them sleeps, twice in a row."""
    _one_rank_group()
    dist.all_reduce(torch.ones(3))
    leave_process_group(failed=False)
    assert gloo_threads_idle(timeout=5.0)  # a real group's threads, after a real collective
    busy = _task_dir(tmp_path / "busy", [("pt_gloo_runloop", "R"), ("pt_gloo_runloop", "S"), ("python", "R")])
    assert not gloo_threads_idle(timeout=0.05, task_dir=str(busy))  # one still running: bounded, then False
    idle = _task_dir(tmp_path / "idle", [("pt_gloo_runloop", "S"), ("gloo_tcp_loop", "R"), ("py) R (x", "R")])
    assert gloo_threads_idle(timeout=0.05, task_dir=str(idle))  # only the work loops count, names parsed from ')'
    assert gloo_threads_idle(timeout=0.05, task_dir=str(tmp_path / "gone"))  # no /proc: nothing to wait for


def test_gloo_thread_states_read_any_thread_name_the_kernel_may_show(tmp_path: Path) -> None:
    """Thread names are any 15 bytes a program sets (spaces, parentheses included): only the work loops' states."""
    pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    names = st.one_of(st.just("pt_gloo_runloop"), st.text(st.characters(blacklist_characters="\0\n/",
                                                                         codec="utf-8"), max_size=15))
    count = iter(range(10**9))

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(names, st.sampled_from("RSDZTI")), max_size=6))
    def check(threads: list[tuple[str, str]]) -> None:
        task = _task_dir(tmp_path / str(next(count)), threads)
        got = sorted(_gloo_thread_states(str(task)))
        assert got == sorted(state for name, state in threads if name.startswith("pt_gloo_runloop"))

    check()
