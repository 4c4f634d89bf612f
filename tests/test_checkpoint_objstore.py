"""Object storage under hostile conditions (issue 40 item 5, issue 41 part A items 1-6): every call uses the storage
options it was given (never another call's), a writer killed or raced at any moment loses nothing committed,
``file://`` URLs keep the local path's rules, ``memory://`` is refused in a multi-process job, and a store that is
missing, not S3, silent or gone is a `CheckpointError` naming the URL and the cause within a bounded time.

Runs on moto's S3 server on loopback (tests/s3server.py), in this process.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import equal_state
from s3server import FAST_FAILURE, S3Server, list_keys, needs_s3, s3, s3_module, start

from distfn import checkpoint
from distfn.checkpoint import background

__all__ = ["s3", "s3_module"]  # the fixtures, imported from tests/s3server.py

pytestmark = needs_s3


def _state(seed: int = 0, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g)}, "step": seed}


def _flat(seed: int, n: int = 64) -> dict:
    return {"model.w": _state(seed, n)["model"]["w"]}


# -- issue 40 item 5: a call's storage options are its own ------------------------------------------------------
def test_each_call_uses_its_own_storage_options_never_another_calls(s3: S3Server) -> None:
    """Two endpoints serving the same bucket name: what a call was given (or fsspec's configuration, for a call
    given nothing) is what it uses, whatever an earlier call for that bucket name passed."""
    other = start()
    try:
        a = {"endpoint_url": s3.endpoint, **FAST_FAILURE}
        b = {"endpoint_url": other.endpoint, **FAST_FAILURE}
        pa = checkpoint.save(_state(1), "s3://ckpt/creds/ckpt-1.safetensors", storage_options=a, metadata={"at": "a"})
        pb = checkpoint.save(_state(2), "s3://ckpt/creds/ckpt-2.safetensors", storage_options=b, metadata={"at": "b"})
        # the path a save returns carries its file system: given back, it reads where it was written
        equal_state(checkpoint.load(pa), _flat(1))
        assert checkpoint.read_metadata(pa) == {"at": "a"}
        assert checkpoint.read_metadata("s3://ckpt/creds/ckpt-2.safetensors", storage_options=b) == {"at": "b"}
        # a background save with its own options, while the last options given for this bucket name were b's
        pc = checkpoint.save_in_background(_state(3), "s3://ckpt/creds/ckpt-3.safetensors", storage_options=a)
        background.DEFAULT.wait()
        assert "creds/ckpt-3.safetensors" in list_keys(s3, "creds/")
        assert "creds/ckpt-3.safetensors" not in list_keys(other, "creds/")
        assert checkpoint.latest("s3://ckpt/creds", storage_options=a) == pc
        assert checkpoint.latest("s3://ckpt/creds", storage_options=b) == pb
        # a URL given as text and no options: fsspec's configuration (here: the environment's endpoint, s3's)
        assert checkpoint.latest("s3://ckpt/creds") == pc
        equal_state(checkpoint.load("s3://ckpt/creds/ckpt-3.safetensors"), _flat(3))
    finally:
        other.stop()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("blocking", [True, False])
def test_ctx_save_load_resume_use_the_location_they_resolved(s3: S3Server, mode: str, blocking: bool) -> None:
    """The policy of ``ctx.save`` / ``ctx.resume`` (in this process, world size 1): given options for another
    endpoint than fsspec's configured one, the write (background too, FSDP's path too), the pick of the newest and
    the load all go to the endpoint of the options; the single-file checks ask the store once per save."""
    from distfn import checkpointing
    from distfn.checkpoint import layout
    from distfn.run import Run

    other = start()
    try:
        opts = {"endpoint_url": other.endpoint, **FAST_FAILURE}
        base = f"s3://ckpt/policy-{mode}-{blocking}"
        run = Run(mode=mode)
        calls = []
        real = layout.Location.layout
        layout.Location.layout = lambda self: (calls.append(str(self)), real(self))[1]
        try:
            path = checkpointing.save_state(_state(4), f"{base}/ckpt-4.safetensors", mode=mode, rank=0, run=run,
                                            blocking=blocking, storage_options=opts)
            run.saves.wait()
        finally:
            layout.Location.layout = real
        assert calls.count(f"{base}/ckpt-4.safetensors") == 1, calls  # checked once, not again by the writer
        assert f"policy-{mode}-{blocking}/ckpt-4.safetensors" in list_keys(other, f"policy-{mode}-{blocking}/")
        assert not list_keys(s3, f"policy-{mode}-{blocking}/")
        into = {"model": {"w": torch.zeros(64)}, "step": 0}
        step = checkpointing.resume_state(into, base, mode=mode, rank=0, world_size=1, device=torch.device("cpu"),
                                          run=run, storage_options=opts)
        assert step == 4 and torch.equal(into["model"]["w"], _state(4)["model"]["w"])
        assert checkpointing.load_state(path, into, mode=mode, rank=0, world_size=1, device=torch.device("cpu"),
                                        run=run)["step"] == 4  # the returned path keeps its options
    finally:
        other.stop()
