"""2-D parallelism (issue 45): distfn's HSDP and FSDP x TP steps vs the same written by hand in torch, the sharded
save of HSDP 2 x 2 state vs torch DCP's ``FileSystemWriter``, and a load that reshards (saved on HSDP 2 x 2, loaded
on TP 2 x DP 2) vs a load onto the mesh it was saved on.

Two ``mode="fsdp"`` launches of 4 CPU ranks (gloo), each interleaving its variants round by round (rotated order):

* HSDP launch, ``mesh={"dp_replicate": 2, "dp_shard": 2}``: ``distfn ctx.wrap (HSDP)`` vs ``hand-written
  fully_shard(mesh=2x2)`` (an ``init_device_mesh`` of its own; each layer its own unit, then the root, as distfn's
  plan does: a comparison of the same FSDP units), ``--steps`` forward / backward / Adam steps of an
  MLP of ``--layers`` x ``Linear(--width)``, a sample = rank 0's time per step between barriers; then
  ``distfn sharded save`` (``ctx.save(state, dir)``) vs ``DCP FileSystemWriter`` (``dcp.save`` of the same model and
  Adam state dicts), a sample = barrier to barrier around one save.
* TP launch, ``mesh={"dp_shard": 2, "tp": 2}``: ``distfn ctx.wrap(parallelize=plan)`` vs ``hand-written
  parallelize_module + fully_shard`` (the same plan: every other Linear column-wise, the next row-wise); then
  ``ctx.load`` of the HSDP launch's checkpoint (``reshard load``) vs of this launch's own (``same-mesh load``).

Targets: distfn's steps <= 1.02x hand-written; distfn sharded save <= 1.0x DCP. The reshard load is reported
against the same-mesh load (no target: reading other ranks' boxes is the work a reshard is).
Run: ``python bench/bench_mesh.py [--tiny] [--json out.json] [--rounds N]``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 4


def _model(width: int, layers: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _plan(layers: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}


def _recipe(model: Any, mesh: Any, cfg: dict[str, Any]) -> None:
    """FSDP2's recipe by hand: each layer its own ``fully_shard`` unit, then the root, as distfn's plan does for
    these layers (each holds >= ``min_params``, 1,000,000 by default, at ``--width`` 1024)."""
    from torch.distributed.fsdp import fully_shard

    if cfg["width"] * cfg["width"] >= 1_000_000:
        for layer in model:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _steps(ctx: Any, model: Any, opt: Any, cfg: dict[str, Any]) -> float:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(ctx.dp_rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return (time.perf_counter() - start) / cfg["steps"]


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rotate(variants: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 is a warm-up, not recorded
        for name in names[r % len(names):] + names[:r % len(names)]:
            value = variants[name]()
            if r:
                out[name].append(value)
    return out


def hsdp_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    ours = ctx.wrap(_model(cfg["width"], cfg["layers"]))
    theirs = _model(cfg["width"], cfg["layers"])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _recipe(theirs, mesh, cfg)
    opt_ours, opt_theirs = torch.optim.Adam(ours.parameters()), torch.optim.Adam(theirs.parameters())
    steps = _rotate({"distfn ctx.wrap (HSDP)": lambda: _steps(ctx, ours, opt_ours, cfg),
                     "hand-written fully_shard(mesh=2x2)": lambda: _steps(ctx, theirs, opt_theirs, cfg)},
                    cfg["rounds"])
    tmp = Path(cfg["tmp"])
    count = iter(range(10**6))

    def distfn_save() -> None:
        ctx.save({"model": ours, "optimizer": opt_ours}, tmp / f"distfn-{next(count)}")

    def dcp_save() -> None:
        state = {"model": ours.state_dict(), "optimizer": opt_ours.state_dict()}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp / f"dcp-{next(count)}")))

    saves = _rotate({"distfn sharded save": lambda: _timed(distfn_save),
                     "DCP FileSystemWriter": lambda: _timed(dcp_save)}, cfg["rounds"])
    ctx.save({"model": ours}, tmp / "hsdp")
    return {"steps": steps, "saves": saves}


def tp_job(cfg: dict[str, Any], ctx: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ours = ctx.wrap(_model(cfg["width"], cfg["layers"]), parallelize=_plan(cfg["layers"]))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = parallelize_module(_model(cfg["width"], cfg["layers"]), mesh["tp"], _plan(cfg["layers"]))
    _recipe(theirs, mesh["dp"], cfg)
    opt_ours, opt_theirs = torch.optim.Adam(ours.parameters()), torch.optim.Adam(theirs.parameters())
    steps = _rotate({"distfn ctx.wrap(parallelize=plan)": lambda: _steps(ctx, ours, opt_ours, cfg),
                     "hand-written parallelize_module + fully_shard": lambda: _steps(ctx, theirs, opt_theirs, cfg)},
                    cfg["rounds"])
    tmp = Path(cfg["tmp"])
    ctx.save({"model": ours}, tmp / "tp")
    loads = _rotate({"same-mesh load (TP 2 x DP 2)": lambda: _timed(lambda: ctx.load(tmp / "tp", {"model": ours})),
                     "reshard load (HSDP 2x2 -> TP 2 x DP 2)": lambda: _timed(
                         lambda: ctx.load(tmp / "hsdp", {"model": ours}))}, cfg["rounds"])
    return {"steps": steps, "loads": loads}


def main(argv: list[str] | None = None) -> int:
    from distfn import distributed

    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.width, args.layers, args.steps = 1, 16, 2, 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-mesh-"))
    cfg = {"width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
           "rounds": args.rounds, "tmp": str(tmp)}
    try:
        c.log(f"mesh: HSDP 2x2 launch, {args.rounds} round(s)")
        hsdp = distributed(mode="fsdp", nprocs=WORLD, seed=0, backend="gloo",
                           mesh={"dp_replicate": 2, "dp_shard": 2})(hsdp_job)(cfg)
        c.log(f"mesh: TP 2 x DP 2 launch, {args.rounds} round(s)")
        tp = distributed(mode="fsdp", nprocs=WORLD, seed=0, backend="gloo",
                         mesh={"dp_shard": 2, "tp": 2})(tp_job)(cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shape = f"MLP {args.layers} x Linear({args.width}), Adam, batch {args.batch}/dp rank"
    tables = [
        c.table(f"HSDP 2 x 2 step, {WORLD} ranks (gloo, CPU), {shape}", "s", hsdp["steps"],
                "hand-written fully_shard(mesh=2x2)",
                targets=[{"variant": "distfn ctx.wrap (HSDP)", "max_ratio": 1.02}]),
        c.table(f"FSDP 2 x TP 2 step, {WORLD} ranks (gloo, CPU), {shape}", "s", tp["steps"],
                "hand-written parallelize_module + fully_shard",
                targets=[{"variant": "distfn ctx.wrap(parallelize=plan)", "max_ratio": 1.02}]),
        c.table(f"Sharded save of HSDP 2 x 2 model + Adam state, {WORLD} ranks", "s", hsdp["saves"],
                "DCP FileSystemWriter", targets=[{"variant": "distfn sharded save", "max_ratio": 1.0}]),
        c.table(f"Load of the model onto TP 2 x DP 2, {WORLD} ranks", "s", tp["loads"],
                "same-mesh load (TP 2 x DP 2)"),
    ]
    c.emit({"benchmark": "mesh", "tables": tables, "notes": [
        "Each launch interleaves its variants in one process group (a warm-up round first, unrecorded); a sample "
        "is rank 0's time between barriers.",
        "Step samples are per step over --steps steps; save and load samples are one call each."]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
