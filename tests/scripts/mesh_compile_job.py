"""``ctx.wrap(model, compile=True)`` on 4 CPU ranks (gloo) for tests/test_mesh.py: ``python mesh_compile_job.py OUT``
writes OUT/result.json. Three launches, each checking several facts:

1. HSDP 2 x 2 in a fresh compile cache (``TORCHINDUCTOR_CACHE_DIR`` = OUT/compile-cache): the same model
   wrapped twice in one launch, compiled and eager, trained on the same batches (losses and weights, to compare),
   the state dict's keys and a sharded save of the compiled model (its keys on disk), which forwards were compiled
   (the units and the root, before sharding: ``fully_shard`` found them compiled), and the first compiled step's
   seconds (the compile) with the compile cache's hit / miss counters.
2. TP 2 x DP 2: the same, with a tensor-parallel plan (column-wise ``fc``, row-wise ``out`` in each block).
3. Plain FSDP over the 4 ranks, a second start in the same compile cache: the first compiled step's seconds and the
   cache's hits (each unit's forward sees its parameters all-gathered, the same graphs as under HSDP, on the same
   batches: the same losses too).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from distfn import distributed

STEPS, BATCH, WIDTH = 3, 4, 16  # BATCH: per data-parallel rank


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(WIDTH, 4))


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"[01].fc": ColwiseParallel(), "[01].out": RowwiseParallel()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    found = {f"{group}.{name}": int(n) for group in ("inductor", "aot_autograd") for name, n in counters[group].items()
             if "cache" in name}
    return found | {f"graph_break: {reason}": int(n) for reason, n in counters["graph_break"].items()}


def compiled_forwards(model: nn.Module) -> list[str]:
    """The modules whose ``forward`` is a compiled function set on the instance (what `distfn.fsdp.compile_forward`
    does)."""
    return [name for name, m in model.named_modules() if "forward" in vars(m) and hasattr(vars(m)["forward"],
                                                                                            "_torchdynamo_orig_callable")]


def step(ctx, model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(100 * i + ctx.dp_rank))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return ctx.all_reduce(loss.detach()).item()


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo", fsdp={"module_classes": [Block]})
def job(cfg: dict, ctx):
    parallelize = tp_plan() if cfg["tp"] else None
    compiled = ctx.wrap(net(), compile=True, parallelize=parallelize)
    from torch.distributed.fsdp import FSDPModule

    # compiled before fully_shard: the units are FSDP modules whose instance forward is dynamo's wrapper
    units = [n for n, m in compiled.named_modules() if isinstance(m, FSDPModule)]
    wrapped = compiled_forwards(compiled)
    before = counters()
    start = time.perf_counter()
    losses = [step(ctx, compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), 0)]
    first_step_s = time.perf_counter() - start
    cache = {k: v - before.get(k, 0) for k, v in counters().items() if v - before.get(k, 0)}
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    losses += [step(ctx, compiled, opt, i) for i in range(1, STEPS)]
    result = {"first_step_s": first_step_s, "cache": cache, "units": units, "compiled_forwards": wrapped,
              "losses": losses}
    if cfg["eager"]:
        eager = ctx.wrap(net(), parallelize=parallelize)
        start = time.perf_counter()
        eager_losses = [step(ctx, eager, torch.optim.SGD(eager.parameters(), lr=0.1), 0)]
        result["eager_first_step_s"] = time.perf_counter() - start
        opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        eager_losses += [step(ctx, eager, opt, i) for i in range(1, STEPS)]
        ctx.save({"model": compiled}, cfg["save"])
        result |= {"eager_losses": eager_losses, "keys": sorted(compiled.state_dict()),
                   "eager_keys": sorted(eager.state_dict()),
                   "weights": {k: full(v.detach()).tolist() for k, v in compiled.state_dict().items()},
                   "eager_weights": {k: full(v.detach()).tolist() for k, v in eager.state_dict().items()},
                   "mesh": list(ctx.mesh.mesh_dim_names)}
    return ctx.gather_object(result)


def main(out: Path) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / "compile-cache")  # cold at the first launch; workers inherit it
    result = {
        "hsdp": job.options(mesh={"dp_replicate": 2, "dp_shard": 2})({"tp": False, "eager": True,
                                                                     "save": str(out / "hsdp")}),
        "tp": job.options(mesh={"dp_shard": 2, "tp": 2})({"tp": True, "eager": True, "save": str(out / "tp")}),
        "again": job({"tp": False, "eager": False}),
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
