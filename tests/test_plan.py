"""distfn.plan: one pure answer to "how will this call run?", and what follows from having only one (issue 24).

The plan is asked by the decorator at each call, at decoration (whether to start the fork server) and by
``distfn env``; these tests hold it to being pure (no name lookup, no mutation), check each kind, and check the
defects that came from its copies: decoration that raised and looked up hosts (24.1, 25.11), ``distfn env``
reporting another job than the one that runs (24.2), and ranks that behaved differently under Ray (24.4).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import types
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import attrs
import pytest
from loguru import logger
from test_pernode import SRUN_N2_PERNODE1_TASK0_RECORDED, SRUN_N2_PERNODE1_TASK1_RECORDED

from distfn import distributed
from distfn import envreport as cli
from distfn.errors import ConfigError, LauncherError, WorkerError
from distfn.failures import Failure
from distfn.launch import protocol
from distfn.launch import ray as ray_launch
from distfn.options import Options
from distfn.plan import KINDS, CallPlan, plan_call
from distfn.topology import Topology

TORCHRUN_RANK1: Mapping[str, str] = {
    "TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
}


def _fn(cfg: Any, ctx: Any) -> Any:
    return cfg


def refuse_gpus() -> int:
    raise AssertionError("the GPU count must not be asked here")


def plan(env: Mapping[str, str], opts: Options | None = None, gpus: Any = refuse_gpus, nested: bool = False,
         argv: tuple[str, ...] = ()) -> CallPlan:
    return plan_call(opts or Options(), types.MappingProxyType(dict(env)), argv, gpus, nested)


@pytest.fixture
def no_name_lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fail on any host name lookup; yields the names looked up (none, when the test passes)."""
    looked: list[str] = []

    def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        looked.append(str(host))
        raise AssertionError(f"name lookup of {host!r}")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket, "gethostbyname", lookup)
    yield looked


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    yield lines
    logger.remove(sink)


# -- the plan's kinds ------------------------------------------------------------------------------------------------
def test_every_kind_from_its_environment(no_name_lookups: list[str]) -> None:
    assert plan({}, nested=True).kind == "nested"
    assert plan({"DISTFN_LAUNCHER": "ray"}).kind == "ray"
    assert plan({}, Options(mode="single")).kind == "one-process"
    assert plan({}, Options(nprocs=2)).kind == "spawn"
    in_place = plan(TORCHRUN_RANK1, Options(nprocs=2))
    assert (in_place.kind, in_place.nprocs, in_place.world_size, in_place.local_ranks()) == ("in-place", 1, 2,
                                                                                             [(1, 1)])
    pernode = plan(SRUN_N2_PERNODE1_TASK0_RECORDED, Options(), gpus=lambda: 2)
    assert pernode.kind == "pernode" and pernode.launches
    assert {plan_.kind for plan_ in (in_place, pernode)} <= set(KINDS)
    assert no_name_lookups == []


def test_spawn_counts_the_gpus_only_when_nothing_says_how_many() -> None:
    counted = plan({}, gpus=lambda: 3)
    assert (counted.kind, counted.nprocs, counted.source, counted.world_size) == ("spawn", 3,
                                                                                "visible CUDA devices", 3)
    assert counted.local_ranks() == [(0, 0), (1, 1), (2, 2)]
    assert plan({"DISTFN_NPROCS": "2"}).source == "DISTFN_NPROCS"  # refuse_gpus: never asked
    one = plan({}, gpus=lambda: 0)
    assert (one.kind, one.nprocs, one.topology) == ("one-process", 1, Topology.local())
    assert one.reason == "one process, run in place (no CUDA: one process)"


def test_the_plan_applies_the_environments_overrides_once() -> None:
    planned = plan({"DISTFN_PRECISION": "bf16", "DISTFN_NPROCS": "2"})
    assert planned.opts.precision == "bf16" and planned.nprocs == 2
    with pytest.raises(ConfigError, match="DISTFN_TIMEOUT='inf'"):
        plan({"DISTFN_TIMEOUT": "inf"})


