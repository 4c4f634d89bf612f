"""A nanoGPT-shaped loop resumed exactly (issue 43; driven by tests/test_exact_resume.py).

python nanogpt_resume_job.py OUT CONFIG_JSON   (the world size comes from DISTFN_NPROCS)

The shape of Karpathy's nanoGPT ``train.py``, ported as a user would: every rank seeded ``1337 + rank``
(``rank_seeds=True``), batches drawn with ``torch.randint`` (``get_batch``) and **prefetched** inside the micro-step
loop, before the backward and ``ctx.step``; gradient accumulation; dropout; AdamW with clipping; evaluation and
``ctx.save`` on rank 0 alone (``if iter_num % eval_interval == 0 and ctx.is_main``) with the model's construction
arguments in the metadata, read back with ``distfn.latest`` + ``read_metadata`` before the model is built. No
``rng=True``, no hand-made RNG snapshot: the prefetched ``X, Y`` travel with ``ctx.step(..., per_rank=)``.

``kills``: iterations at which rank 1 kills itself with SIGKILL (once each). ``prefetch``: ``"before_step"``
(nanoGPT's) or ``"after_step"`` (the next batch drawn after ``ctx.step``, so nothing per-rank needs saving).
At the end rank 0 writes OUT/result.json: the final parameters and the first iteration this attempt ran.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import distfn
from distfn import distributed


class Tiny(nn.Module):
    def __init__(self, vocab: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.drop(self.emb(x)))


@distributed(mode="ddp", seed=1337, rank_seeds=True)
def train(cfg, ctx):
    out = Path(cfg["out"])
    ckpt_dir = out / "ckpt"
    data = torch.randint(0, 32, (4000,), generator=torch.Generator().manual_seed(5))
    block, batch, micro_steps, eval_interval = 8, 4, 2, 4

    def get_batch():
        ix = torch.randint(len(data) - block - 1, (batch,))
        return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])

    model_args = {"vocab": 32, "dim": 16, "dropout": 0.1}
    found = distfn.latest(ckpt_dir)
    if found is not None:  # the model is built from the checkpoint's arguments (nanoGPT's init_from="resume")
        model_args = distfn.checkpoint.read_metadata(found)["model_args"]
    model = ctx.wrap(Tiny(**model_args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt, "iter_num": 0, "per_rank": None}
    ctx.resume(state, ckpt_dir, start=cfg.get("start", "auto"))
    iter_num = first = state["iter_num"]
    if state["per_rank"] is not None:  # the batch this rank had prefetched when the checkpoint's step ended
        X, Y = state["per_rank"]["X"], state["per_rank"]["Y"]
    else:
        X, Y = get_batch()
    before = cfg.get("prefetch", "before_step") == "before_step"
    while iter_num < cfg["iters"]:
        if iter_num % eval_interval == 0 and ctx.is_main:  # rank 0 alone: evaluates (draws) and saves
            raw = ctx.unwrap(model)
            raw.eval()
            with torch.no_grad():
                for _ in range(2):
                    x, y = get_batch()
                    F.cross_entropy(raw(x).flatten(0, 1), y.flatten())
            raw.train()
            if iter_num > 0:
                ctx.save({**state, "iter_num": iter_num}, ckpt_dir / f"ckpt-{iter_num}.safetensors",
                         {"model_args": model_args}, keep=2)
        marker = out / f"killed-{iter_num}"
        if iter_num in cfg["kills"] and not marker.exists():
            ctx.barrier()
            if ctx.rank == 1:
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # rank 0 waits for the launcher to take the job down
        for micro in range(micro_steps):
            model.require_backward_grad_sync = micro == micro_steps - 1
            loss = F.cross_entropy(model(X).flatten(0, 1), Y.flatten()) / micro_steps
            if before or micro < micro_steps - 1:
                X, Y = get_batch()  # prefetch, as nanoGPT does, before the backward
            loss.backward()
        ctx.step(opt, max_grad_norm=1.0, per_rank={"X": X, "Y": Y} if before else None)
        if not before:
            X, Y = get_batch()
        iter_num += 1
    if ctx.is_main:
        params = torch.cat([p.detach().flatten() for p in ctx.unwrap(model).parameters()])
        (out / "result.json").write_text(json.dumps({"params": params.tolist(), "first": first}))


if __name__ == "__main__":
    config = json.loads(sys.argv[2])
    train({**config, "out": sys.argv[1]})
