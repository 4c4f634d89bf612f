"""``launcher="ray"`` (distfn.launch.ray): the rank layout rules without Ray, then real jobs on a local Ray cluster.

The cluster tests start their own two-node Ray cluster on this machine (``ray start --head`` and a second raylet
joining it, one CPU each, a small object store) and always stop it (``ray stop --force``). They run the unchanged
script tests/scripts/ray_job.py with ``DISTFN_LAUNCHER=ray``. Without Ray they skip with a reason naming
``distfn[ray]``; with ``DISTFN_REQUIRE_CLUSTER=1`` (CI) they fail instead.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distfn import distributed
from distfn.errors import ConfigError
from distfn.launch import ray as ray_launch
from distfn.launch.ray import import_ray, in_driver_dir
from distfn.launch.ray_rules import ActorPlace, assign_ranks, choose_working_dir, ray_nprocs, topology_for
from distfn.options import Options, with_env
from distfn.topology import Topology

from conftest import SCRIPTS, clean_env, free_port

ROOT = Path(__file__).resolve().parent.parent
JOB = SCRIPTS / "ray_job.py"
JOB_TIMEOUT = 240  # seconds; a job takes 30-60 s on this loaded 2-core machine (most of it starting the actors)


# -- rules, no Ray needed ------------------------------------------------------------------------------------------
def test_launcher_ray_is_an_option_and_distfn_launcher_selects_it() -> None:
    assert Options(launcher="ray").launcher == "ray"
    assert with_env(Options(), {"DISTFN_LAUNCHER": "ray"}).launcher == "ray"
    with pytest.raises(ConfigError, match="DISTFN_LAUNCHER"):
        with_env(Options(), {"DISTFN_LAUNCHER": "rey"})


def test_nprocs_defaults_to_the_clusters_gpus_and_is_required_without_them() -> None:
    assert ray_nprocs(Options(), {}, cluster_gpus=8.0) == 8
    assert ray_nprocs(Options(nprocs=3), {}, cluster_gpus=8.0) == 3
    assert ray_nprocs(Options(), {"DISTFN_NPROCS": "2"}, cluster_gpus=0.0) == 2
    assert ray_nprocs(Options(mode="single"), {}, cluster_gpus=0.0) == 1
    with pytest.raises(ConfigError, match=r"no GPUs.*nprocs=.*DISTFN_NPROCS"):
        ray_nprocs(Options(), {}, cluster_gpus=0.0)
    with pytest.raises(ConfigError, match="mode='dp'"):
        ray_nprocs(Options(mode="dp"), {}, cluster_gpus=4.0)
    with pytest.raises(ConfigError, match="drop devices="):
        ray_nprocs(Options(devices="0,1"), {}, cluster_gpus=4.0)


def test_ranks_are_laid_out_node_by_node_with_each_nodes_gpus_visible() -> None:
    # Ray placed bundles 0..3 on two nodes, interleaved, with GPUs handed out in no particular order.
    places = [ActorPlace(0, "nodeA", "10.0.0.1", "a", 11, ("3",)), ActorPlace(1, "nodeB", "10.0.0.2", "b", 21, ("1",)),
              ActorPlace(2, "nodeA", "10.0.0.1", "a", 12, ("0",)), ActorPlace(3, "nodeB", "10.0.0.2", "b", 22, ("0",))]
    plan = assign_ranks(places)
    assert [(a.rank, a.node_rank, a.local_rank, a.place.pid) for a in plan] == [
        (0, 0, 0, 12), (1, 0, 1, 11), (2, 1, 0, 22), (3, 1, 1, 21)]
    assert {a.visible_devices for a in plan[:2]} == {"0,3"} and {a.visible_devices for a in plan[2:]} == {"0,1"}
    assert all((a.local_world_size, a.num_nodes) == (2, 2) for a in plan)
    topo = topology_for(plan[3], 4, "10.0.0.1", 29555)
    assert (topo.launcher, topo.rank, topo.local_rank, topo.node_rank, topo.world_size, topo.master_addr,
            topo.master_port) == ("ray", 3, 1, 1, 4, "10.0.0.1", 29555)


def test_cpu_actors_get_no_visible_devices_and_node_zero_holds_bundle_zero() -> None:
    places = [ActorPlace(1, "n1", "ip1", "h", 2), ActorPlace(0, "n2", "ip2", "h", 1),
              ActorPlace(2, "n1", "ip1", "h", 3)]
    plan = assign_ranks(places)
    assert [(a.place.bundle, a.node_rank, a.local_rank, a.local_world_size) for a in plan] == [
        (0, 0, 0, 1), (1, 1, 0, 2), (2, 1, 1, 2)]
    assert all(a.visible_devices is None for a in plan)


def test_missing_ray_is_a_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"distfn\[ray\]"):
        import_ray()

    @distributed(launcher="ray", nprocs=2)
    def train(cfg, ctx):
        return 1

    with pytest.raises(ConfigError, match=r"distfn\[ray\]"):
        train()


def test_distfn_env_reports_the_ray_launcher_and_its_address() -> None:
    from distfn import envreport as cli

    info = cli.collect({"DISTFN_LAUNCHER": "ray", "RAY_ADDRESS": "10.0.0.1:6379"})
    assert info["launcher"]["launcher"] == "ray" and info["launcher"]["error"] is None
    assert "10.0.0.1:6379" in info["launcher"]["reason"]
    assert info["variables"]["RAY_ADDRESS"] == "10.0.0.1:6379"
    text = cli.render(info)
    assert "one actor per rank" in text and "ray " in text


def test_a_rank_runs_in_the_drivers_directory_where_the_node_has_it_else_says_where_paths_go() -> None:
    """Issue 25 item 16: the rule that decides where a rank's relative paths resolve."""
    assert choose_working_dir("/work/job", "/tmp/ray/session/runtime", "n1", is_dir=lambda p: True).change_to == \
        "/work/job"
    same = choose_working_dir("/tmp/x", "/tmp/x", "n1", is_dir=lambda p: True)
    assert (same.change_to, same.warning) == (None, None)
    missing = choose_working_dir("/home/me/job", "/tmp/ray/session/runtime", "node7", is_dir=lambda p: False)
    assert missing.change_to is None and missing.warning is not None
    assert "/home/me/job" in missing.warning and "/tmp/ray/session/runtime" in missing.warning
    assert "node7" in missing.warning and "relative paths" in missing.warning


