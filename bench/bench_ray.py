"""launcher="ray": wall time of one 2-rank training job on a Ray cluster that is already up, distfn against Ray
Train's ``TorchTrainer`` running the same loop (same seeded model, same per-rank data, DDP over gloo, CPU).

The cluster (one head node, started here unless ``--address`` names a running one) and the driver's connection
are up before any timing; each sample is one whole call from the driver: ``train(cfg)`` with
``@distributed(launcher="ray")`` against ``TorchTrainer(...).fit()``, interleaved. Both must end with the same
weights. Target: distfn ≤ 1.0× TorchTrainer. Needs ``distfn[ray]`` and ``ray[train]``; without them the table is
empty and a note says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

WORLD = 2


def make_model() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))


def batches(rank: int, steps: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]


def flat(model: Any) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().flatten()[:8]]


def distfn_loop(cfg: dict[str, Any], ctx: Any) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = ctx.wrap(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(ctx.rank, cfg["steps"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat(ctx.unwrap(model))


def ray_train_loop(cfg: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = ray.train.get_context().get_world_rank()
    for x, y in batches(rank, cfg["steps"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:  # Ray Train v2 keeps reported metrics only with a checkpoint: the weights go to a file
        Path(cfg["out"]).write_text(json.dumps(flat(model.module)))
    ray.train.report({"steps": cfg["steps"]})


def main() -> None:
    args = c.parser(__doc__.splitlines()[0], rounds=3)
    args.add_argument("--address", default=None, help="a running Ray cluster (default: start one here)")
    opts = args.parse_args()
    rounds = 1 if opts.tiny else opts.rounds
    steps = 20 if opts.tiny else 200
    notes: list[str] = []
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        c.emit({"benchmark": "ray", "tables": [], "notes": [f"skipped: {exc} (pip install 'distfn[ray]' "
                                                            "'ray[train]')"]}, opts.json)
        return
    from distfn import distributed

    ray_cli = str(Path(sys.executable).with_name("ray"))
    address = opts.address
    started = address is None
    if started:
        # Ray keeps an auth token in ~/.ray/auth_token, made by the first local cluster that needs one; a cluster
        # started here that reads another's fails with InvalidAuthToken (it did, in a whole bench/run.py after the
        # tests had run Ray). This process and the cluster it starts get a home of their own, as the tests' do.
        os.environ["HOME"] = tempfile.mkdtemp(prefix="distfn-bench-ray-home-")
        port = 6000 + os.getpid() % 1000
        subprocess.run([ray_cli, "start", "--head", f"--port={port}", f"--num-cpus={WORLD + 1}", "--num-gpus=0",
                        "--object-store-memory=100000000", "--include-dashboard=false", "--disable-usage-stats"],
                       check=True, capture_output=True, timeout=180)
        address = f"127.0.0.1:{port}"
    try:
        ray.init(address=address, log_to_driver=False)
        job = distributed(mode="ddp", launcher="ray", nprocs=WORLD)(distfn_loop)
        storage = tempfile.mkdtemp(prefix="bench-ray-")
        finals: dict[str, list[float]] = {}

        def run_distfn() -> float:
            start = time.perf_counter()
            finals["distfn"] = job({"steps": steps})
            return time.perf_counter() - start

        def run_trainer() -> float:
            out = Path(storage) / "final.json"
            trainer = TorchTrainer(ray_train_loop, train_loop_config={"steps": steps, "out": str(out)},
                                   scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
                                   run_config=RunConfig(storage_path=storage, name=f"t{time.time_ns()}"))
            start = time.perf_counter()
            trainer.fit()
            elapsed = time.perf_counter() - start
            finals["TorchTrainer"] = json.loads(out.read_text())
            return elapsed

        variants = {"Ray Train TorchTrainer": run_trainer, "distfn launcher='ray'": run_distfn}
        samples = c.interleave(variants, rounds, c.log)
        if "distfn" in finals and "TorchTrainer" in finals:
            same = all(abs(a - b) < 1e-5 for a, b in zip(finals["distfn"], finals["TorchTrainer"], strict=True))
            notes.append(f"final weights {'identical' if same else 'DIFFERENT'} between distfn and TorchTrainer")
    finally:
        ray.shutdown()
        if started:
            subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)
    tab = c.table(f"one {WORLD}-rank job of {steps} DDP steps on a Ray cluster already up (CPU, gloo), wall time",
                  "s", samples, baseline="Ray Train TorchTrainer",
                  targets=[{"variant": "distfn launcher='ray'", "max_ratio": 1.0}])
    c.emit({"benchmark": "ray", "tables": [tab], "notes": notes}, opts.json)


if __name__ == "__main__":
    main()
