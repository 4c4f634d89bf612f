"""2-D parallelism jobs for tests/test_mesh.py: ``python mesh_job.py OUT`` runs every case on 4 CPU ranks (gloo) and
writes OUT/result.json (``DISTFN_BACKEND=nccl`` on 4 GPUs: the same on CUDA, bench/gpu_check.sh). One launch per
mesh, each checking several facts:

1. HSDP 2 x 2 (``mesh={"dp_replicate": 2, "dp_shard": 2}``) against a hand-written FSDP2 HSDP of the same model
   trained on the same batches in the same job (weights equal after STEPS steps); the sampler's shares; a sharded save.
2. TP 2 x DP 2 (``train.options(mesh={"dp_shard": 2, "tp": 2})``, a torch plan) against the same model trained in one
   process on the global batch; the HSDP checkpoint loaded onto this mesh (values equal to the saved ones).
3. The HSDP checkpoint loaded onto FSDP 4 (no mesh) and HSDP 1 x 4; then into one process (``distfn.load``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distfn
import distfn.checkpoint
from distfn import distributed

STEPS, BATCH, WIDTH = 4, 4, 8  # BATCH: per data-parallel rank


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights(model: nn.Module) -> dict[str, list]:
    return {k: full(v.detach()).tolist() for k, v in model.state_dict().items()}


def train_steps(ctx, model, loader, *, first: int = 0, save_to: str | None = None, opt=None) -> list[float]:
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(loader, start=first):
        if step == STEPS:
            break
        loss = nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(ctx.all_reduce(loss.detach()).item())
        if save_to is not None and step + 1 == STEPS // 2:  # mid-run: model, momentum, loader position
            ctx.save({"model": model, "optimizer": opt, "loader": loader, "step": step + 1},
                     f"{save_to}/ckpt-{step + 1}")
    return losses


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo", mesh={"dp_replicate": 2, "dp_shard": 2})
def hsdp(out: str, ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    bare = Net()
    reference = Net()
    reference.load_state_dict(bare.state_dict())
    model = ctx.wrap(bare)
    loader = ctx.dataloader(dataset(), BATCH, shuffle=False)
    indices = list(iter(loader.sampler))
    losses = train_steps(ctx, model, loader, save_to=f"{out}/mid")
    # hand-written FSDP2 HSDP of the same model on the same batches: the sampler's order, sliced by dp rank
    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("r", "s"))
    fully_shard(reference, mesh=mesh)
    data = dataset()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    dp = mesh.get_local_rank("r") * 2 + mesh.get_local_rank("s")
    for step in range(STEPS):
        rows = [dp + 4 * (step * BATCH + i) for i in range(BATCH)]  # DistributedSampler(shuffle=False): rank::4
        x, y = data[rows]
        loss = nn.functional.mse_loss(reference(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    ctx.save({"model": model, "step": STEPS}, f"{out}/hsdp-{STEPS}")
    ctx.save({"model": model, "step": STEPS}, f"{out}/hsdp-{STEPS}.safetensors")  # one file: gathered to rank 0
    ctx.save({"model": model, "step": STEPS}, f"{out}/async-{STEPS}", blocking=False)  # the same, in the background
    ctx.saves.wait()
    placements = {k: [str(p) for p in v.placements] for k, v in model.state_dict().items()}
    return ctx.gather_object({
        "rank": ctx.rank, "mesh": list(ctx.mesh.mesh_dim_names), "shape": list(ctx.mesh.shape),
        "dp": [ctx.dp_rank, ctx.dp_size], "indices": indices, "losses": losses, "weights": weights(model),
        "reference": weights(reference), "placements": placements})


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo")
def tp(out: str, ctx):
    torch.manual_seed(0)
    bare = Net()
    single = Net()
    single.load_state_dict(bare.state_dict())
    loaded = Net()
    model = ctx.wrap(bare, parallelize=tp_plan())
    loader = ctx.dataloader(dataset(), BATCH, shuffle=False)
    indices = list(iter(loader.sampler))
    losses = train_steps(ctx, model, loader)
    # the same model in one process on the global batch (BATCH x dp_size rows a step, in the samplers' order)
    data, opt = dataset(), torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    single_losses = []
    for step in range(STEPS):
        x, y = data[list(range(step * BATCH * 2, (step + 1) * BATCH * 2))]
        loss = nn.functional.mse_loss(single(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        single_losses.append(loss.item())
    gathered = ctx.gather_for_metrics(torch.tensor(indices[:BATCH]), loader)
    resumed = ctx.wrap(loaded, parallelize=tp_plan())
    rest = ctx.load(f"{out}/hsdp-{STEPS}", {"model": resumed, "step": 0})
    from_file = ctx.wrap(Net(), parallelize=tp_plan())
    ctx.load(f"{out}/hsdp-{STEPS}.safetensors", {"model": from_file})  # one file, scattered onto this mesh
    placements = {k: [str(p) for p in v.placements] for k, v in model.state_dict().items()}
    ctx.save({"model": model}, f"{out}/tp-{STEPS}")
    # the HSDP run's mid-run checkpoint resumed on this mesh: the rest of its steps, on the same samples
    torch.manual_seed(5)
    again = ctx.wrap(Net(), parallelize=tp_plan())
    opt_again = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    loader_again = ctx.dataloader(dataset(), BATCH, shuffle=False)
    state = {"model": again, "optimizer": opt_again, "loader": loader_again, "step": 0}
    start = ctx.resume(state, f"{out}/mid")
    continued = train_steps(ctx, again, loader_again, first=start, opt=opt_again)
    return ctx.gather_object({
        "rank": ctx.rank, "mesh": list(ctx.mesh.mesh_dim_names), "dp": [ctx.dp_rank, ctx.dp_size],
        "indices": indices, "losses": losses, "single_losses": single_losses, "weights": weights(model),
        "single": weights(single), "placements": placements, "gathered": gathered.tolist(),
        "loaded": weights(resumed), "from_file": weights(from_file), "rest": rest, "start": start,
        "continued": continued,
        "per_rank_batch": loader_again.batch_size,
        "sums": [ctx.all_reduce(1, "sum"), ctx.all_reduce(1, "sum", over="world"), ctx.all_reduce(ctx.rank, "max")]})


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo")
def reload(path: str, ctx):
    model = ctx.wrap(Net())
    ctx.load(path, {"model": model})
    return ctx.gather_object({"mesh": list(ctx.mesh.mesh_dim_names), "shape": list(ctx.mesh.shape),
                              "loaded": weights(model)})


def main(out: Path) -> None:
    result: dict = {}
    result["hsdp"] = hsdp(str(out))
    result["tp"] = tp.options(mesh={"dp_shard": 2, "tp": 2})(str(out))
    result["fsdp4"] = reload(str(out / f"hsdp-{STEPS}"))
    result["hsdp14"] = reload.options(mesh={"dp_replicate": 1, "dp_shard": 4})(str(out / f"hsdp-{STEPS}"))
    result["from_tp"] = reload.options(mesh={"dp_replicate": 2, "dp_shard": -1})(str(out / f"tp-{STEPS}"))
    result["one"] = {k.removeprefix("model."): v.tolist() for k, v in distfn.load(out / f"hsdp-{STEPS}").items()}
    result["async"] = {k.removeprefix("model."): v.tolist() for k, v in distfn.load(out / f"async-{STEPS}").items()}
    distfn.checkpoint.consolidate(out / f"hsdp-{STEPS}", out / "consolidated.safetensors")
    result["consolidated"] = {k.removeprefix("model."): v.tolist()
                              for k, v in distfn.load(out / "consolidated.safetensors").items()}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