def _rank_topology() -> Topology:
    return Topology(launcher="ray", rank=1, local_rank=0, world_size=2, local_world_size=1, node_rank=1,
                    num_nodes=2, master_addr="127.0.0.1", master_port=1, reason="test")


def test_the_actor_works_in_the_drivers_directory_and_gets_its_own_back(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    actor_dir, driver_dir = tmp_path / "raylet", tmp_path / "driver"
    actor_dir.mkdir()
    driver_dir.mkdir()
    monkeypatch.chdir(actor_dir)
    with in_driver_dir(str(driver_dir), _rank_topology()):
        Path("out.txt").write_text("x")  # a relative path in the user's function
    assert (driver_dir / "out.txt").exists() and Path.cwd() == actor_dir
    with pytest.raises(ValueError), in_driver_dir(str(driver_dir), _rank_topology()):
        raise ValueError("the function failed")
    assert Path.cwd() == actor_dir


def test_a_node_without_the_drivers_directory_logs_one_warning_on_that_rank(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    gone = tmp_path / "not-on-this-node"
    with in_driver_dir(str(gone), _rank_topology()):
        assert Path.cwd() == tmp_path
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "rank 1/2" in err, err
    assert str(gone) in err and str(tmp_path) in err and "relative paths" in err


class _SwallowingRay:
    """A stand-in for the ``ray`` module whose waits behave as Ray's C++ waits can: they run Python's SIGINT
    handler (Ray's ``check_signals`` calls ``PyErr_CheckSignals``), catch the KeyboardInterrupt and return
    normally. The first wait receives the Ctrl-C; after a few more the ranks "finish"."""

    class exceptions:  # the shape of ray.exceptions
        RayError = RuntimeError
        RayActorError = RuntimeError

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        self.waits += 1
        if self.waits == 1:
            try:
                signal.raise_signal(signal.SIGINT)  # the Ctrl-C arrives while Ray waits ...
            except KeyboardInterrupt:
                pass  # ... and Ray turns it into a status that this wait drops
        if self.waits < 5:
            return [], list(refs)
        return list(refs), []

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        return ("ok", {"rank": ref})

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}


def test_one_ctrl_c_ends_the_job_even_where_ray_swallows_the_keyboard_interrupt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 17a, the cause: a Ctrl-C that Ray's wait consumed without raising was lost (a second one was
    needed). The driver's own handler records it, and the next check (at most POLL_S later) raises it."""
    fake = _SwallowingRay()
    torn_down: list[bool] = []
    monkeypatch.setattr(ray_launch, "import_ray", lambda: fake)
    monkeypatch.setattr(ray_launch, "_connect", lambda ray: None)
    monkeypatch.setattr(ray_launch.RayJob, "place", lambda self: None)
    monkeypatch.setattr(ray_launch.RayJob, "start", lambda self, fn, cfg: {0: 0, 1: 1})
    monkeypatch.setattr(ray_launch.RayJob, "teardown", lambda self: torn_down.append(True))
    # Python's own handler, as in an interactive driver, whatever this test process inherited (a runner started
    # in the background of a non-interactive shell has SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_against_a_swallowing_ray(fake, torn_down)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_against_a_swallowing_ray(fake: Any, torn_down: list[bool]) -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        ray_launch.launch(lambda cfg, ctx: None, None, Options(nprocs=2))
    assert fake.waits <= 2 and torn_down == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the driver's handler is given back