def test_planning_does_not_look_up_hosts_or_touch_the_environment(no_name_lookups: list[str]) -> None:
    env = {**SRUN_N2_PERNODE1_TASK0_RECORDED, "MASTER_ADDR": "no-such-host.invalid", "DISTFN_NPROCS": "2"}
    frozen = types.MappingProxyType(dict(env))
    planned = plan_call(Options(), frozen, (), refuse_gpus, False)
    assert planned.kind == "pernode" and planned.layout is not None
    assert planned.layout.master_addr == "no-such-host.invalid" and no_name_lookups == []
    assert dict(frozen) == env


# -- 24.2: `distfn env` prints the plan the call executes ------------------------------------------------------------
def test_one_task_per_node_plan_has_the_whole_job_and_this_nodes_workers() -> None:
    nodes = [plan({**env, "DISTFN_NPROCS": "4"}) for env in (SRUN_N2_PERNODE1_TASK0_RECORDED,
                                                             SRUN_N2_PERNODE1_TASK1_RECORDED)]
    assert [(p.kind, p.nprocs, p.world_size) for p in nodes] == [("pernode", 4, 8)] * 2
    assert [p.local_ranks() for p in nodes] == [[(r, r) for r in range(4)], [(4 + r, r) for r in range(4)]]


def test_distfn_env_reports_the_per_node_job_that_runs() -> None:
    """Under one Slurm task per node with DISTFN_NPROCS=4 on 2 nodes the call runs 8 ranks: so says distfn env
    (it said world size 2 and one device per node)."""
    info = cli.collect({**SRUN_N2_PERNODE1_TASK1_RECORDED, "DISTFN_NPROCS": "4", "CUDA_VISIBLE_DEVICES": ""})
    assert info["plan"]["kind"] == "pernode" and info["plan"]["world_size"] == 8
    assert info["plan"]["ranks"] == [4, 5, 6, 7] and [d["local_rank"] for d in info["plan"]["devices"]] == [0, 1, 2, 3]
    text = cli.render(info)
    assert "4 workers on each of 2 nodes" in text and "world size           8" in text
    assert "node 1 of 2: ranks 4-7" in text


# -- 24.1 / 25.11: decoration judges only the arguments; the call judges the environment -----------------------------
@pytest.mark.parametrize("env", [
    {"RANK": "0"},  # a stray variable
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},  # a partial env:// set: MASTER_PORT missing
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"},
    {"DISTFN_TIMEOUT": "inf"},
    {"DISTFN_NPROCS": "two"},
], ids=["stray-rank", "partial-env", "unresolvable-master", "timeout-inf", "bad-nprocs"])
def test_decoration_never_judges_the_environment(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    real_lookup = socket.getaddrinfo
    looked: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: looked.append(host) or real_lookup(host, *a, **k))
    train = distributed(mode="ddp", nprocs=2)(_fn)  # what `import train` does: must not raise, nor look up hosts
    again = train.options(precision="bf16")  # type: ignore[attr-defined]
    assert looked == []
    with pytest.raises((LauncherError, ConfigError)):  # the call says what is wrong
        again({})


def test_the_call_checks_the_master_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    train = distributed(mode="ddp")(_fn)
    with pytest.raises(LauncherError, match=r"'no-such-host\.invalid'.*does not resolve"):
        train({})


@pytest.mark.parametrize("timeout", [math.inf, -math.inf, math.nan, 1e300])
def test_non_finite_timeouts_are_config_errors(timeout: float) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        distributed(timeout=timeout)(_fn)
    with pytest.raises(ConfigError, match="timeout"):
        distributed(_fn).options(timeout=timeout)  # type: ignore[attr-defined]
    assert Options(timeout=30).timeout == datetime.timedelta(seconds=30)


