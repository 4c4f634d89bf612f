"""How ranks meet (distfn.rendezvous): the mpi4py broadcast of a multi-node MPI rendezvous, the init_method URL
and torchrun's agent store. No network: the communicator is faked and no store is created."""

from __future__ import annotations

import datetime
import sys
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

from distfn.errors import LauncherError
from distfn.rendezvous import (
    free_port,
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