# -- a real local Ray cluster ----------------------------------------------------------------------------------------
def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail when CI demands the cluster (DISTFN_REQUIRE_CLUSTER=1)."""
    if os.environ.get("DISTFN_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"{reason} (DISTFN_REQUIRE_CLUSTER=1: CI must run the cluster tests)")
    pytest.skip(reason)


def ray_cli() -> str:
    if importlib.util.find_spec("ray") is None:
        unavailable("needs Ray, from the 'ray' extra: pip install -e '.[ray]' (distfn[ray])")
    found = Path(sys.executable).with_name("ray")
    path = str(found) if found.exists() else shutil.which("ray")
    if path is None:
        unavailable("Ray is importable but its `ray` command is not on PATH; reinstall distfn[ray]")
    return path  # type: ignore[return-value]


# Ray keeps an auth token in ~/.ray/auth_token, made by the first local cluster that needs one (tests/test_hangs.py's
# `ray.init(address="local")` makes one); a `ray start` that reads another cluster's token fails with
# InvalidAuthToken. These tests' clusters get a home of their own.
RAY_HOME = tempfile.mkdtemp(prefix="distfn-ray-home-")


def cluster_env(**extra: str) -> dict[str, str]:
    env = clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", HOME=RAY_HOME, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def ray_cmd(ray: str, *args: str, env: dict[str, str], timeout: float = 120) -> None:
    res = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=60)
        pytest.fail(f"ray {' '.join(args)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A two-node Ray cluster on this machine (two raylets, 1 CPU each); yields its address."""
    ray = ray_cli()
    env = cluster_env()
    port = free_port()
    small = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=80000000", "--disable-usage-stats"]
    try:
        ray_cmd(ray, "start", "--head", f"--port={port}", "--include-dashboard=false", *small, env=env)
        ray_cmd(ray, "start", f"--address=127.0.0.1:{port}", *small, env=env)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


def job_env(address: str, out: Path, **extra: str) -> dict[str, str]:
    return cluster_env(RAY_ADDRESS=address, DISTFN_LAUNCHER="ray", DISTFN_NPROCS="2", DISTFN_TEST_OUT=str(out),
                       **extra)


