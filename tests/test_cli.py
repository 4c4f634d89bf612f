"""The ``distfn`` command (``python -m distfn``): ``env`` (what it detects, text and JSON) and ``test`` (the
2-rank smoke test)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

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



#: What a plain DDP job never loads (issue 46 item 2: each was imported at every call, on the launch's critical
#: path): the FSDP code (and through `distfn.fsdp_state` the sharded checkpoint code), tensor parallelism,
#: gradient accumulation (loaded at ``ctx.accumulate`` / ``ctx.no_sync``) and the kept-alive ranks' launcher side
#: (``keep_alive=True`` only).
_NOT_IN_A_DDP_JOB = ("distfn.fsdp", "distfn.fsdp_state", "distfn.tensor_parallel", "distfn.accumulation",
                     "distfn.launch.pool")

_DDP_JOB = """
import sys
import torch
from distfn import distributed

LAZY = {lazy!r}

@distributed(mode="ddp", nprocs=2, backend="gloo")
def train(cfg, ctx):
    model = ctx.wrap(torch.nn.Linear(2, 2))
    loss = model(torch.ones(1, 2)).sum()
    ctx.backward(loss)
    ctx.all_reduce(torch.ones(1))
    rows = ctx.gather_for_metrics(torch.full((1,), float(ctx.rank)))
    deferred = ctx.run.mesh_if_made is None  # the default mesh: not made by start-up, all_reduce or gather
    named = (ctx.mesh.mesh_dim_names, ctx.mesh.size()) if ctx.rank == 1 else None  # one rank alone asks
    ctx.all_reduce(torch.ones(1))  # and the ranks still meet afterwards
    lazy = sorted(m for m in LAZY if m in sys.modules)
    return ctx.gather_object((lazy, deferred, named, rows.tolist(), ctx.dp_size))

if __name__ == "__main__":
    ranks = train(None)
    print("RANKS", [r[0] for r in ranks])
    print("LAUNCHER", sorted(m for m in LAZY if m in sys.modules))
    print("MESH", [r[1:] for r in ranks])
