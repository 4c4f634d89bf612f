"""Property test of the kept-alive ranks' key (`distfn.launch.pool.pool_key`): per-call options never change it, a
process-level option, the process count or a variable a rank reads once always does (issue 46 item 1's hostile pass).
A module of its own: hypothesis is the 'test' extra, which the README's bare install does not have."""

from __future__ import annotations

from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the 'test' extra)")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distfn.launch import pool  # noqa: E402
from distfn.options import Options  # noqa: E402

_PER_CALL = {"seed": st.one_of(st.none(), st.integers(0, 2**31)), "precision": st.sampled_from(["32", "bf16", "16"]),
             "max_restarts": st.integers(0, 3), "requeue": st.booleans(), "track": st.sampled_from([None, "csv"])}
_PROCESS_LEVEL = {"mode": st.sampled_from(["ddp", "fsdp"]), "backend": st.sampled_from([None, "gloo"]),
                  "timeout": st.integers(1, 3600), "start_method": st.sampled_from(["auto", "fork", "spawn"]),
                  "init_method": st.sampled_from([None, "tcp://127.0.0.1:29400"])}
_ENV_NAMES = st.sampled_from(["CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_IB_DISABLE", "GLOO_SOCKET_IFNAME",
                              "TORCH_NCCL_BLOCKING_WAIT", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
                              "HOME", "LR", "WANDB_MODE", "DISTFN_LOG_LEVEL", "PATH"])
_ENV = st.dictionaries(_ENV_NAMES, st.sampled_from(["0", "1", "x"]), max_size=5)


def _options(per_call: dict[str, Any], fixed: dict[str, Any]) -> Options:
    seeded = per_call.get("seed") is not None
    return Options(keep_alive=True, rank_seeds=seeded and per_call["max_restarts"] % 2 == 1, **per_call, **fixed)


@settings(max_examples=80, deadline=None)
@given(one=st.fixed_dictionaries(_PER_CALL), two=st.fixed_dictionaries(_PER_CALL),
       fixed=st.fixed_dictionaries(_PROCESS_LEVEL), other=st.fixed_dictionaries(_PROCESS_LEVEL),
       env=_ENV, env2=_ENV, nprocs=st.integers(1, 4))
def test_pool_key_differs_exactly_where_a_process_level_option_or_variable_does(
        one: dict[str, Any], two: dict[str, Any], fixed: dict[str, Any], other: dict[str, Any],
        env: dict[str, str], env2: dict[str, str], nprocs: int) -> None:
    def fn(cfg: Any, ctx: Any) -> None: ...

    # per-call options (rank_seeds included: it once made every keep_alive call raise) never change the key
    key = pool.pool_key(fn, _options(one, fixed), nprocs, env)
    assert pool.pool_key(fn, _options(two, fixed), nprocs, env) == key
    # a process-level option, the process count, or a variable read once per process does; nothing else does
    assert (pool.pool_key(fn, _options(one, other), nprocs, env) == key) == (fixed == other)
    assert pool.pool_key(fn, _options(one, fixed), nprocs + 1, env) != key
    read_once = {k: v for k, v in env.items() if k.startswith(pool.PROCESS_ENV_PREFIXES)}
    read_once2 = {k: v for k, v in env2.items() if k.startswith(pool.PROCESS_ENV_PREFIXES)}
    assert (pool.pool_key(fn, _options(one, fixed), nprocs, env2) == key) == (read_once == read_once2)