def run_job(env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the Ray job did not finish in {JOB_TIMEOUT} s; output:\n{str(exc.stderr)[-4000:]}")


@pytest.mark.cluster
@pytest.mark.slow
def test_two_ranks_on_two_ray_nodes_train_identically_and_save_once(ray_cluster: str, tmp_path: Path) -> None:
    driver_dir = tmp_path / "driver"  # where the command runs: the ranks' relative paths land here (item 16)
    driver_dir.mkdir()
    res = run_job(job_env(ray_cluster, tmp_path), cwd=driver_dir)
    assert res.returncode == 0, res.stderr[-6000:]
    for r in range(2):
        assert (driver_dir / f"relative-rank{r}.txt").read_text() == str(driver_dir), f"rank {r}"
    assert "does not exist on node" not in res.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"], r["launcher"], r["env_rank"]) for r in ranks] == [
        (0, 2, "ray", "0"), (1, 2, "ray", "1")]
    # one rank per Ray node: node ranks follow the nodes, each node has one local rank
    assert len({r["ray_node"] for r in ranks}) == 2
    assert [(r["node_rank"], r["num_nodes"], r["local_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 2, 0, 1), (1, 2, 0, 1)]
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in {r["pid"] for r in ranks}
    assert ranks[0]["initial"] == ranks[1]["initial"], "seeded models differ"
    assert ranks[0]["final"] == ranks[1]["final"], "ranks ended with different weights"
    assert ranks[0]["final"] != ranks[0]["initial"]
    writes = (tmp_path / "writes.log").read_text().splitlines()
    assert len(writes) == 1 and writes[0].split()[0] == "0", writes
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    assert [round(v, 6) for t in (state["weight"], state["bias"]) for v in t.flatten().tolist()] == [
        round(v, 6) for v in ranks[0]["final"]]
    # the caller got rank 0's value
    assert json.loads((tmp_path / "result.json").read_text())["rank"] == 0


@pytest.mark.cluster
@pytest.mark.slow
def test_a_failing_rank_raises_worker_error_with_rank_host_and_traceback(ray_cluster: str, tmp_path: Path) -> None:
    res = run_job(job_env(ray_cluster, tmp_path, DISTFN_TEST_FAIL_RANK="1"))
    assert res.returncode == 1, res.stderr[-6000:]
    err = res.stderr
    assert "distfn.errors.WorkerError: rank 1 (pid" in err, err[-6000:]
    assert "failed with ValueError: rank 1 fails on purpose" in err
    assert 'in explode\n    raise ValueError(f"rank {rank} fails on purpose")' in err  # the rank's own traceback
    assert not (tmp_path / "model.safetensors").exists()


@contextlib.contextmanager
def _hanging_job(ray_cluster: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """``ray_job.py`` with every rank hanging: yields the driver and the ranks' actor pids once both started; the
    driver is killed on the way out if it still runs."""
    # the driver gets SIGINT's default disposition, as a program started from a terminal has, whatever this runner
    # inherited (one started in the background of a non-interactive shell has SIGINT ignored, and so would its child)
    proc = subprocess.Popen([sys.executable, str(JOB)], env=job_env(ray_cluster, tmp_path, DISTFN_TEST_HANG="1"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        started = [tmp_path / f"started{r}" for r in range(2)]
        while not all(p.exists() and p.read_text() for p in started):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)[0][-4000:]
            time.sleep(0.5)
        yield proc, [int(p.read_text()) for p in started]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: Seconds within which one Ctrl-C ends the driver (measured: 2-3 s, most of it Ray's own disconnect).
CTRL_C_BOUND = 30


@pytest.mark.cluster
@pytest.mark.slow
def test_one_ctrl_c_in_the_driver_ends_the_job_and_kills_the_actors_every_time(ray_cluster: str,
                                                                               tmp_path: Path) -> None:
    """Issue 25 item 17a: a driver once needed a second Ctrl-C (Ray's waits can consume the KeyboardInterrupt,
    see test_one_ctrl_c_ends_the_job_even_where_ray_swallows_the_keyboard_interrupt). Five rounds, one SIGINT
    each, while the ranks are busy: the driver ends within CTRL_C_BOUND with KeyboardInterrupt's status and its
    actors' processes are gone."""
    for round_ in range(5):
        out = tmp_path / f"round{round_}"
        out.mkdir()
        with _hanging_job(ray_cluster, out) as (proc, pids):
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            try:
                output, _ = proc.communicate(timeout=CTRL_C_BOUND)
            except subprocess.TimeoutExpired:
                pytest.fail(f"round {round_}: the driver still ran {CTRL_C_BOUND} s after one Ctrl-C")
            took = time.monotonic() - sent
        assert proc.returncode != 0, f"round {round_}: {output[-4000:]}"
        assert "interrupted: killing the 2 Ray actor(s)" in output, output[-4000:]
        assert "KeyboardInterrupt" in output, output[-4000:]
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), f"round {round_}: actor processes {pids} still run after Ctrl-C"
        print(f"round {round_}: ended {took:.1f} s after one Ctrl-C")


@pytest.mark.cluster
@pytest.mark.slow
def test_the_ray_example_trains_on_the_cluster(ray_cluster: str, tmp_path: Path) -> None:
    env = cluster_env(RAY_ADDRESS=ray_cluster, DISTFN_NPROCS="2", EPOCHS="3")
    try:
        example = [str(ROOT / "examples" / "ray_train.py"), str(tmp_path / "m.safetensors")]
        proc = subprocess.run([sys.executable, *example], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"examples/ray_train.py did not finish in {JOB_TIMEOUT} s:\n{str(exc.stderr)[-4000:]}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert (result["world_size"], result["num_nodes"], result["launcher"]) == (2, 2, "ray")
    assert result["last_loss"] < result["first_loss"]
    assert (tmp_path / "m.safetensors").exists()


@pytest.mark.cluster
@pytest.mark.slow
def test_an_actor_killed_from_outside_is_reported_as_a_dead_actor(ray_cluster: str, tmp_path: Path) -> None:
    with _hanging_job(ray_cluster, tmp_path) as (proc, pids):
        os.kill(pids[1], signal.SIGKILL)  # rank 1's actor dies without a word (as the OOM killer would do it)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output[-4000:]
    assert "WorkerError: rank 1 (pid" in output and "failed with ActorDied: this rank's Ray actor died" in output, \
        output[-4000:]
