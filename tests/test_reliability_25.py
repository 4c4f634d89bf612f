"""Issue 25 items 6, 7, 8, 13: a partly meta model keeps its real values in fsdp ``ctx.wrap``; ``ctx.progress``
iterates its iterable once; ``ctx.load(..., rng="if-present")``; a cfg nested deeper than the recursion limit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distfn import ConfigError, distributed


# -- 25.6: a real layer next to a meta-device head -------------------------------------------------------------------
def _partly_meta() -> nn.Sequential:
    body = nn.Linear(8, 8)
    with torch.no_grad():
        body.weight.fill_(7.0)
        body.bias.fill_(7.0)
    with torch.device("meta"):
        head = nn.Linear(8, 4)
    return nn.Sequential(body, nn.ReLU(), head)


@distributed(mode="fsdp", nprocs=2, seed=0)
def _partly_meta_job(cfg, ctx):
    out = {}
    for name, options in (("one_group", {}), ("units", {"min_params": 10})):
        model = ctx.wrap(_partly_meta(), **options)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        out[name] = {n: t.tolist() for n, t in full.items()}
        loss = model(torch.ones(2, 8)).sum()  # it trains: the materialised shards are registered with FSDP
        loss.backward()
    mixed = nn.Linear(8, 8)
    mixed.bias = nn.Parameter(torch.empty(8, device="meta"))
    try:
        ctx.wrap(nn.Sequential(mixed))
    except ConfigError as exc:
        out["mixed"] = str(exc)
    return ctx.gather_object(out)


@pytest.mark.slow
def test_a_partly_meta_model_keeps_its_real_values_in_fsdp_wrap() -> None:
    r0, r1 = _partly_meta_job(None)
    for case in ("one_group", "units"):
        for result in (r0, r1):
            got = {n: torch.tensor(v) for n, v in result[case].items()}
            assert torch.equal(got["0.weight"], torch.full((8, 8), 7.0)), case
            assert torch.equal(got["0.bias"], torch.full((8,), 7.0)), case
            bound = 1 / 8**0.5  # nn.Linear(8, 4).reset_parameters()
            for kind in ("weight", "bias"):
                head = got[f"2.{kind}"]
                assert torch.isfinite(head).all() and head.abs().max() <= bound and head.std() > 0, (case, kind)
        assert r0[case] == r1[case]
    assert "'0'" in r0["mixed"] and "meta device" in r0["mixed"] and "wholly" in r0["mixed"]