"""


def test_a_plain_ddp_job_never_imports_the_fsdp_accumulation_or_pool_code(tmp_path: Any) -> None:
    """Issue 46 item 2: a DDP job that wraps a model, steps and all-reduces loads none of `_NOT_IN_A_DDP_JOB`,
    in the launching process or in any rank (the rule beside issue 32's "a job that never saves does not load the
    checkpoint writer"); its default mesh is made at first use (`distfn.run.Run.defer_mesh`), not by start-up,
    ``ctx.all_reduce`` or ``ctx.gather_for_metrics``, and one rank alone may ask for ``ctx.mesh``."""
    script = tmp_path / "ddp_job.py"
    script.write_text(_DDP_JOB.format(lazy=_NOT_IN_A_DDP_JOB))
    done = subprocess.run([sys.executable, str(script)], env=_clean(), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.startswith(("RANKS", "LAUNCHER", "MESH")))
    assert lines == {"RANKS": "[[], []]", "LAUNCHER": "[]",
                     "MESH": "[(True, None, [0.0, 1.0], 2), (True, (('dp_shard',), 2), [0.0, 1.0], 2)]"}, done.stdout


def test_the_lazy_modules_load_where_their_feature_is_used() -> None:
    """The other side of `_NOT_IN_A_DDP_JOB`: ``ctx.accumulate`` / ``ctx.no_sync`` import `distfn.accumulation`
    and work; an FSDP run's backend rule and ``ctx.wrap`` in ``mode="fsdp"`` import `distfn.fsdp`; a
    ``keep_alive`` call imports the pool (tests/test_pool.py runs those calls)."""
    code = ("import sys, torch, distfn.execute, distfn.wrapping as w\n"
            "from distfn import context, worker\n"
            "from distfn.fsdp_options import FsdpOptions\n"
            "print(sorted(m for m in " + repr(_NOT_IN_A_DDP_JOB) + " if m in sys.modules))\n"
            "m = torch.nn.Linear(2, 2)\n"
            "with context.Context.no_sync(None, m): pass\n"
            "print('distfn.accumulation' in sys.modules)\n"
            "w.wrap(m, mode='single', device=torch.device('cpu'), is_main=True, compile=False)\n"
            "print('distfn.fsdp' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_clean(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["[]", "True", "False"], done.stdout

# -- distfn --version, inspect, ls; bad arguments (issue 44 item 5, issue 41 item 19) ----------------------------
def test_version_flag_in_process_and_through_the_real_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    from distfn import __version__

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"distfn {__version__}"
    # the console script pip installs (python -m distfn where the venv has none)
    script = os.path.join(os.path.dirname(sys.executable), "distfn")
    command = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "distfn"]
    done = subprocess.run([*command, "--version"], env=_clean(), capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, f"distfn {__version__}"), done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["test", "--nprocs", "0"], "0 is not a positive number of ranks"),
    (["test", "--nprocs", "-3"], "-3 is not a positive number of ranks"),
    (["test", "--nprocs", "two"], "'two' is not an integer"),
    (["test", "--timeout", "0"], "not a positive, finite number of seconds"),
    (["test", "--timeout", "nan"], "not a positive, finite number of seconds"),
    (["inspect", ""], "an empty path names nothing"),
    (["inspect"], "the following arguments are required: checkpoint"),
    (["ls", ""], "an empty path names nothing"),
    (["ls", "a", "b"], "unrecognized arguments: b"),
    (["ls", "a", "5"], "unrecognized arguments: 5"),  # a number was dropped anywhere, as if a --local_rank value
    (["version", "--local_rank", "1", "7"], "unrecognized arguments: 7"),
])
def test_bad_arguments_are_an_early_error_with_status_2(args: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41 item 19: `distfn test --nprocs 0` ran 2 ranks and said "all 5 checks passed" (`nprocs or 2`)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_legacy_launchers_local_rank_argument_is_still_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--local-rank=1"], ["--local_rank=1"], ["--local_rank", "1"], ["--local-rank", "3"]):
        assert cli.main(["version", *extra]) == 0
    assert capsys.readouterr().out.split() == [cli.__version__] * 4


def test_run_test_itself_refuses_a_bad_count_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoketest.run_test(nprocs=0) == 2
    assert smoketest.run_test(timeout=-1.0) == 2
    err = capsys.readouterr().err
    assert "--nprocs must be a positive number of ranks, got 0" in err and "--timeout must be a positive" in err


def test_env_lists_every_user_facing_extra_of_pyproject_without_importing_them() -> None:
    """Issue 44 item 5: mlflow, wandb, s3fs ... with their versions, from the installed metadata only."""
    with open(os.path.join(os.path.dirname(os.path.dirname(cli.__file__)), "pyproject.toml")) as f:
        text = f.read()
    block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    declared = set(re.findall(r"^([a-z0-9-]+) = \[", block, re.M))
    assert {"mlflow", "wandb", "s3", "tensorboard", "ray", "mpi"} <= declared
    heavy = ("mlflow", "wandb", "s3fs", "fsspec", "ray", "mpi4py", "tensorboard", "sklearn")
    before = {m for m in heavy if m in sys.modules}
    extras = envreport._extras()
    assert {m for m in heavy if m in sys.modules} == before  # nothing imported to find a version
    assert set(extras) == declared - {"docs", "lint", "runner", "test"}
    assert set(extras["s3"]) == {"fsspec", "s3fs"} and set(extras["mpi"]) == {"mpi4py"}
    from importlib import metadata

    for extra, packages in extras.items():
        for name, version in packages.items():
            try:
                assert version == metadata.version(name), (extra, name)
            except metadata.PackageNotFoundError:
                assert version is None
    text = envreport.render(envreport.collect({}))
    assert re.search(r"\n  s3\s+fsspec \S+, s3fs \S+", text) and re.search(r"\n  mlflow\s+mlflow ", text)


def _training_state(tmp_path: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """What ``ctx.save(state, ..., rng=True)`` stores under ``track="csv"`` on 2 ranks, built in this process:
    a model, an optimizer with state, a ``ctx.dataloader``'s position, every rank's RNG states and the tracking
    record (checked against a real job's save in test_inspect_and_ls_of_a_real_jobs_checkpoints)."""
    import torch
    from torch import nn

    from distfn.loader_state import LoaderState
    from distfn.rng import combine_rng_states, rng_state

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    loader = LoaderState(epoch=1, position=24, batches=3, seed=0, shuffle=True, drop_last=False, global_batch=8,
                         world_size=2, epoch_world_size=2, dataset_len=64).to_dict()
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 7,
             "rng": combine_rng_states([rng_state(), rng_state()])}
    meta = {"distfn.tracking": {"key": "20261204-010203-abcdef", "step": 7,
                                "runs": {"csv": {"dir": str(tmp_path / "runs" / "20261204-010203-abcdef")}}},
            "note": "hello"}
    return model, state, meta


def test_inspect_a_file_and_a_sharded_directory_headers_only(tmp_path: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from distfn.checkpoint import save, sharded, storage

    _, state, meta = _training_state(tmp_path)
    save(state, tmp_path / "ckpt-7.safetensors", metadata=meta)
    sharded.save(state, tmp_path / "ckpt-7", metadata=meta)
    reads = []
    real = storage.Reader.get
    storage.Reader.get = lambda self, *a, **k: reads.append(a) or real(self, *a, **k)  # type: ignore[method-assign]
    try:
        for target, layout in ((tmp_path / "ckpt-7.safetensors", "single file"), (tmp_path / "ckpt-7", "sharded")):
            assert cli.main(["inspect", str(target)]) == 0
            out = capsys.readouterr().out
            assert re.search(rf"\n  layout\s+{layout}", out) and re.search(r"\n  step\s+7\n", out)
            assert re.search(r"\n  model\.weight\s+F32\s+\[2, 8\]\s+64 B\n", out), out
            assert re.search(r"\n  optimizer\.state\.0\.momentum_buffer\s+F32\s+\[2, 8\]\s+64 B\n", out)
            assert re.search(r"\n  rng\.ranks\.1\.torch\s+U8\s+\[\d+\]", out)
            assert re.search(r"\n  optimizer\s+optimizer state \(2 tensors, 72 B\)", out)
            assert "ctx.dataloader at epoch 1, next batch 3 (position 24 of 64 samples), global batch 8" in out
            assert "RNG states of 2 rank(s) (numpy, python, torch)" in out
            assert "continues run 20261204-010203-abcdef, last step logged 7" in out
            assert re.search(r"\n  metadata\s+note\n", out)
    finally:
        storage.Reader.get = real  # type: ignore[method-assign]
    assert reads == []  # no tensor was read: headers only
    assert cli.main(["inspect", "--json", str(tmp_path / "ckpt-7")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "sharded" and info["step"] == 7 and info["state_step"] == 7
    assert info["loaders"]["loader"]["position"] == 24 and info["rng"]["ranks"] == 2
    assert info["tracking"]["key"] == "20261204-010203-abcdef"
    assert {t["name"]: (t["dtype"], t["shape"]) for t in info["tensors"]}["model.bias"] == ("F32", [2])


def _damaged(tmp_path: Any) -> dict[str, Any]:
    """Files a user might point distfn inspect at, each damaged in another way (name -> path)."""
    import pickle
    import struct

    from distfn.checkpoint import save

    _, state, _ = _training_state(tmp_path)
    good = save(state, tmp_path / "good.safetensors")
    raw = good.read_bytes()

    def header(meta: dict[str, str], name: str) -> Any:
        h = json.dumps({"__metadata__": meta}).encode()
        h += b" " * (-len(h) % 8)
        (tmp_path / name).write_bytes(struct.pack("<Q", len(h)) + h)
        return tmp_path / name

    out = {"truncated": tmp_path / "ckpt-9.safetensors", "garbage": tmp_path / "ckpt-8.safetensors",
           "empty": tmp_path / "ckpt-7.safetensors", "pickle": tmp_path / "model.pt"}
    out["truncated"].write_bytes(raw[:len(raw) // 2])
    out["garbage"].write_bytes(b"not a checkpoint at all")
    out["empty"].write_bytes(b"")
    out["pickle"].write_bytes(pickle.dumps({"a": 1}))
    out["deep tree"] = header({"distfn.format": "1", "distfn.tree": "[" * 100_000 + "]" * 100_000},
                              "ckpt-6.safetensors")
    out["bad tree"] = header({"distfn.format": "1", "distfn.tree": '{"w": {"__tensor__": "nothing"}}'},
                             "ckpt-5.safetensors")
    out["bad loader"] = header({"distfn.format": "1", "distfn.tree": json.dumps(
        {"loader": {"epoch": -1, "position": 0, "batches": 0, "seed": 0, "shuffle": True, "drop_last": False,
                    "global_batch": 8, "world_size": 2, "epoch_world_size": 2, "dataset_len": 64}})},
        "ckpt-4.safetensors")
    out["unhashable key"] = header({"distfn.format": "1", "distfn.tree": '{"__dict__": [[[1, 2], 3]]}'},
                                   "ckpt-1.safetensors")
    out["missing"] = tmp_path / "nothing.safetensors"
    out["not a checkpoint directory"] = tmp_path / "sub"
    out["not a checkpoint directory"].mkdir()
    return out


def test_inspect_damaged_files_is_one_line_and_status_1_never_a_traceback(tmp_path: Any,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for what, path in _damaged(tmp_path).items():
        status = cli.main(["inspect", str(path)])
        captured = capsys.readouterr()
        if what == "bad loader":  # readable: the report says the resume would fail there
            assert status == 0 and "cannot be restored: malformed data loader state" in captured.out, captured.out
            continue
        assert status == 1, (what, captured)
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, (what, captured.err)
        assert captured.err.startswith("distfn inspect: ") and "Traceback" not in captured.err
    assert cli.main(["inspect", str(tmp_path / "model.pt")]) == 1
    assert "unpickling a file can execute arbitrary code" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path / "ckpt-6.safetensors")]) == 1
    assert "levels deep, over the limit" in capsys.readouterr().err  # the bounded parser names the depth
    assert cli.main(["inspect", str(tmp_path / "ckpt-1.safetensors")]) == 1
    assert re.search(rf"{re.escape(str(tmp_path / 'ckpt-1.safetensors'))}'.* corrupt distfn metadata: .*cannot be a "
                     "mapping key", capsys.readouterr().err)


def test_an_unforeseen_failure_is_still_one_line_unless_debugging(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from distfn import inspection

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a reader bug")

    monkeypatch.setattr(inspection, "describe", broken)
    assert cli.main(["inspect", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"distfn inspect: cannot read '{tmp_path / 'x.safetensors'}': ZeroDivisionError: a reader "
                           "bug (damaged? DISTFN_DEBUG=1 shows the traceback)")
    monkeypatch.setenv("DISTFN_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["inspect", str(tmp_path / "x.safetensors")])


def test_inspect_escapes_control_characters_in_names(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from distfn.checkpoint import save

    save({"x\x1b[31mred\nline": torch.zeros(1)}, tmp_path / "evil.safetensors")
    assert cli.main(["inspect", str(tmp_path / "evil.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "x\\x1b[31mred\\nline" in out


def test_ls_newest_first_what_latest_picks_and_why_others_are_skipped(tmp_path: Any,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from distfn.checkpoint import latest, save, sharded

    _damaged(tmp_path)  # ckpt-9 .. ckpt-4: each damaged (ckpt-4 is a readable file, its loader state is not)
    deep = tmp_path / "ckpt-6.safetensors"
    (tmp_path / "deep").mkdir()
    deep.rename(tmp_path / "deep" / deep.name)  # listed apart, below: distfn.latest itself may fail on it
    _, state, _ = _training_state(tmp_path)
    save(state, tmp_path / "ckpt-3.safetensors")
    sharded.save(state, tmp_path / "ckpt-2")
    save(state, tmp_path / "snapshot-11.safetensors")
    (tmp_path / ".ckpt-12.safetensors.distfn-tmp-host-1").write_bytes(b"partial")
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{tmp_path} (prefix 'ckpt-', newest first)"
    rows = [line[2:].split()[0] for line in lines[1:] if re.match(r"^[* ] \S+\s+step ", line)]
    assert rows == ["snapshot-11.safetensors", "ckpt-9.safetensors", "ckpt-8.safetensors", "ckpt-7.safetensors",
                    "ckpt-5.safetensors", "ckpt-4.safetensors", "ckpt-3.safetensors",
                    "ckpt-2", "ckpt-1.safetensors", "good.safetensors"]
    text = "\n".join(lines)
    assert re.search(r"\n  ckpt-9\.safetensors\s+step\s+9\s+file .* skipped: it is not a complete safetensors", text)
    assert re.search(r"\n  ckpt-5\.safetensors .* skipped: .*names no stored tensor", text)
    assert re.search(r"\n\* ckpt-4\.safetensors .* complete: distfn\.latest picks this one", text)
    assert re.search(r"\n  ckpt-2\s+step\s+2\s+sharded .* complete \(older\)", text)
    assert re.search(r"\n  snapshot-11\.safetensors .* other: prefix 'snapshot-', not 'ckpt-'", text)
    assert re.search(r"\n  good\.safetensors .* other: no step number in its name", text)
    assert "(1 hidden entries" in text
    assert lines[-1].startswith("distfn.latest -> ckpt-4.safetensors: ctx.resume(")
    assert latest(tmp_path).name == "ckpt-4.safetensors"  # what ls says is what latest answers
    assert cli.main(["ls", "--json", "--prefix", "snapshot-", str(tmp_path)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["latest"] == "snapshot-11.safetensors" and found["prefix"] == "snapshot-"
    assert cli.main(["ls", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip() == f"distfn ls: no directory at '{tmp_path / 'nope'}'"
    assert cli.main(["ls", str(tmp_path / "ckpt-3.safetensors")]) == 1
    assert "is not a directory (to see what a checkpoint holds: distfn inspect" in capsys.readouterr().err
    # A header nested past any reader's limit: its row says so and distfn.latest skips it (issue 41 item 19)
    save(state, tmp_path / "deep" / "ckpt-3.safetensors")
    status = cli.main(["ls", str(tmp_path / "deep")])
    out = capsys.readouterr().out
    assert re.search(r"\n  ckpt-6\.safetensors .* skipped: .*nested \d+ levels deep", out), out
    assert status == 0 and out.splitlines()[-1].startswith("distfn.latest -> ckpt-3.safetensors"), out
    (tmp_path / "empty").mkdir()
    assert cli.main(["ls", str(tmp_path / "empty")]) == 0
    assert "no checkpoints here" in capsys.readouterr().out


def test_inspect_and_ls_of_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    """The same commands through the object-storage backend (memory://, this process's own store)."""
    pytest.importorskip("fsspec", reason="URLs need fsspec, from the 's3' extra: pip install 'distfn[s3]'")
    import uuid

    import torch

    from distfn.checkpoint import save

    root = f"memory://cli-{uuid.uuid4().hex[:8]}/run"
    save({"w": torch.ones(3, 2, dtype=torch.float16), "step": 5}, f"{root}/ckpt-5.safetensors")
    save({"w": torch.ones(3, 2, dtype=torch.float16), "step": 6}, f"{root}/ckpt-6.safetensors")
    import fsspec

    fsspec.filesystem("memory").pipe(f"{root.removeprefix('memory://')}/ckpt-7.safetensors", b"uncommitted upload")
    assert cli.main(["inspect", f"{root}/ckpt-6.safetensors"]) == 0
    out = capsys.readouterr().out
    from distfn.checkpoint.layout import resolve

    assert out.startswith(f"checkpoint {resolve(root).path}/ckpt-6.safetensors\n")  # the URL, as distfn spells it
    assert re.search(r"\n  w\s+F16\s+\[3, 2\]\s+12 B\n", out) and re.search(r"\n  step\s+6\n", out)
    assert cli.main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  ckpt-7\.safetensors\s+step\s+7\s+missing .* skipped: nothing readable under this name: on "
                     r"object storage an upload without its commit object", out), out
    assert "\n* ckpt-6.safetensors" in out and "distfn.latest -> ckpt-6.safetensors" in out
    assert cli.main(["inspect", f"{root}/ckpt-7.safetensors"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"distfn inspect: no checkpoint at '{resolve(root).path}/ckpt-7.safetensors'"


_JOB = '''
import torch
from torch import nn
from distfn import distributed

@distributed(mode="ddp", nprocs=2, seed=0, track="csv")
def train(cfg, ctx):
    model = ctx.wrap(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    loader = ctx.dataloader(data, batch_size=4)
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0}
    for step, (x, y) in enumerate(loader, 1):
        ctx.backward(nn.functional.mse_loss(model(x), y))
        ctx.step(opt)
        ctx.log_metrics({"loss": 1.0}, step=step)
        if step == 3:
            ctx.save({**state, "step": step}, "ckpt/ckpt-3.safetensors", rng=True)
            ctx.save({**state, "step": step}, "ckpt/ckpt-3", sharded=True, rng=True)
            return step

if __name__ == "__main__":
    print(train({}))
'''


@pytest.mark.slow
def test_inspect_and_ls_of_a_real_jobs_checkpoints(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """What a 2-rank ``ctx.save(..., rng=True)`` under ``track="csv"`` wrote, as inspect reports it: the loader's
    position after 3 steps, both ranks' RNG states and the tracked run's key (the directory the CSV backend
    made); ls picks the file (same step, sorted last), as distfn.latest does."""
    (tmp_path / "job.py").write_text(_JOB)
    done = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=_clean(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (key,) = os.listdir(tmp_path / "runs")
    for target in ("ckpt-3.safetensors", "ckpt-3"):
        assert cli.main(["inspect", "--json", str(tmp_path / "ckpt" / target)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["step"] == info["state_step"] == 3
        loader = info["loaders"]["loader"]
        assert (loader["epoch"], loader["batches"], loader["position"], loader["global_batch"]) == (0, 3, 24, 8)
        assert info["rng"] == {"ranks": 2, "parts": ["numpy", "python", "torch"]}
        assert info["tracking"]["key"] == key and info["tracking"]["step"] == 3
        assert info["world_size"] == (2 if target == "ckpt-3" else None)
    assert cli.main(["ls", str(tmp_path / "ckpt")]) == 0
    assert "distfn.latest -> ckpt-3.safetensors" in capsys.readouterr().out