# -- 24.4: one rank-side protocol, the same rules under Ray -----------------------------------------------------------
def test_max_restarts_has_no_effect_under_ray_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                          warnings_logged: list[str]) -> None:
    monkeypatch.setattr(ray_launch, "launch", lambda fn, cfg, opts: ("ray ran", opts.max_restarts))
    assert distributed(launcher="ray", nprocs=2, max_restarts=3)(_fn)({}) == ("ray ran", 3)
    assert any("max_restarts=3 has no effect here: Ray starts the ranks as actors" in line
               for line in warnings_logged)
    assert plan({"DISTFN_LAUNCHER": "ray"}, Options(nprocs=2, max_restarts=1)).notes[0].level == "WARNING"


def test_a_ray_rank_that_exits_with_status_0_reports_an_early_exit() -> None:
    """The actor's side, run here without Ray: a world of one over a store the actor hosts itself."""
    actor = ray_launch.RankActor()
    port = actor.bind_port()
    topo = Topology(launcher="ray", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                    num_nodes=1, master_addr="127.0.0.1", master_port=port, reason="test")

    def leaves(cfg: Any, ctx: Any) -> None:
        raise SystemExit(0)

    with mock.patch.dict(os.environ):  # the actor exports the rank's variables: not into the other tests
        kind, record = actor.run(leaves, None, Options(backend="gloo", timeout=60), topo, None)
    assert kind == "exit" and isinstance(record, Failure) and record.rank == 0


class _FakeRay:
    """Just enough of the ``ray`` module for `RayJob`'s bookkeeping: ``get`` returns the answer itself."""

    class exceptions:  # mirrors ray.exceptions
        class RayError(Exception):
            pass

        class RayActorError(RayError):
            pass

    @staticmethod
    def get(ref: Any) -> Any:
        return ref


def test_the_ray_driver_treats_an_early_exit_as_under_self_spawn() -> None:
    exit_1 = protocol.classify(1, SystemExit(0))
    job = ray_launch.RayJob(_FakeRay(), 2, 0, Options())
    job._receive(("ok", 42), 0)
    job._receive(exit_1, 1)
    assert job.outcome() == 42  # alone, an early exit is no error
    failed = ray_launch.RayJob(_FakeRay(), 2, 0, Options())
    failed._receive(protocol.classify(0, RuntimeError("boom")), 0)
    failed._receive(exit_1, 1)
    with pytest.raises(WorkerError) as info:
        failed.outcome()
    assert {f.rank for f in info.value.failures} == {0, 1}  # with a failure, the rank that left is named too


def test_what_decided_the_count_is_a_value_beside_its_wording() -> None:
    """Issue 40 item 6: ``CallPlan.counted_by`` says what decided ``nprocs`` as a `Literal`, so ``distfn env`` no
    longer searches ``source``'s sentence for "DISTFN_NPROCS" (a wording change would have changed its notes)."""
    two = Options(nprocs=2)
    assert plan({"DISTFN_NPROCS": "3"}).counted_by == "DISTFN_NPROCS"
    assert plan({}, two).counted_by == "nprocs="
    assert plan({}, Options(mode="single")).counted_by == "mode"
    assert plan({}, gpus=lambda: 0).counted_by == "no-cuda"
    assert plan(TORCHRUN_RANK1).counted_by == "launcher"
    assert plan({}, nested=True).counted_by == "nested"
    assert plan(SRUN_N2_PERNODE1_TASK0_RECORDED, Options(), gpus=lambda: 2).counted_by == "gpus"
    assert plan({**SRUN_N2_PERNODE1_TASK0_RECORDED, "DISTFN_NPROCS": "2"}).counted_by == "DISTFN_NPROCS"
    reworded = attrs.evolve(plan({}, two), source="two workers, not from DISTFN_NPROCS")
    cuda = {"device_count": 0, "mapping": []}
    assert cli.COUNT_NOTE in cli._plan(reworded, None, cuda)["notes"]
