"""distfn.checkpoint.storage: the atomic writer, temporary files, the reader, pickle refusal."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from ckpt_helpers import Net, equal_state, repo_env
from safetensors.torch import load_file

from distfn import checkpoint
from distfn.checkpoint import fs, sharded, storage
from distfn.checkpoint.layout import resolve
from distfn.errors import CheckpointError


@pytest.mark.parametrize("suffix", [".pt", ".bin"])
def test_pickle_files_are_refused_with_conversion(tmp_path: pathlib.Path, suffix: str) -> None:
    model = Net()
    path = tmp_path / f"model{suffix}"
    torch.save(model.state_dict(), path)
    with pytest.raises(CheckpointError, match="pickle") as info:
        checkpoint.load(path)
    message = str(info.value)
    assert "arbitrary code" in message and "weights_only=True" in message
    command = message.splitlines()[-1].strip()
    assert command.startswith("python -c ")
    # The one-line conversion really works and the result loads.
    subprocess.run(command, shell=True, check=True, env=repo_env(), cwd=tmp_path)
    converted = path.with_suffix(".safetensors")
    fresh = Net()
    checkpoint.load_into(converted, fresh)
    equal_state(fresh.state_dict(), model.state_dict())
    # Legacy (non-zip) pickle files too.
    legacy = tmp_path / f"legacy{suffix}"
    torch.save(model.state_dict(), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="pickle"):
        checkpoint.load_into(legacy, Net())


def test_missing_truncated_and_garbage_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "nope.safetensors")
    path = checkpoint.save(Net(), tmp_path / "m.safetensors")
    data = path.read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        checkpoint.load(torn)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(CheckpointError):
        checkpoint.load(junk)
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.read_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="not a complete sharded checkpoint"):  # directories are sharded ones
        checkpoint.load(tmp_path)


def test_missing_directory_is_created(tmp_path: pathlib.Path) -> None:
    path = checkpoint.save(Net(), tmp_path / "a" / "b" / "m.safetensors")
    assert path.is_file()
    assert list(path.parent.iterdir()) == [path]


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path: pathlib.Path, monkeypatch) -> None:
    target = tmp_path / "m.safetensors"
    checkpoint.save({"v": torch.zeros(1 << 20)}, target)
    old = target.read_bytes()
    calls = {"n": 0}
    real = fs.write_all

    def failing(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(fs, "write_all", failing)
    with pytest.raises(CheckpointError, match="previous file, if any, is intact"):
        checkpoint.save({"v": torch.ones(1 << 20)}, target)  # header first, then the 4 MiB tensor fails
    assert target.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002, 0o077])
def test_permissions_follow_the_umask(tmp_path: pathlib.Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        path = checkpoint.save(Net(), tmp_path / "m.safetensors")
        reference = tmp_path / "plain"
        reference.write_bytes(b"")
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~mask) == (reference.stat().st_mode & 0o777)


_WRITER = textwrap.dedent(
    """
    # Imports torch once, then forks one writer per line on stdin so every round is killed mid-work quickly.
    import os, sys, torch
    from distfn import checkpoint
    target, size = sys.argv[1], int(sys.argv[2])
    version = 0
    for _ in sys.stdin:
        version += 1000
        pid = os.fork()
        if pid == 0:
            try:
                v = version
                while True:
                    v += 1
                    checkpoint.save({"a": torch.full((size,), float(v)), "b": torch.full((size // 2,), -float(v)),
                                     "version": v}, target)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
    """
)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_torn_file(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "big.safetensors"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    size = 6 << 20  # 24 MiB + 12 MiB of float32 per version
    rng = random.Random(1234)
    seen: set[int] = set()
    killed_mid_write = 0
    proc = subprocess.Popen([sys.executable, str(script), str(target), str(size)], env=repo_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for _ in range(25):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid = int(proc.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            assert proc.stdout.readline().strip() == "reaped"
            killed_mid_write += any(p.name.endswith(".distfn-tmp") for p in tmp_path.iterdir())
            if not target.exists():
                continue  # killed before the first rename: no file at all is the "old version" here
            version = checkpoint.load_into(target, {})["version"]
            flat = checkpoint.load(target)
            assert torch.equal(flat["a"], torch.full((size,), float(version)))
            assert torch.equal(flat["b"], torch.full((size // 2,), -float(version)))
            assert load_file(target)["a"].shape == (size,)  # the stock library agrees
            seen.add(version)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert len(seen) >= 3, "too few completed saves: make the sleeps longer"
    assert killed_mid_write >= 5, "the kills never hit a save in progress: the test would prove nothing"
    # A normal save afterwards cleans up what the killed writers left.
    checkpoint.save({"a": torch.zeros(1)}, target)
    assert [p.name for p in tmp_path.iterdir() if p.name != "writer.py"] == ["big.safetensors"]


def test_device_staging_copies_in_bounded_chunks(monkeypatch) -> None:
    t = torch.arange(100, dtype=torch.float32).reshape(10, 10).t()  # 400 bytes, non-contiguous
    staging = storage.Staging(chunk_bytes=64)
    chunks = [bytes(c) for c in staging.chunks(t)]
    assert all(len(c) <= 64 for c in chunks)
    assert b"".join(chunks) == t.contiguous().numpy().tobytes()


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "m.safetensors"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    stale = storage.tmp_name(resolve(target)).name.split(".")
    stale_name = ".".join([*stale[:-3], str(dead_pid), *stale[-2:]])
    (tmp_path / stale_name).write_bytes(b"partial")
    unrelated = tmp_path / ".other.safetensors.somehost.1.deadbeef.distfn-tmp"
    unrelated.write_bytes(b"x")
    checkpoint.save(Net(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, unrelated.name])


def test_loaded_tensors_are_independent_of_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    checkpoint.save({"w": torch.ones(1000), "v": torch.arange(10)}, path)
    loaded = checkpoint.load(path)
    loaded["w"].mul_(3)  # copy-on-write: the file is not changed
    assert torch.equal(checkpoint.load(path)["w"], torch.ones(1000))
    checkpoint.save({"w": torch.zeros(1000), "v": torch.arange(10)}, path)  # replace while still in use
    assert torch.equal(loaded["w"], torch.full((1000,), 3.0))
    assert torch.equal(checkpoint.load(path)["w"], torch.zeros(1000))
    assert loaded["w"].storage_offset() == 0 and loaded["w"].untyped_storage().nbytes() == 4000


def test_misaligned_foreign_file_loads(tmp_path: pathlib.Path) -> None:
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    raw = json.dumps(header).encode()
    data = bytes([1, 2, 3]) + np.array([1.5, -2.0], dtype="<f4").tobytes()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    stock = load_file(path)
    mine = checkpoint.load(path)
    assert torch.equal(mine["a"], stock["a"]) and torch.equal(mine["b"], torch.tensor([1.5, -2.0]))


def test_many_small_tensors_are_gathered_into_few_writes(tmp_path: pathlib.Path, monkeypatch) -> None:
    calls = []
    real = fs.write_all
    monkeypatch.setattr(fs, "write_all", lambda fd, data: (calls.append(len(data)), real(fd, data)))
    state = {f"norm{i}.weight": torch.full((64,), float(i)) for i in range(500)}
    state["big"] = torch.ones(2 << 20)
    path = checkpoint.save(state, tmp_path / "many.safetensors")
    assert len(calls) <= 3  # small ones, then the 8 MiB tensor straight from its memory
    equal_state(load_file(path), state)


def test_long_file_names_still_fit(tmp_path: pathlib.Path) -> None:
    name = "x" * 230 + ".safetensors"  # near NAME_MAX: the temporary name must not exceed it
    path = checkpoint.save(Net(), tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert set(checkpoint.load(path)) == set(Net().state_dict())


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True,
                          text=True)
    return int(proc.stdout)


def test_kill_9_during_a_step_named_save_leaves_nothing_after_the_next_save(tmp_path: pathlib.Path) -> None:
    """Issue 16 item 1: a writer of ckpt-7 killed mid-save left a model-sized temp file that ckpt-8's save (and
    keep= rotation) never removed. Now any dead writer's temp file in the directory goes; live ones stay."""
    code = textwrap.dedent(
        """
        import os, signal, sys, torch
        from distfn.checkpoint import fs
        real = fs.write_all
        def write_then_die(fd, data):
            real(fd, data)
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of the save
        fs.write_all = write_then_die
        from distfn import checkpoint
        checkpoint.save({"w": torch.ones(2 << 20)}, sys.argv[1])
        """
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt-7.safetensors")], env=repo_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leaked = [p for p in tmp_path.iterdir() if p.name.endswith(".distfn-tmp")]
    assert len(leaked) == 1 and leaked[0].name.startswith(".ckpt-7.safetensors.")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_tmp = storage.tmp_name(resolve(tmp_path / "ckpt-9.safetensors")).name.split(".")
        live_tmp = tmp_path / ".".join([*live_tmp[:-3], str(live.pid), *live_tmp[-2:]])
        live_tmp.write_bytes(b"a writer still at work")
        other_host = tmp_path / f".ckpt-6.safetensors.elsewhere.{_dead_pid()}.0123abcd.distfn-tmp"
        other_host.write_bytes(b"another host's writer: its pid means nothing here")
        checkpoint.save({"w": torch.zeros(1)}, tmp_path / "ckpt-8.safetensors", keep=1)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["ckpt-8.safetensors", live_tmp.name, other_host.name])
    finally:
        live.kill()
        live.wait()


def test_a_failed_save_removes_the_directories_it_created(tmp_path: pathlib.Path, monkeypatch) -> None:
    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs, "write_all", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        checkpoint.save({"w": torch.ones(4)}, tmp_path / "runs" / "exp1" / "ckpt-1.safetensors")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # directories that existed before stay
    with pytest.raises(CheckpointError, match="No space left"):
        checkpoint.save({"w": torch.ones(4)}, tmp_path / "kept" / "new" / "ckpt-1.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_saving_to_a_symlink_replaces_the_link_not_its_target(tmp_path: pathlib.Path) -> None:
    """Documented choice (docs/checkpoints.md): like `mv`, the link itself is replaced by the new file; the
    checkpoint it pointed to is never overwritten."""
    old = checkpoint.save({"w": torch.ones(2)}, tmp_path / "ckpt-1.safetensors")
    link = tmp_path / "last.safetensors"
    link.symlink_to(old.name)
    checkpoint.save({"w": torch.zeros(2)}, link)
    assert not link.is_symlink() and link.is_file()
    assert torch.equal(checkpoint.load(link)["w"], torch.zeros(2))
    assert torch.equal(checkpoint.load(old)["w"], torch.ones(2))
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    (tmp_path / "runs").symlink_to(real_dir)  # a linked directory on the way is simply followed
    checkpoint.save({"w": torch.ones(1)}, tmp_path / "runs" / "ckpt-2.safetensors")
    assert (real_dir / "ckpt-2.safetensors").is_file()


_KILLED_MID_WRITE = """
import os, signal, sys
import torch
from distfn import checkpoint
from distfn.checkpoint import sharded, storage

def die(*args, **kwargs):  # the temporary file exists and part of the model is in it: SIGKILL, no clean-up
    stream = args[0]
    stream.write(memoryview(b"x" * (1 << 20)))
    os.kill(os.getpid(), signal.SIGKILL)

storage._write_plan = die
kind = sys.argv[2]
if kind == "sharded":
    sharded.save({"w": torch.ones(1000)}, os.path.join(sys.argv[1], "a"))
else:
    checkpoint.save({"w": torch.ones(1000)}, os.path.join(sys.argv[1], "a.safetensors"))
"""


def _leftover_named(directory: pathlib.Path, pid: int, mark: str = storage.TMP_MARK, age_s: float = 0.0,
                    kind: str = "file") -> pathlib.Path:
    """A leftover of the name a writer with pid ``pid`` on this host would use, last changed ``age_s`` ago."""
    name = storage.tmp_name(resolve(directory / "x.safetensors"), mark).name.split(".")
    path = directory / ".".join([*name[:-3], str(pid), *name[-2:]])
    if kind == "file":
        path.write_bytes(b"partial")
    else:
        path.mkdir()
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_a_writer_sigkilled_mid_save_leaves_nothing_after_the_next_save_of_another_name(
        tmp_path: pathlib.Path, kind: str) -> None:
    """A model-sized temporary file (a sharded save's directory) of a writer SIGKILLed mid-save was left beside
    the checkpoint; the next save of another name, of either kind, removes it. A live writer's is never touched,
    whatever its age; a pid now run by a process started after the leftover last changed (reused: a container's
    pids start again at 1) or a leftover unchanged for storage.STALE_AFTER_S is no live writer's."""
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(tmp_path), kind], env=repo_env(),
                            timeout=120)
    assert killed.returncode == -signal.SIGKILL
    [left] = [p for p in tmp_path.iterdir() if p.name.startswith(".a")]
    assert (storage.TMP_MARK if kind == "file" else ".distfn-partial") in left.name
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        writing = _leftover_named(tmp_path, live.pid)  # a live writer's, started before its file changed
        reused = _leftover_named(tmp_path, live.pid, mark=".distfn-partial", age_s=600, kind="dir")
        old = _leftover_named(tmp_path, os.getppid(), age_s=storage.STALE_AFTER_S + 60)
        mine = _leftover_named(tmp_path, os.getpid(), age_s=storage.STALE_AFTER_S + 60)  # this process's: kept
        other = kind == "file"  # a save of the other kind than the killed one
        if other:
            sharded.save({"w": torch.zeros(10)}, tmp_path / "b")
        else:
            checkpoint.save({"w": torch.zeros(10)}, tmp_path / "b.safetensors")
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["b" if other else "b.safetensors", writing.name, mine.name]), names
        assert not left.exists() and not reused.exists() and not old.exists()
    finally:
        live.kill()
        live.wait()
    assert storage._PARTIAL_MARK == sharded.spec.PARTIAL
