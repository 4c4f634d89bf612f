"""Checkpoints on object storage (issue 28): the same calls with s3:// (a real S3 API, moto's server on loopback),
memory:// and file:// URLs, through distfn.checkpoint.remote (fsspec), with commit objects.

In this process: single-file and sharded saves and loads, keep=, latest, consolidate (the CLI too), what an
uncommitted object is (invisible), missing bucket, wrong credentials, throttling, a server stopped mid-upload, a
bare install without fsspec. In subprocesses: kill -9 of a writer mid-upload (single file), and a 2-rank job that
saves sharded to s3://, resumes bit-exactly, and has a rank killed mid-upload of a sharded save.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_helpers import equal_state, repo_env
from s3server import FAST_FAILURE, S3Server, list_keys, needs_s3, s3, s3_module, start, uploads, use

import distfn
from distfn import checkpoint
from distfn.checkpoint import remote, retries
from distfn.errors import CheckpointError

__all__ = ["s3", "s3_module"]  # the fixtures, imported from tests/s3server.py

pytestmark = needs_s3


def _state(seed: int = 0, big: int = 1 << 10) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(big, generator=g), "b": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
            "step": seed, "name": "run"}


# -- the same calls on s3://, memory://, file:// ----------------------------------------------------------------
def _roundtrip(base: str) -> None:
    first = checkpoint.save(_state(1), f"{base}/run/ckpt-1.safetensors", keep=2)
    assert str(first) == f"{base}/run/ckpt-1.safetensors".replace("memory://", "memory:///")
    checkpoint.save(_state(2), f"{base}/run/ckpt-2.safetensors", keep=2)
    newest = checkpoint.save(_state(3), f"{base}/run/ckpt-3.safetensors", keep=2, metadata={"lr": 0.5})
    assert checkpoint.latest(f"{base}/run") == newest
    loaded = checkpoint.load(newest)
    equal_state(loaded, {"model.w": _state(3)["model"]["w"], "model.b": _state(3)["model"]["b"]})
    into = {"model": {"w": torch.zeros(1 << 10), "b": torch.zeros(3, 5, dtype=torch.bfloat16)}, "step": 0}
    assert checkpoint.load_into(newest, into)["step"] == 3
    assert torch.equal(into["model"]["w"], _state(3)["model"]["w"])
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(f"{base}/run/ckpt-1.safetensors")  # removed by keep=2
    d = checkpoint.sharded.save(_state(4), f"{base}/run/ckpt-4", keep=1)
    assert checkpoint.latest(f"{base}/run") == d
    equal_state(checkpoint.load(d), checkpoint.load(newest) | {"model.w": _state(4)["model"]["w"],
                                                          "model.b": _state(4)["model"]["b"]})
    out = checkpoint.consolidate(d, f"{base}/one.safetensors")
    equal_state(checkpoint.load(out), checkpoint.load(d))
    assert checkpoint.read_metadata(newest) == {"lr": 0.5}


def test_s3_saves_loads_keep_latest_sharded_and_consolidate(s3: S3Server) -> None:
    _roundtrip(s3.url())
    keys = list_keys(s3, "run/")
    # keep=2 left ckpt-2 and ckpt-3 (each with its commit object), the sharded ckpt-4; no lease, no upload left
    assert [k for k in keys if "/" not in k[4:]] == ["run/.ckpt-2.safetensors.distfn-commit",
                                                     "run/.ckpt-3.safetensors.distfn-commit",
                                                     "run/ckpt-2.safetensors", "run/ckpt-3.safetensors"]
    assert sorted(k for k in keys if k.startswith("run/ckpt-4/") and not k.rsplit("/", 1)[1].startswith(".")) == [
        "run/ckpt-4/model.safetensors.index.json", "run/ckpt-4/shard-00001-model-00001-of-00001.safetensors"]
    assert uploads(s3) == []


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_memory_and_file_urls_go_through_the_same_code(scheme: str, tmp_path: Path) -> None:
    base = "memory://distfn-test" if scheme == "memory" else f"file://{tmp_path}"
    _roundtrip(base)
    if scheme == "file":  # real files: what another tool reads
        from safetensors.torch import load_file

        assert torch.equal(load_file(tmp_path / "run" / "ckpt-3.safetensors")["model.w"], _state(3)["model"]["w"])


def test_storage_options_are_passed_through_and_kept_by_the_returned_path(s3: S3Server, monkeypatch) -> None:
    monkeypatch.delenv("FSSPEC_S3_ENDPOINT_URL")
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {})
    url = "s3://ckpt/opts/ckpt-1.safetensors"
    path = checkpoint.save(_state(1), url, storage_options={"endpoint_url": s3.endpoint, **FAST_FAILURE})
    assert checkpoint.load(path, storage_options={"endpoint_url": s3.endpoint})["model.w"].shape == (1 << 10,)
    assert checkpoint.latest("s3://ckpt/opts", storage_options={"endpoint_url": s3.endpoint}) == path
    assert checkpoint.latest(path.parent) == path  # the returned path carries its file system, with its options
    assert "opts/ckpt-1.safetensors" in list_keys(s3, "opts/")


def test_an_object_without_its_commit_object_is_invisible(s3: S3Server) -> None:
    good = checkpoint.save(_state(1), s3.url("vis", "ckpt-1.safetensors"))
    torn = checkpoint.save(_state(2), s3.url("vis", "ckpt-2.safetensors"))
    store = remote.locate(str(torn))[0]
    store._delete(store.commit_object(torn))  # as if the writer died between the upload and its commit object
    assert checkpoint.latest(s3.url("vis")) == good
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(torn)
    # a commit object whose size is not the object's (an overwrite that died half way) does not count either
    store._put_small(store.commit_object(good), {"size": 12})
    assert checkpoint.latest(s3.url("vis")) is None


# -- failures ----------------------------------------------------------------------------------------------------
def test_a_missing_bucket_is_a_clear_error(s3: S3Server) -> None:
    url = "s3://no-such-bucket/run/ckpt-1.safetensors"
    with pytest.raises(CheckpointError, match=r"bucket of s3://no-such-bucket/run/ckpt-1.safetensors does not exist"):
        checkpoint.save(_state(), url)
    with pytest.raises(CheckpointError, match=r"latest\('s3://no-such-bucket/run'\): the bucket 'no-such-bucket'"):
        checkpoint.latest("s3://no-such-bucket/run")  # issue 41 item 6: a typo must not train from scratch
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(url)


def test_wrong_credentials_are_a_clear_error_naming_the_url(monkeypatch) -> None:
    # moto checks keys once its free actions are spent: the bucket's creation is the one allowed here
    server = start({"INITIAL_NO_AUTH_ACTION_COUNT": "1"})
    try:
        use(server, monkeypatch)
        url = server.url("auth", "ckpt-1.safetensors")
        for call in (lambda: checkpoint.save(_state(), url), lambda: checkpoint.latest(server.url("auth")),
                     lambda: checkpoint.load(url)):
            with pytest.raises(CheckpointError, match=r"access to s3://ckpt/auth\S* was denied: wrong or missing "
                                                      "credentials"):
                call()
    finally:
        server.stop()


def test_a_denied_request_is_not_retried() -> None:
    """The S3 answer to a wrong key, injected: raised at once, naming the URL and where credentials come from."""
    pytest.importorskip("botocore")
    from botocore.exceptions import ClientError

    denied = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "The AWS Access Key Id you provided "
                                    "does not exist in our records."}}, "HeadObject")
    calls = []

    def fail() -> None:
        calls.append(1)
        raise denied

    with pytest.raises(PermissionError, match=r"access to s3://b/k was denied: wrong or missing credentials"):
        retries.attempts("looking up", "s3://b/k", fail)
    assert calls == [1]


def test_throttling_is_retried_a_bounded_number_of_times_with_logs(s3: S3Server, monkeypatch) -> None:
    from botocore.exceptions import ClientError
    from loguru import logger

    store, where = remote.locate(s3.url("thr", "ckpt-1.safetensors"))
    slow = ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "HeadObject")
    real, left = store._fs.info, {"n": 2}

    def throttled(path, **kw):
        if left["n"]:
            left["n"] -= 1
            raise slow
        return real(path, **kw)

    monkeypatch.setattr(store._fs, "info", throttled)
    monkeypatch.setattr(retries.time, "sleep", lambda s: None)
    seen: list[str] = []
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    logger.enable("distfn")
    try:
        checkpoint.save(_state(), where)  # two throttled answers, then it goes through
        left["n"] = 10**6  # throttled for good
        with pytest.raises(CheckpointError, match=rf"throttling requests for {where}.*after {retries.ATTEMPTS} "):
            checkpoint.load(where)
    finally:
        logger.remove(sink)
    assert sum("SlowDown" in m and "retrying" in m for m in seen) >= 2 + retries.ATTEMPTS - 1


@pytest.mark.slow  # over 5 s on an idle machine (conftest: the quick selection is for fast tests)
def test_the_server_stopped_mid_upload_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    server = start()
    try:
        use(server, monkeypatch)
        checkpoint.save(_state(1), server.url("gone", "ckpt-1.safetensors"))
        real = remote._Upload.write
        parts = {"n": 0}

        def stop_after_a_part(self, data):
            real(self, data)
            parts["n"] += 1
            if parts["n"] == 1:
                server.stop()

        monkeypatch.setattr(remote, "PART_BYTES", 5 << 20)  # S3's smallest part
        monkeypatch.setattr(remote._Upload, "write", stop_after_a_part)
        with pytest.raises(CheckpointError, match=r"s3://ckpt/gone/ckpt-2.safetensors.*(cannot reach|failed)"):
            checkpoint.save(_state(2, big=3 << 20), server.url("gone", "ckpt-2.safetensors"))
    finally:
        server.stop()


def test_without_fsspec_the_error_names_the_extra(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("fsspec", "s3fs"):
                    raise ImportError(f"No module named {name!r} (hidden by the test)")
        sys.meta_path.insert(0, Hide())
        import torch
        from distfn import checkpoint
        from distfn.errors import CheckpointError
        checkpoint.save({"w": torch.ones(1)}, "local.safetensors")  # local saves need no fsspec
        try:
            checkpoint.save({"w": torch.ones(1)}, "s3://bucket/ckpt-1.safetensors")
        except CheckpointError as exc:
            print(exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env=repo_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install 'distfn[s3]'" in done.stdout and "s3://bucket/ckpt-1.safetensors" in done.stdout


# -- kill -9 mid-upload, one file --------------------------------------------------------------------------------
_KILL_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from distfn import checkpoint
    from distfn.checkpoint import remote
    remote.PART_BYTES = 5 << 20  # S3's smallest part
    real = remote._Upload.write
    count = {"n": 0}
    def write_then_die(self, data):
        real(self, data)
        count["n"] += 1
        if count["n"] == 3:  # a few parts are uploaded, the upload is not finished
            os.kill(os.getpid(), signal.SIGKILL)
    remote._Upload.write = write_then_die
    checkpoint.save({"w": torch.ones(4 << 20), "v": torch.arange(1 << 20)}, sys.argv[1])
    """
)


