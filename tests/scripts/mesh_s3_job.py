"""``python mesh_s3_job.py URL``: on 4 CPU ranks, HSDP 2 x 2 saves a model to ``URL`` (``s3://...``) with
``blocking=False``; then FSDP 2 x TP 2 loads it from there. Prints one JSON line: the meshes, the saved and the
loaded full weights (tests/test_mesh.py; the S3 endpoint comes from the environment, tests/s3server.py)."""

from __future__ import annotations

import json
import sys

import torch
from mesh_job import Net, tp_plan, weights

from distfn import distributed


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo", mesh={"dp_replicate": 2, "dp_shard": 2})
def save(url: str, ctx):
    torch.manual_seed(1)
    model = ctx.wrap(Net())
    ctx.save({"model": model}, url, blocking=False)
    ctx.saves.wait()
    return {"mesh": list(ctx.mesh.mesh_dim_names), "weights": weights(model)}


@distributed(mode="fsdp", nprocs=4, seed=0, backend="gloo", mesh={"dp_shard": 2, "tp": 2})
def load(url: str, ctx):
    torch.manual_seed(2)
    model = ctx.wrap(Net(), parallelize=tp_plan())
    ctx.load(url, {"model": model})
    return {"mesh": list(ctx.mesh.mesh_dim_names), "weights": weights(model)}


if __name__ == "__main__":
    saved, loaded = save(sys.argv[1]), load(sys.argv[1])
    print(json.dumps({"saved_on": saved["mesh"], "loaded_on": loaded["mesh"], "saved": saved["weights"],
                      "loaded": loaded["weights"]}))
