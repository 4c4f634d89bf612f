"""The ``distfn`` command (``python -m distfn``): ``env`` (what it detects, text and JSON) and ``test`` (the
2-rank smoke test)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from distfn import __main__ as cli
from distfn import envreport, smoketest

# A task of `srun -N2 --ntasks-per-node=2` (rank 3 on the second node), as Slurm sets it.
SLURM_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NODELIST": "node[01-02]",
}


def _clean(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC_", "DISTFN_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(extra)
    clean["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{clean.get('PATH', '')}"  # the venv's torchrun
    return clean


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distfn", *args], env=_clean(**(env or {})), capture_output=True,
                          text=True, timeout=240)


def test_env_text_and_json_in_a_plain_shell() -> None:
    text = _run("env", env={"DISTFN_NPROCS": "3", "CUDA_VISIBLE_DEVICES": ""})
    assert text.returncode == 0, text.stderr
    assert "detected             spawn" in text.stdout
    assert "3 worker(s) (DISTFN_NPROCS)" in text.stdout
    assert "torch                " in text.stdout and "gloo yes" in text.stdout
    # every self-spawned rank is listed with its device
    assert [line.split()[2] for line in text.stdout.splitlines() if line.strip().startswith("local rank")] == \
        ["0", "1", "2"]

    raw = _run("env", "--json", env={"DISTFN_NPROCS": "3"})
    info = json.loads(raw.stdout)
    assert info["launcher"]["launcher"] == "spawn"
    assert info["plan"]["nprocs"] == 3 and info["plan"]["start_method"] in ("fork", "spawn")
    assert info["variables"]["DISTFN_NPROCS"] == "3"
    assert info["versions"]["torch"].startswith("2.")


def test_env_under_torchrun_variables_and_inconsistent_ones() -> None:
    ok = _run("env", "--json", env={"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"})
    info = json.loads(ok.stdout)
    assert ok.returncode == 0
    assert info["launcher"]["launcher"] == "torchrun"
    assert info["launcher"]["topology"]["rank"] == 1 and info["launcher"]["topology"]["world_size"] == 2
    assert [d["local_rank"] for d in info["plan"]["devices"]] == [1]

    bad = _run("env", env={"RANK": "1", "WORLD_SIZE": "2"})  # a stray partial torchrun set
    assert bad.returncode == 1
    assert "MASTER_ADDR" in bad.stdout and "error" in bad.stdout


def test_collect_slurm_task_in_process() -> None:
    info = envreport.collect(SLURM_TASK)
    det = info["launcher"]
    assert det["launcher"] == "slurm" and det["error"] is None
    topo = det["topology"]
    assert (topo["rank"], topo["local_rank"], topo["world_size"]) == (3, 1, 4)
    assert (topo["node_rank"], topo["num_nodes"]) == (1, 2)
    assert topo["master_addr"] == "node01"
    assert info["variables"]["SLURM_STEP_NODELIST"] == "node[01-02]"
    text = envreport.render(info)
    assert re.search(r"\n  rank\s+3 of 4\n", text) and re.search(r"node\s+1 of 2", text) and "node01:" in text


def test_forced_launcher_and_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert envreport.collect({}, launcher="mpi")["launcher"]["error"]  # forced MPI without MPI variables
    with pytest.raises(SystemExit):
        cli.main(["env", "--launcher", "nonsense"])
    assert "--launcher must be one of" in capsys.readouterr().err
    assert cli.main([]) == 2  # no command: help


def test_visible_devices_mapping_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES='0,5' makes cuda:1 physical GPU 5 (two GPUs faked: no CUDA here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    env = {"CUDA_VISIBLE_DEVICES": "0,5", "DISTFN_NPROCS": "2"}
    info = envreport.collect(env)
    assert info["launcher"]["launcher"] == "spawn" and info["plan"]["backend"] == "nccl"
    assert [(d["device"], d["physical_gpu"]) for d in info["plan"]["devices"]] == [("cuda:0", "0"), ("cuda:1", "5")]
    assert re.search(r"cuda:1\s+physical GPU 5  Fake GPU 1", envreport.render(info))
    torchrun = {**env, "TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    assert envreport.collect(torchrun)["plan"]["devices"] == [
        {"local_rank": 3, "device": "cuda:1", "physical_gpu": "5"}]


def test_env_says_local_for_one_process_with_cpu_memory_and_versions() -> None:
    """One CPU process runs in place, and the run itself says `local`: so does `distfn env` (not `spawn`)."""
    text = _run("env", env={"CUDA_VISIBLE_DEVICES": ""})
    assert text.returncode == 0, text.stderr
    assert "detected             local" in text.stdout and "spawn" not in text.stdout.split("machine")[0]
    assert re.search(r"CPUs\s+\d+ \(\d+ usable by this process\)", text.stdout)
    assert re.search(r"memory\s+[\d.]+ GiB \([\d.]+ GiB available\)", text.stdout)
    assert re.search(r"\n  driver\s+", text.stdout) and re.search(r"\n  nccl\s+", text.stdout)
    info = json.loads(_run("env", "--json", env={"CUDA_VISIBLE_DEVICES": ""}).stdout)
    assert info["launcher"]["launcher"] == "local" and info["plan"]["nprocs"] == 1
    assert info["machine"]["cpus"] >= 1 and info["machine"]["memory_gib"] > 0


def test_env_reports_a_bad_distfn_nprocs_instead_of_crashing() -> None:
    text = _run("env", env={"DISTFN_NPROCS": "two"})
    assert text.returncode == 0, text.stderr
    assert "DISTFN_NPROCS='two' is not an integer" in text.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_env_under_torchrun_prints_one_labelled_block_per_rank() -> None:
    every = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "distfn", "env"],
                           env=_clean(), capture_output=True, text=True, timeout=240)
    assert every.returncode == 0, every.stderr
    headers = re.findall(r"^===== rank (\d) of 2 \(local rank \d, node 0\) on .+ =====$", every.stdout, re.M)
    assert sorted(headers) == ["0", "1"]
    # each block is whole: its header, then its own launcher section, never another rank's lines in between
    for block in every.stdout.split("===== rank")[1:]:
        assert block.count("launcher\n") == 1
    only = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "distfn", "env", "--rank0"],
                          env=_clean(), capture_output=True, text=True, timeout=240)
    assert only.returncode == 0, only.stderr
    assert re.findall(r"^===== rank (\d) of 2", only.stdout, re.M) == ["0"]


@pytest.mark.slow
def test_distfn_test_passes_and_reports_each_check_with_its_time() -> None:
    done = _run("test")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "distfn test: 2 ranks (spawn), gloo on cpu"
    for name in ("start", "all-reduce", "barrier", "save/load", "ddp step"):
        assert re.search(rf"^  PASS  {re.escape(name)}\s+[\d.]+ m?s  ", done.stdout, re.M), (name, done.stdout)
    assert "sum of 1..2 over the ranks = 3" in done.stdout and "weights identical on 2 ranks" in done.stdout
    assert re.match(r"all 5 checks passed in [\d.]+ m?s$", lines[-1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_distfn_test_under_torchrun_runs_in_place_and_rank_0_reports() -> None:
    done = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "distfn", "test"],
                          env=_clean(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("distfn test: 2 ranks (torchrun), gloo on cpu") == 1  # one report, rank 0's
    assert "all 5 checks passed" in done.stdout


def test_distfn_test_fails_with_a_non_zero_status() -> None:
    bad = _run("test", env={"DISTFN_NPROCS": "0"})  # the job refuses to start: reported, status 1
    assert bad.returncode == 1 and "distfn test: FAILED" in bad.stderr and "DISTFN_NPROCS" in bad.stderr
    result = {"world_size": 2, "launcher": "spawn", "backend": "gloo", "device": "cpu", "checks": [
        {"name": "all-reduce", "ok": False, "seconds": 0.002, "detail": "sum of 1..2 over the ranks = 4"},
        {"name": "barrier", "ok": True, "seconds": 0.001, "detail": "every rank arrived"}]}
    text, status = smoketest.report(result, 1.5)
    assert status == 1
    assert "  FAIL  all-reduce" in text and "  PASS  barrier" in text
    assert text.endswith("1 of 2 checks FAILED: all-reduce in 1.50 s")


def test_distfn_test_gpu_without_gpus_says_so() -> None:
    if __import__("torch").cuda.device_count():
        pytest.skip("GPUs are visible here: tests/test_gpu.py runs `distfn test --gpu`")
    done = _run("test", "--gpu")
    assert done.returncode == 2 and "no CUDA GPU is visible" in done.stderr


def test_env_prints_a_value_that_is_not_utf8() -> None:
    """An environment value holding a byte that is not UTF-8 is shown escaped (it crashed with UnicodeEncodeError)."""
    bad = os.fsdecode(b"caf\xe9")  # what Python makes of the byte: a lone surrogate
    text = _run("env", env={"DISTFN_NOTE": bad, "CUDA_VISIBLE_DEVICES": ""})
    assert text.returncode == 0, text.stderr
    assert "DISTFN_NOTE" in text.stdout and "caf" in text.stdout


@pytest.mark.parametrize("args", [["--help"], ["version"], ["consolidate", "--help"], ["env", "--help"]])
def test_help_and_version_are_instant_they_import_no_torch(args: list[str]) -> None:
    """Issue 31 item 6: torch's import (3-5 s) is for the commands that use it; --help and version answer at
    once (measured: 0.05-0.2 s, the interpreter and loguru)."""
    code = ("import sys, time; t = time.perf_counter(); from distfn.__main__ import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], env=_clean(), capture_output=True, text=True, timeout=120)
    _, imported, seconds = done.stdout.strip().splitlines()[-1].split()
    assert imported == "False", done.stdout
    assert float(seconds) < 1.0  # 0.01 s here on an idle machine; generous for a loaded one


def test_import_distfn_is_lazy_and_its_names_still_work() -> None:
    code = ("import sys, distfn; print('torch' in sys.modules); from distfn import distributed, load, Context\n"
            "print('torch' in sys.modules, callable(distributed), distfn.checkpoint.__name__, distfn.failures.__name__)"
            "\nimport pytest\nwith pytest.raises(AttributeError): distfn.no_such_name")
    done = subprocess.run([sys.executable, "-c", code], env=_clean(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "distfn.checkpoint", "distfn.failures"]


def test_decorating_imports_neither_torch_distributed_nor_the_launch_machinery() -> None:
    """Issue 32 item 1: ``from distfn import distributed`` and decorating a DDP function (which plans the call and
    forks the fork server) load no ``torch.distributed`` module that ``import torch`` did not load itself (torch
    2.13 imports it with torch; older ones do not), and none of distfn's launch machinery: that is the first
    call's (`distfn.execute`)."""
    code = ("import sys, torch\n"
            "dist_before = {m for m in sys.modules if m == 'torch.distributed' or m.startswith('torch.distributed.')}\n"
            "from distfn import distributed\n"
            "@distributed(mode='ddp', nprocs=2)\n"
            "def train(cfg, ctx):\n"
            "    return None\n"
            "dist_after = {m for m in sys.modules if m == 'torch.distributed' or m.startswith('torch.distributed.')}\n"
            "heavy = ('distfn.execute', 'distfn.worker', 'distfn.context', 'distfn.run', 'distfn.checkpoint', "
            "'distfn.launch.local', 'distfn.launch.ray', 'distfn.launch.protocol', 'distfn.rendezvous', "
            "'distfn.fsdp', 'cloudpickle')\n"
            "print(sorted(dist_after - dist_before), sorted(m for m in heavy if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], env=_clean(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[] []", f"imported at decoration: {done.stdout.strip()}"


def test_env_help_lists_every_launcher() -> None:
    from distfn.options import LAUNCHERS

    text = _run("env", "--help").stdout
    assert all(name in text for name in LAUNCHERS), text


def test_env_says_what_changes_the_count_and_lists_extras_and_the_install() -> None:
    """Issue 31 item 6: the script's nprocs= / DISTFN_NPROCS, the optional extras, where distfn is and its
    commit (this tree is a git checkout)."""
    info = envreport.collect({})
    assert envreport.COUNT_NOTE in info["plan"]["notes"]
    assert {"tensorboard", "mpi", "ray"} <= set(info["extras"]) and "mpi4py" in info["extras"]["mpi"]
    assert info["install"]["location"] == os.path.dirname(cli.__file__)
    assert re.fullmatch(r"[0-9a-f]{12}( \+ local changes)?", info["install"]["commit"] or "")
    text = envreport.render(info)
    assert "changes this count" in text and "\nextras\n" in text and "\ninstall\n" in text
    assert f"location             {os.path.dirname(cli.__file__)}" in text
    under_torchrun = envreport.collect({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0",
                                        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": "29555"})
    assert envreport.COUNT_NOTE not in under_torchrun["plan"]["notes"]  # the launcher's world size wins
    assert envreport.COUNT_NOTE not in envreport.collect({"DISTFN_NPROCS": "2"})["plan"]["notes"]  # it is set


def test_a_job_that_never_saves_does_not_import_the_checkpoint_code() -> None:
    """Issue 32: the launch and worker code (`distfn.execute`) loads the checkpoint writer, reader and restore
    only at the first save or load (~30 ms after torch per process, every rank under torchrun); every public name
    of `distfn.checkpoint` still resolves, and ``ctx.save`` then loads them."""
    code = ("import sys, torch, distfn.execute, distfn.checkpoint as ck\n"
            "heavy = ('distfn.checkpoint.api', 'distfn.checkpoint.restore', 'distfn.checkpoint.sharded', "
            "'distfn.checkpoint.storage', 'distfn.checkpointing')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "print(all(callable(getattr(ck, n)) or n == 'RNG' for n in ck.__all__), sorted(ck.__all__) == "
            "sorted(ck._EXPORTS), 'load_into' in dir(ck))\n"
            "import pytest\nwith pytest.raises(AttributeError): ck.no_such_name\n")
    done = subprocess.run([sys.executable, "-c", code], env=_clean(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["[]", "True True True"], done.stdout