def test_kill_9_mid_upload_keeps_the_previous_checkpoint_and_the_next_save_cleans_up(s3: S3Server) -> None:
    base = s3.url("kill1")
    previous = checkpoint.save(_state(1), f"{base}/ckpt-1.safetensors")
    # same name as an existing one, and a new one: both leave the previous checkpoints whole
    for name in ("ckpt-1.safetensors", "ckpt-2.safetensors"):
        done = subprocess.run([sys.executable, "-c", _KILL_WRITER, f"{base}/{name}"], env=repo_env(),
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert checkpoint.latest(base) == previous
    equal_state(checkpoint.load(previous), {"model.w": _state(1)["model"]["w"], "model.b": _state(1)["model"]["b"]})
    # the second writer already removed the first one's lease and aborted its upload; its own are left
    leases = [k for k in list_keys(s3, "kill1/") if k.endswith(".distfn-tmp")]
    assert len(leases) == 1 and leases[0].startswith("kill1/.ckpt-2.")
    assert [u for u in uploads(s3) if u.startswith("kill1/")] == ["kill1/ckpt-2.safetensors"]
    checkpoint.save(_state(3), f"{base}/ckpt-3.safetensors", keep=1)  # the next save cleans both
    assert list_keys(s3, "kill1/") == ["kill1/.ckpt-3.safetensors.distfn-commit", "kill1/ckpt-3.safetensors"]
    assert [u for u in uploads(s3) if u.startswith("kill1/")] == []


# -- two ranks: sharded to s3://, resume bit-exactly, a rank killed mid-upload -------------------------------------
_JOB = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from torch import nn
    from distfn import distributed

    def batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

    def steps(model, opt, first, last, ctx):
        losses = []
        for step in range(first, last + 1):
            x, y = batch(step)
            x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(float(ctx.all_reduce(loss.detach())))
        return losses

    def fresh(ctx, seed):
        torch.manual_seed(seed)
        model = ctx.wrap(nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4)))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    MODE = sys.argv[3]
    # storage_options= instead of fsspec's environment, when the test gives the endpoint this way
    OPTS = {"endpoint_url": os.environ["TEST_S3_ENDPOINT"]} if "TEST_S3_ENDPOINT" in os.environ else None

    @distributed(mode=MODE, nprocs=2, seed=0, **({"fsdp": {"min_params": 100}} if MODE == "fsdp" else {}))
    def job(cfg, ctx):
        base, what = cfg
        model, opt = fresh(ctx, 0)
        if what == "resume":
            losses = steps(model, opt, 1, 3, ctx)
            ctx.save({"model": model, "optimizer": opt, "step": 3}, f"{base}/ckpt-3", sharded=True, keep=2,
                     storage_options=OPTS)
            after = steps(model, opt, 4, 6, ctx)
            model, opt = fresh(ctx, 99)  # a different init: everything comes from the checkpoint
            state = {"model": model, "optimizer": opt, "step": 0}
            step = ctx.resume(state, base, storage_options=OPTS)
            again = steps(model, opt, step + 1, 6, ctx)
            return {"step": step, "after": after, "again": again, "losses": losses}
        from distfn.checkpoint import remote
        steps(model, opt, 1, 2, ctx)
        ctx.save({"model": model, "optimizer": opt, "step": 2}, f"{base}/ckpt-2", sharded=True)
        victim = int(what)
        if ctx.rank == victim:
            remote.PART_BYTES = 5 << 20
            real = remote._Upload.write
            def write_then_die(self, data):
                real(self, data)
                if self.path.name.startswith("shard-"):
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-upload of this rank's shard
            remote._Upload.write = write_then_die
        ctx.save({"model": model, "optimizer": opt, "step": 4}, f"{base}/ckpt-4", sharded=True)
        return "not killed"

    if __name__ == "__main__":
        try:
            result = job((sys.argv[1], sys.argv[2]))
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print("RESULT", json.dumps(result))
    """
)


def _job(tmp_path: Path, base: str, what: str, mode: str, env: dict[str, str] | None = None) -> dict:
    script = tmp_path / "remote_job.py"
    script.write_text(_JOB)
    done = subprocess.run([sys.executable, str(script), base, what, mode], env=env or repo_env(),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize(("mode", "config"), [("fsdp", "environment"), ("ddp", "environment"),
                                              ("ddp", "storage_options")])
def test_two_ranks_save_sharded_to_s3_and_resume_bit_exactly(s3: S3Server, tmp_path: Path, mode: str,
                                                            config: str) -> None:
    base = s3.url(f"two-{mode}-{config}")
    env = repo_env()
    if config == "storage_options":  # ctx.save / ctx.resume(..., storage_options=) on every rank, no endpoint in env
        env = {k: v for k, v in env.items() if k != "FSSPEC_S3_ENDPOINT_URL"}
        env["TEST_S3_ENDPOINT"] = s3.endpoint
    result = _job(tmp_path, base, "resume", mode, env)
    assert "error" not in result, result
    assert result["step"] == 3 and result["again"] == result["after"]  # bit-exact: the same floats
    shards = [k for k in list_keys(s3, f"two-{mode}-{config}/ckpt-3/") if k.rsplit("/", 1)[1].startswith("shard-")]
    assert len(shards) == 2  # every rank uploaded its own shard
    assert str(distfn.latest(base)) == f"{base}/ckpt-3"


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_a_rank_mid_sharded_upload(s3: S3Server, tmp_path: Path, victim: int) -> None:
    base = s3.url(f"kill-sharded-{victim}")
    result = _job(tmp_path, base, str(victim), "fsdp")
    assert "error" in result and "SIGKILL" in result["error"], result
    assert str(distfn.latest(base)) == f"{base}/ckpt-2"  # the partial ckpt-4 is never a candidate
    assert checkpoint.sharded.open_checkpoint(f"{base}/ckpt-2").metadata["distfn.world_size"] == "2"
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    assert checkpoint.sharded.load_into(f"{base}/ckpt-2", {"model": model})["step"] == 2
    # the next sharded save into the same parent cleans what the killed one left (a dead rank 0's lease and its
    # partial directory; a killed rank 1: rank 0 removed the partial directory as the save failed)
    checkpoint.sharded.save({"w": torch.ones(3)}, f"{base}/ckpt-5")
    keys = list_keys(s3, f"kill-sharded-{victim}/")
    assert not [k for k in keys if "/ckpt-4/" in k or k.endswith(".distfn-partial")], keys
    assert str(distfn.latest(base)) == f"{base}/ckpt-5"


def test_consolidate_cli_reads_s3(s3: S3Server, tmp_path: Path) -> None:
    d = checkpoint.sharded.save(_state(5), s3.url("cli", "ckpt-5"))
    out = tmp_path / "one.safetensors"
    env = {**repo_env(), **s3.env}
    done = subprocess.run([sys.executable, "-m", "distfn", "consolidate", str(d), str(out)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    equal_state(checkpoint.load(out), checkpoint.load(d))


def test_background_saves_to_s3(s3: S3Server) -> None:
    path = checkpoint.save_in_background(_state(7), s3.url("bg", "ckpt-7.safetensors"))
    checkpoint.background.DEFAULT.wait()
    assert checkpoint.latest(s3.url("bg")) == path


def test_huge_files_get_larger_parts_to_fit_the_part_limit() -> None:
    store = remote.locate("memory://distfn-test/parts/x.safetensors")[0]
    stream = store.create(store.path("/distfn-test/parts/x.safetensors"))
    try:
        stream.reserve(1 << 30)
        assert isinstance(stream, remote._Upload) and stream.part == remote.PART_BYTES
        stream.reserve(300 << 30)
        assert stream.part % (1 << 20) == 0 and (300 << 30) / stream.part <= 9_000 < (300 << 30) / remote.PART_BYTES
    finally:
        stream.abort()


@pytest.mark.slow  # over 5 s on an idle machine (conftest: the quick selection is for fast tests)
def test_the_benchmark_runs(tmp_path: Path) -> None:
    """bench/bench_remote.py --tiny end to end: every table has its samples and its target evaluated."""
    out = tmp_path / "remote.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "bench_remote.py"),
                           "--tiny", "--json", str(out)], env=repo_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tables = json.loads(out.read_text())["tables"]
    assert len(tables) == 4
    assert all(row["samples"] for tab in tables for row in tab["rows"])
    assert all(t["met"] is not None for tab in tables for t in tab["targets"])


def test_a_load_reads_tensors_in_file_order_with_few_requests(monkeypatch) -> None:
    state = {f"t{i}": torch.full((1 << 19,), float(i)) for i in range(8)}  # 8 tensors of 2 MiB
    path = checkpoint.save(state, "memory://distfn-test/reads/ckpt-1.safetensors")
    store = remote.locate(str(path))[0]
    ranges: list[tuple[int, int]] = []
    real = store.read_range
    monkeypatch.setattr(store, "read_range", lambda p, a, b: (ranges.append((a, b)), real(p, a, b))[1])
    equal_state(checkpoint.load(path), state)
    assert len(ranges) == 2  # the header's block, then one sequential block for all eight tensors
    assert sum(b - a for a, b in ranges) <= (16 << 20) + (1 << 20)  # nothing fetched twice (beyond the header)
