"""Every example in ``examples/`` runs (with tiny sizes) and prints what it promises.

Each example prints its result dict as the last line of its output; the tests read it back and check the
numbers (accuracy, loss, resume point, checkpoint contents), not only the exit status.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distfn

from conftest import free_port, requires

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = [pytest.mark.slow, pytest.mark.quick]  # quick: the README's quick test command runs the examples too


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC_", "DISTFN_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


def run_example(name: str, *args: str, cwd: Path, ok: bool = True, **env: str) -> tuple[str, dict[str, Any] | None]:
    """Run ``examples/<name>``; return (stdout + stderr, the result dict printed last, if any)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"{name} exited {proc.returncode}:\n{output[-4000:]}"
    result = None
    for line in reversed(proc.stdout.splitlines()):
        match = re.match(r"^(\{.*\})", line)
        if match:
            result = ast.literal_eval(match.group(1))
            break
    return output, result


def test_quickstart(tmp_path: Path) -> None:
    out, result = run_example("quickstart.py", str(tmp_path / "q.safetensors"), cwd=tmp_path, EPOCHS="2")
    assert result is not None and result["world_size"] == 2
    assert "epoch 1: mean loss across 2 ranks" in out
    assert "Failed to initialize NumPy" not in out
    weights = distfn.load(result["checkpoint"])
    assert weights and not any(k.startswith("module.") for k in weights)


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a terminal")
def test_quickstart_in_a_terminal_shows_rank_0s_progress_bar(tmp_path: Path) -> None:
    """What a user sees at a terminal (a pseudo-terminal here): one tqdm bar per epoch, from rank 0 only."""
    command = f"stty cols 120 rows 40; {shlex.quote(sys.executable)} {shlex.quote(str(EXAMPLES / 'quickstart.py'))}"
    done = subprocess.run(["script", "-qec", command, "/dev/null"], cwd=tmp_path, env=_env(EPOCHS="2"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    screen = done.stdout.replace("\r", "\n")
    assert re.search(r"^epoch 0: 100%\|.*\| 16/16 ", screen, re.M), screen[-3000:]
    assert re.search(r"^epoch 1: 100%\|.*\| 16/16 ", screen, re.M)
    assert "Failed to initialize NumPy" not in screen and "UserWarning" not in screen


@requires("sklearn", "examples")  # examples/real_dataset.py loads scikit-learn's digits
def test_real_dataset_reaches_its_accuracy(tmp_path: Path) -> None:
    out, result = run_example("real_dataset.py", "--epochs", "12", "--out", str(tmp_path / "d.safetensors"),
                              cwd=tmp_path)
    assert result is not None
    assert result["test_images"] == 449  # every test image counted exactly once across the 2 ranks
    assert result["accuracy"] >= 0.93, out  # 40 epochs (the default) reach about 0.97
    assert "mean loss across ranks" in out and "model saved to" in out
    weights = distfn.load(result["checkpoint"])
    assert weights["0.weight"].shape == (128, 64) and weights["3.weight"].shape == (10, 128)


def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    out, _ = run_example("resume.py", "--dir", str(crashed), "--epochs", "4", "--crash-at", "2", cwd=tmp_path,
                         ok=False)
    assert "rank 1" in out and "simulated crash in epoch 2" in out  # WorkerError names the rank and the cause
    assert distfn.latest(crashed).name == "ckpt-1.safetensors"

    out, resumed = run_example("resume.py", "--dir", str(crashed), "--epochs", "4", cwd=tmp_path)
    assert "resumed from" in out and "(epoch 1 was done" in out
    assert resumed is not None and resumed["epochs_run"] == 2
    assert sorted(p.name for p in crashed.iterdir()) == ["ckpt-2.safetensors", "ckpt-3.safetensors"]  # keep=2

    _, full = run_example("resume.py", "--dir", str(straight), "--epochs", "4", cwd=tmp_path)
    assert full is not None and full["epochs_run"] == 4
    a, b = distfn.load(resumed["checkpoint"]), distfn.load(full["checkpoint"])
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)  # model, Adam moments, scheduler: bit-identical
    assert resumed["loss"] == full["loss"]

    # Run again on a finished run: nothing to train, and the loss reported is the checkpoint's (was nan).
    out, again = run_example("resume.py", "--dir", str(straight), "--epochs", "4", cwd=tmp_path)
    assert again is not None and again["epochs_run"] == 0 and again["loss"] == full["loss"], out


def test_resume_demo_in_the_docstring_crashes_then_resumes(tmp_path: Path) -> None:
    """The commands at the top of examples/resume.py, run as written: the first crashes, the second resumes."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / "resume.py").read_text())) or ""
    commands = [line.split("#")[0].split()[2:] for line in doc.splitlines()
                if line.strip().startswith("python examples/resume.py")]
    assert len(commands) == 2 and "--crash-at" in commands[0]
    out, _ = run_example("resume.py", *commands[0], cwd=tmp_path, ok=False)
    assert "WorkerError" in out and "rank 1" in out and "simulated crash in epoch 3" in out
    assert distfn.latest(tmp_path / "runs/resume").name == "ckpt-2.safetensors"
    out, resumed = run_example("resume.py", *commands[1], cwd=tmp_path)
    assert "resumed from" in out and "(epoch 2 was done" in out
    assert resumed is not None and resumed["epochs_run"] == 3  # epochs 3, 4 and 5


def test_argparse_examples_under_the_legacy_launcher(tmp_path: Path) -> None:
    """`python -m torch.distributed.launch` appends --local-rank=N to each process's arguments: distfn takes it
    out of sys.argv before the script parses them (argparse would exit; quickstart would save to a file named
    '--local-rank=0')."""
    legacy = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}"]
    done = subprocess.run([*legacy, str(EXAMPLES / "resume.py"), "--dir", str(tmp_path / "r"), "--epochs", "1"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "unrecognized arguments" not in done.stderr and "'epochs_run': 1" in done.stdout
    assert done.stdout.count("'epochs_run'") == 1, done.stdout  # printed once (rank 0), not by every process
    done = subprocess.run([*legacy, str(EXAMPLES / "quickstart.py")], cwd=tmp_path, env=_env(EPOCHS="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (tmp_path / "quickstart.safetensors").exists() and not list(tmp_path.glob("--local*"))
    assert done.stdout.count("'world_size': 2") == 1, done.stdout  # one result line, rank 0's


def test_dp_loss_in_forward(tmp_path: Path) -> None:
    out, result = run_example("dp_loss_in_forward.py", "--epochs", "2", cwd=tmp_path)
    assert result is not None and result["accuracy"] > 0.8
    assert "mode=dp" in out and "per-GPU losses" in out


def test_fsdp_example(tmp_path: Path) -> None:
    if not (EXAMPLES / "fsdp.py").exists():
        pytest.skip("examples/fsdp.py is not there")
    out, result = run_example("fsdp.py", str(tmp_path / "fsdp"), cwd=tmp_path)
    assert result is not None and result["step"] == 40
    assert "bare-model loss" in out and distfn.latest(tmp_path / "fsdp") is not None
    # It says where its checkpoints go (by default a folder in the temporary directory, easy to lose).
    where = (tmp_path / "fsdp").resolve()
    assert f"checkpoints go to {where}" in out and result["checkpoints"] == str(where)


def test_markdown_examples_name_files_that_exist() -> None:
    for md in [EXAMPLES / "multinode_torchrun.md", *EXAMPLES.glob("*/README.md")]:
        text = md.read_text()
        for ref in re.findall(r"examples/[\w/.-]+\.(?:py|sbatch|md)", text):
            assert (EXAMPLES.parent / ref).exists(), f"{md.name} mentions {ref}, which does not exist"


def test_train_loop(tmp_path: Path) -> None:
    out, result = run_example("train_loop.py", "--epochs", "2", "--log-dir", str(tmp_path / "tb"), cwd=tmp_path)
    assert result is not None and [h["epoch"] for h in result["history"]] == [0, 1]
    assert "precision bf16; optimizer step = 32 x 2 ranks x 4 micro-batches = 256 samples" in out
    assert result["optimizer_steps"] == 32  # 63 batches per rank and epoch: 15 windows of 4, then one of 3
    last = result["history"][-1]
    assert last["test_samples"] == 1001 and last["test_accuracy"] > 0.8  # every test sample exactly once
    assert last["train_loss"] < result["history"][0]["train_loss"]
    # One loss per epoch, the mean over the ranks (the bar used to add rank 0's own running mean).
    # (the one-line note that bf16 autocast on a CPU changes the numbers, "losses and weights differ", is no loss)
    loss_lines = [line for line in out.splitlines() if "loss" in line and not line.startswith(("{", "done:"))
                  and "autocast runs" not in line]
    assert [re.sub(r"loss [\d.]+", "loss L", line.split(", test")[0]) for line in loss_lines] == [
        "epoch 0: train loss L (mean over 2 ranks)", "epoch 1: train loss L (mean over 2 ranks)"], out[-3000:]
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # rank 0's writer, and only one file
        assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    else:
        assert "training without ctx.writer" in out


def test_slurm_batch_scripts_show_the_venv_the_signal_and_requeue() -> None:
    for script in sorted((EXAMPLES / "slurm").glob("*.sbatch")):
        text = script.read_text()
        assert re.search(r'^\s+source "\$\{VENV:-\.venv\}/bin/activate"$', text, re.M), script.name
        assert re.search(r"^#SBATCH --signal=USR2@\d+$", text, re.M), script.name  # ctx.should_stop before the limit
        assert "requeue=True" in text and re.search(r"^# export DISTFN_REQUEUE=1$", text, re.M), script.name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script.name


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_what_the_examples_leave_behind_is_ignored_by_git() -> None:
    """TensorBoard runs (train_loop.py), Slurm logs (the sbatch files) and checkpoints stay out of `git status`."""
    leftovers = ["runs/train_loop/events.out.tfevents.1", "distfn-1node-7.out", "quickstart.safetensors"]
    done = subprocess.run(["git", "check-ignore", *leftovers], cwd=EXAMPLES.parent, capture_output=True, text=True)
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == leftovers


def test_mesh_example_trains_hsdp_then_resumes_on_tp_x_dp(tmp_path: Path) -> None:
    """examples/mesh.py: HSDP 2 x 2, then FSDP 2 x TP 2 resuming the HSDP run's sharded checkpoint (weights, AdamW
    state and loader position resharded onto the other mesh), then the whole model in one process."""
    out, first = run_example("mesh.py", "hsdp", str(tmp_path / "m"), cwd=tmp_path)
    assert first is not None and first["mesh"] == ["dp_replicate", "dp_shard"] and first["step"] == 20
    out, second = run_example("mesh.py", "tp", str(tmp_path / "m"), cwd=tmp_path)
    assert second is not None and second["mesh"] == ["dp_shard", "tp"] and second["start"] == 20
    assert second["step"] == 40 and second["loss"] < 1.0
    assert "one process reads 17409 parameters" in out
