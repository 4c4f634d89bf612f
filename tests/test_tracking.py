"""Experiment tracking (issue 29): ``@distributed(track=...)``, ``ctx.log_metrics`` / ``ctx.log_params``.

Real backends: an ``mlflow server`` on 127.0.0.1 (its own sqlite store in the test's directory, always
stopped), W&B in offline mode (the ``.wandb`` files read back), TensorBoard event files and the CSV logger.
The jobs are 2-rank self-spawned scripts; what rank 1 does is checked from inside rank 1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import repo_env

from distfn.errors import ConfigError
from distfn.options import make_options
from distfn.tracking import CSV, MLflow, RunInfo
from distfn.tracking.key import KEY_ENV, RECORD_KEY, exported, job_key, key_in
from distfn.tracking.params import flatten
from distfn.tracking.session import Session, open_session, status_of

from conftest import clean_env, free_port, requires


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.pop(KEY_ENV, None)
    env.update(extra, PYTHONPATH=repo_env()["PYTHONPATH"])
    return env


def _run(script: Path, args: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, str(script), *args], env=dict(env), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout + done.stderr


# A 2-rank job that resumes from its checkpoints, logs loss/rank every step, saves every 5 steps and on its
# last step, and (attempt 0 only, when asked) is killed with SIGKILL on rank 0 at a given step, once the MLflow
# server holds that step: argv is ckpt_dir steps kill_at MLflow(...).
JOB = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    from torch import nn
    from distfn import distributed
    from distfn.tracking import MLflow, WandB, TensorBoard, CSV

    ckpt, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    track = eval(sys.argv[4])

    def sent_up_to(step, within=90):
        from mlflow import MlflowClient
        client = MlflowClient(tracking_uri=track.uri)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            experiment = client.get_experiment_by_name(track.experiment)
            for run in client.search_runs([experiment.experiment_id]) if experiment is not None else []:
                if max((m.step for m in client.get_metric_history(run.info.run_id, "loss")), default=0) >= step:
                    return
            time.sleep(0.2)

    @distributed(mode="ddp", nprocs=2, seed=0, max_restarts=1, track=track)
    def train(cfg, ctx):
        model = ctx.wrap(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        state = {"model": model, "optimizer": opt, "step": 0}
        start = ctx.resume(state, ckpt)
        for step in range(start + 1, steps + 1):
            loss = model(torch.randn(8, 4)).square().mean()
            ctx.backward(loss)
            ctx.step(opt)
            ctx.log_metrics({"loss": loss, "rank_sum": ctx.all_reduce(float(ctx.rank), op="sum")}, step=step)
            if step % 5 == 0 or step == steps:
                ctx.save({**state, "step": step}, f"{ckpt}/ckpt-{step}.safetensors")
            if step == kill_at and ctx.restart == 0 and ctx.rank == 0:
                sent_up_to(step)  # the tracking thread sent steps up to here: the restart must not resend them
                os.kill(os.getpid(), signal.SIGKILL)
        return ctx.restart

    if __name__ == "__main__":
        print("attempt", train({"lr": 0.01, "model": {"width": 4}, "tag": "t1"}))
''')


# -- an mlflow server of the test's own --------------------------------------------------------------------------
@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    pytest.importorskip("mlflow", reason="needs mlflow, from the 'mlflow' extra: pip install -e '.[mlflow]'")
    port = free_port()
    store = tmp_path / "mlflow-server"
    store.mkdir()
    log = (store / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--default-artifact-root", str(store / "art")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=clean_env())
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(store / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            pass
        # the server's job consumers (huey) may outlive it or ignore SIGTERM: the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def _mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def _history(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


@pytest.mark.slow
def test_mlflow_one_run_across_a_restart_and_a_resumed_rerun(tmp_path: Path, mlflow_server: str,
                                                             warnings_seen: Any) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = _env(tmp_path)
    track = f"MLflow(uri={mlflow_server!r}, experiment='distfn-test')"
    # killed (SIGKILL, rank 0) at step 13 of 20, restarted (max_restarts=1), resumed from ckpt-10
    out = _run(script, [str(tmp_path / "a"), "20", "13", track], env, tmp_path)
    assert "attempt 1" in out
    runs = _mlflow_runs(mlflow_server, "distfn-test")
    assert len(runs) == 1, [r.info for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.01" and run.data.params["model.width"] == "4" and run.data.params["tag"] == "t1"
    assert _history(mlflow_server, run.info.run_id, "loss") == list(range(1, 21))  # steps 11..13: not twice
    assert _history(mlflow_server, run.info.run_id, "rank_sum") == list(range(1, 21))
    assert all(m.value == 1.0 for m in _mlflow_client(mlflow_server).get_metric_history(run.info.run_id, "rank_sum"))
    assert run.data.tags["distfn.key"]

    # a new process that resumes the same checkpoints continues the same run (the key is in the checkpoint)
    _run(script, [str(tmp_path / "a"), "25", "0", track], env, tmp_path)
    runs = _mlflow_runs(mlflow_server, "distfn-test")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert _history(mlflow_server, run.info.run_id, "loss") == list(range(1, 26))

    # an unrelated job (its own checkpoint directory) gets a run of its own; under Slurm the job id is a tag
    _run(script, [str(tmp_path / "b"), "3", "0", track], {**env, "SLURM_JOB_ID": "4242"}, tmp_path)
    runs = _mlflow_runs(mlflow_server, "distfn-test")
    assert len(runs) == 2
    other = next(r for r in runs if r.info.run_id != run.info.run_id)
    assert other.data.tags["slurm_job_id"] == "4242" and other.data.tags["distfn.key"] == "slurm-4242"
    assert _history(mlflow_server, other.info.run_id, "loss") == [1, 2, 3]
    _mlflow_refused_names_are_dropped_and_a_refused_store_is_off(tmp_path, mlflow_server, warnings_seen)


def _mlflow_client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# -- W&B offline --------------------------------------------------------------------------------------------------
def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file (W&B's LevelDB-style log: 32 KiB blocks of crc/length/type records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0 and length == 0:
            continue
        parts += chunk
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _wandb_run(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": [], "config": {}, "summary": {}}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["name"] = record.run.run_id, record.run.display_name
        elif kind == "history":
            out["steps"].append(record.history.step.num)
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                   for u in record.summary.update})
    return out


WANDB_JOB = textwrap.dedent('''
    import sys
    import torch
    from distfn import distributed

    ckpt, stop = sys.argv[1], int(sys.argv[2])

    from distfn.tracking import WandB

    @distributed(mode="ddp", nprocs=2, track=WandB(run_name="gpt2-124M"))
    def train(cfg, ctx):
        state = {"w": torch.zeros(2), "step": 0}
        start = ctx.resume(state, ckpt)
        for step in range(start + 1, stop + 1):
            ctx.log_metrics({"loss": torch.tensor(1.0 / step)}, step=step)
        ctx.save({**state, "step": stop}, f"{ckpt}/ckpt-{stop}.safetensors")  # as a preempted job does
        return stop

    if __name__ == "__main__":
        print(train({"lr": 0.5}))
''')


@pytest.mark.slow
@requires("wandb", "wandb")
def test_wandb_offline_one_run_continued_by_a_resumed_rerun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(WANDB_JOB)
    env = _env(tmp_path, WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wb"), WANDB_SILENT="true")
    (tmp_path / "wb").mkdir()
    _run(script, [str(tmp_path / "ckpt"), "13"], env, tmp_path)  # stops at 13 with a checkpoint (preemption)
    _run(script, [str(tmp_path / "ckpt"), "20"], env, tmp_path)  # a new process resumes it
    files = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/*.wandb"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2, files
    first, second = (_wandb_run(f) for f in files)
    assert first["id"] == second["id"]  # one W&B run id (resume="allow"), continued
    assert first["name"] == second["name"] == "gpt2-124M"  # WandB(run_name=) labels it
    assert first["steps"] + second["steps"] == list(range(1, 21))
    assert first["config"]["lr"] == "0.5"
    assert second["summary"]["distfn_status"] == "FINISHED"


# -- TensorBoard + CSV, and what rank 1 does -----------------------------------------------------------------------
TB_CSV_JOB = textwrap.dedent('''
    import json, sys, threading
    import torch
    from distfn import distributed

    first, last, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    class Untouchable:
        """Fails whatever is asked of it: rank 1 must not even look at the values."""
        def __getattr__(self, name):
            raise AssertionError(f"rank 1 looked at a logged value ({name})")

    @distributed(mode="ddp", nprocs=2, track=["tensorboard", "csv"])
    def train(cfg, ctx):
        for step in range(first, last + 1):
            value = torch.tensor(float(step)) if ctx.rank == 0 else Untouchable()
            ctx.log_metrics({"loss": value}, step=step)
        ctx.log_params({"extra": {"depth": 3}})
        if ctx.rank == 1:
            seen = {"modules": sorted(m for m in ("tensorboard", "mlflow", "wandb", "torch.utils.tensorboard")
                                      if m in sys.modules),
                    "threads": sorted(t.name for t in threading.enumerate()),
                    "tracking": ctx.run.tracking is None}
            with open(out, "w") as f:
                json.dump(seen, f)
        return 0

    if __name__ == "__main__":
        train({"lr": 0.1, "layers": [1, 2], "fn": print})
''')


def _tb_steps(directory: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and any(v.tag == tag for v in event.summary.value):
                steps.append(event.step)
    return steps


@pytest.mark.slow
@requires("tensorboard", "tensorboard")
def test_tensorboard_and_csv_and_rank1_costs_nothing(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(TB_CSV_JOB)
    env = _env(tmp_path, **{KEY_ENV: "job-7"})  # DISTFN_TRACK_KEY: joining a run on purpose
    _run(script, ["1", "5", str(tmp_path / "rank1.json")], env, tmp_path)
    seen = json.loads((tmp_path / "rank1.json").read_text())
    assert seen["modules"] == [] and "distfn-tracking" not in seen["threads"] and seen["tracking"]
    run = tmp_path / "runs" / "job-7"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["job-7"]  # one run folder, rank 0's
    # a second attempt of the same job replays steps 3..5: not written twice
    _run(script, ["3", "8", str(tmp_path / "rank1.json")], env, tmp_path)
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,name,value,time"
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 9))
    assert [float(r.split(",")[2]) for r in rows[1:]] == [float(s) for s in range(1, 9)]
    params = json.loads((run / "params.json").read_text())
    assert params == {"lr": "0.1", "layers": "[1, 2]", "extra.depth": "3"}  # the cfg's function is left out
    assert json.loads((run / "run.json").read_text())["status"] == "FINISHED"
    assert _tb_steps(run, "loss") == list(range(1, 9))


# -- a bare install -------------------------------------------------------------------------------------------------
def test_missing_extra_is_a_config_error_naming_it(tmp_path: Path) -> None:
    code = textwrap.dedent('''
        import sys
        for name in ("mlflow", "wandb", "tensorboard"):
            sys.modules[name] = None  # as if not installed: importlib.util.find_spec answers None
        from distfn import ConfigError, distributed
        for name in ("mlflow", "wandb", "tensorboard"):
            try:
                distributed(track=["csv", name])(lambda cfg, ctx: None)
            except ConfigError as exc:
                print("ConfigError:", exc)
        distributed(track="csv")(lambda cfg, ctx: None)  # needs nothing
    ''')
    done = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    for line, extra in zip(lines, ("mlflow", "wandb", "tensorboard"), strict=True):
        assert f"pip install 'distfn[{extra}]'" in line and f"track={extra!r}" in line


def test_track_values_are_checked_at_decoration() -> None:
    assert make_options({}).track == ()
    if importlib.util.find_spec("tensorboard") is not None:
        assert [b.name for b in make_options({"track": ["csv", "tensorboard"]}).track] == ["csv", "tensorboard"]
    else:  # a bare install (CI's quick pass): the list is checked all the same, and names the missing extra
        with pytest.raises(ConfigError, match=r"distfn\[tensorboard\]"):
            make_options({"track": ["csv", "tensorboard"]})
    assert make_options({"track": CSV(root="x")}).track == (CSV(root="x"),)
    with pytest.raises(ConfigError, match="'mlfow' is not a tracking backend"):
        make_options({"track": "mlfow"})
    with pytest.raises(ConfigError, match="'csv' twice"):
        make_options({"track": ["csv", CSV(root="other")]})
    with pytest.raises(ConfigError, match="on_error='keep' is not valid"):
        CSV(on_error="keep")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend object"):
        make_options({"track": 3})
    assert MLflow(uri="http://x").uri == "http://x"


# -- the session alone: the key, floors, failures, status -----------------------------------------------------------
class FakeRun:
    def __init__(self, log: list[Any], fail: list[int], floor: int | None = None) -> None:
        self.log, self.fail, self.floor, self.ids = log, fail, floor, {"id": "fake"}

    def _maybe_fail(self) -> None:
        if self.fail and self.fail[0] > 0:
            self.fail[0] -= 1
            raise ConnectionError("server unreachable")

    def log_metrics(self, rows: Sequence[Any]) -> None:
        self._maybe_fail()
        self.log.extend(step for step, _ in rows)

    def log_params(self, params: Mapping[str, str]) -> None:
        self._maybe_fail()
        self.log.append(dict(params))

    def close(self, status: str) -> None:
        self.log.append(status)
        raise RuntimeError("a tracker crash at close")  # never reaches the caller


class FakeBackend:
    name = "fake"
    log_cfg = True

    def __init__(self, on_error: str = "buffer", fail: int = 0, floor: int | None = None) -> None:
        self.on_error, self.fail, self.floor, self.log, self.opened = on_error, [fail], floor, [], []

    def check(self) -> None:
        pass

    def open(self, run: RunInfo) -> FakeRun:
        self.opened.append(run)
        return FakeRun(self.log, self.fail, self.floor)


def _session(*backends: Any, env: Mapping[str, str] | None = None) -> Session:
    return Session(backends, {"lr": 1}, env or {KEY_ENV: "k1"}, flush_every=0.02)


def test_unreachable_backend_buffers_or_drops_and_warns_once(warnings_seen: Any) -> None:
    buffering, dropping = FakeBackend("buffer", fail=3), FakeBackend("drop", fail=3)
    session = _session(buffering, dropping)
    for step in range(1, 6):
        session.log_metrics({"loss": step}, step=step)
        time.sleep(0.03)
    session.close("FINISHED")
    assert [x for x in buffering.log if isinstance(x, int)] == [1, 2, 3, 4, 5]  # kept and sent once it answered
    assert {"lr": "1"} in buffering.log and buffering.log[-1] == "FINISHED"
    assert 0 < len([x for x in dropping.log if isinstance(x, int)]) < 5  # what failed is gone
    assert dropping.log[-1] == "FINISHED"
    assert len(buffering.opened) == 1  # the run is opened once, at the first call
    unreachable = [m for m in warnings_seen if "could not send" in m]
    assert len(unreachable) == 2 and "server unreachable" in unreachable[0]  # one per backend, not per try
    assert "on_error='buffer'" in unreachable[0] and "on_error='drop'" in unreachable[1]


def test_rows_at_or_below_the_floor_are_replays_and_steps_never_go_back() -> None:
    backend = FakeBackend(floor=3)
    session = _session(backend)
    for step in (2, 3, 4, 5, 4, 6):  # 2, 3: replays of an earlier attempt; the second 4 goes back
        session.log_metrics({"loss": 1.0}, step=step)
    session.log_metrics({"loss": 1.0})  # step=None: one more than the last
    session.close("FAILED")
    assert [x for x in backend.log if isinstance(x, int)] == [4, 5, 6, 7]
    assert backend.log[-1] == "FAILED"


def test_the_checkpoint_record_continues_the_run_and_its_floor() -> None:
    first = _session(FakeBackend())
    first.log_metrics({"loss": 1.0}, step=10)
    stamped = first.stamp({"user": 1})
    assert stamped is not None and stamped["user"] == 1 and key_in(stamped) == ("k1", 10)
    first.close("KILLED")
    backend = FakeBackend()  # cannot tell its floor: the record's step is used
    second = _session(backend, env={KEY_ENV: "other"})
    second.adopt(json.loads(json.dumps(stamped)))  # through JSON, as the checkpoint header stores it
    second.log_metrics({"loss": 1.0}, step=10)
    second.log_metrics({"loss": 1.0}, step=11)
    second.close("FINISHED")
    assert backend.opened[0].key == "k1"
    assert [x for x in backend.log if isinstance(x, int)] == [11]
    assert RECORD_KEY == "distfn.tracking"


def test_other_ranks_have_no_session_and_rank0_checks_values() -> None:
    assert open_session((FakeBackend(),), None, rank=1) is None
    session = _session(FakeBackend())
    with pytest.raises(TypeError, match="'loss' is a tensor of shape"):
        import torch

        session.log_metrics({"loss": torch.ones(3)}, step=1)
    with pytest.raises(TypeError, match="'name' is str"):
        session.log_metrics({"name": "x"}, step=1)
    assert not session.started  # nothing opened by a refused call
    assert not any(t.name == "distfn-tracking" for t in threading.enumerate())


def test_job_key_rule_and_export() -> None:
    assert job_key({KEY_ENV: "my job/1"}) == "my-job-1"
    assert job_key({"SLURM_JOB_ID": "77"}) == "slurm-77"
    assert job_key({"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-70_3"
    assert job_key({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    assert job_key({"TORCHELASTIC_RUN_ID": "none"}) != job_key({"TORCHELASTIC_RUN_ID": "none"})  # fresh each
    env: dict[str, str] = {}
    with exported(env) as key:
        assert env[KEY_ENV] == key
    assert env == {}  # the next job of this process gets a key of its own


def test_status_and_flatten() -> None:
    from distfn.errors import Terminated

    assert status_of(None, stopped=False) == "FINISHED"
    assert status_of(None, stopped=True) == "KILLED"
    assert status_of(ValueError(), stopped=False) == "FAILED"
    assert status_of(Terminated("SIGTERM"), stopped=False) == "KILLED"
    assert status_of(KeyboardInterrupt(), stopped=False) == "KILLED"
    import argparse
    import dataclasses

    @dataclasses.dataclass
    class Optim:
        lr: float = 0.1
        betas: tuple[float, float] = (0.9, 0.99)

    cfg = {"optim": Optim(), "args": argparse.Namespace(seed=3, out=None), "fn": len, "_private": 1, "n": 2.5}
    assert flatten(cfg) == {"optim.lr": "0.1", "optim.betas": "[0.9, 0.99]", "args.seed": "3", "args.out": "null",
                            "n": "2.5"}
    assert flatten(None) == {} and flatten(3) == {"cfg": "3"}


@pytest.mark.slow
def test_a_tracker_crash_never_hides_the_jobs_failure(tmp_path: Path) -> None:
    code = textwrap.dedent('''
        from distfn import distributed
        from distfn.tracking import CSV

        class Broken:
            name, on_error, log_cfg = "broken", "buffer", True
            def check(self): pass
            def open(self, run): raise RuntimeError("tracker exploded")

        @distributed(mode="ddp", nprocs=2, track=[Broken(), CSV(root="runs")], max_restarts=0)
        def train(cfg, ctx):
            ctx.log_metrics({"loss": 1.0}, step=1)
            ctx.barrier()
            raise ValueError("the job's own failure")

        if __name__ == "__main__":
            try:
                train()
            except Exception as exc:
                print("RAISED", type(exc).__name__, "own" if "the job's own failure" in str(exc) else "other")
    ''')
    script = tmp_path / "job.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], env=_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert "RAISED WorkerError own" in done.stdout, done.stderr[-4000:]
    assert "tracker exploded" in done.stderr  # the backend's failure is a warning, not the job's error
    (run,) = (tmp_path / "runs").iterdir()  # the other backend went on, and its run ended FAILED
    assert json.loads((run / "run.json").read_text())["status"] == "FAILED"
    assert (run / "metrics.csv").read_text().splitlines()[1].startswith("1,loss,1.0,")


@pytest.mark.slow
@requires("mlflow", "mlflow")
def test_an_unreachable_mlflow_server_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    code = textwrap.dedent(f'''
        from distfn import distributed
        from distfn.tracking import MLflow

        @distributed(mode="ddp", nprocs=2, track=MLflow(uri="http://127.0.0.1:{port}", on_error="drop"))
        def train(cfg, ctx):
            for step in range(1, 31):
                ctx.log_metrics({{"loss": 1.0 / step}}, step=step)
                ctx.barrier()
            return "trained"

        if __name__ == "__main__":
            print(train({{"lr": 0.1}}))
    ''')
    script = tmp_path / "job.py"
    script.write_text(code)
    env = _env(tmp_path, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="2")
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-4000:]
    assert done.stderr.count("tracking: mlflow could not") == 1, done.stderr[-4000:]  # one warning, not per try
    assert "on_error='drop'" in done.stderr


def test_values_and_steps_keep_their_rules_on_the_fast_path(tmp_path: Path) -> None:
    """log_metrics tests exact float / int values and an exact int step before the ``numbers`` ABCs (which cost
    more than the rest of a call): every other kind of value and step is still accepted or refused as before."""
    import numpy as np
    import torch

    session = Session((CSV(root=str(tmp_path)),), {}, {KEY_ENV: "fast"}, flush_every=0.02)
    loss = torch.tensor(0.25, requires_grad=True) * 2  # autograd history: item() reads it without detach()
    session.log_metrics({"f": 0.1, "i": 3, "b": True, "t": loss, "ti": torch.tensor([7]), "np": np.float32(0.5),
                         "nan": float("nan"), "inf": -math.inf, 5: 1.0}, step=np.int64(2))
    session.log_metrics({"f": 0.2}, step=3)
    for bad in (True, -1, 2.0, "4"):
        with pytest.raises(TypeError, match="step is a non-negative int"):
            session.log_metrics({"f": 0.3}, step=bad)
    session.close("FINISHED")
    lines = (tmp_path / "fast" / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,name,value,time"
    rows = [line.split(",") for line in lines[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("2", "f", "0.1"), ("2", "i", "3.0"), ("2", "b", "1.0"), ("2", "t", "0.5"), ("2", "ti", "7.0"),
        ("2", "np", "0.5"), ("2", "nan", "nan"), ("2", "inf", "-inf"), ("2", "5", "1.0"), ("3", "f", "0.2")]
    assert all(float(r[3]) > 0 for r in rows)  # the wall time of the flush that wrote the row


def test_replays_below_the_floor_are_counted_and_logged_once(tmp_path: Path, warnings_seen: Any) -> None:
    """_send filters a flush's rows against the floor in one pass: every replayed row is counted, none is sent."""
    backend = FakeBackend(floor=4)
    session = Session((backend,), {}, {KEY_ENV: "k1"}, flush_every=60.0)  # one flush, at close
    for step in range(1, 8):
        session.log_metrics({"loss": 1.0}, step=step)
    session.close("FINISHED")
    assert [x for x in backend.log if isinstance(x, int)] == [5, 6, 7]
    assert session._channels[0].replays == 4


# -- issue 41: untrusted keys, floors and names; backends that fail; what ctx.save sends -------------------------
def test_a_run_key_read_from_a_checkpoint_is_one_path_component(tmp_path: Path, warnings_seen: Any) -> None:
    """Item 7: a stored key of ``../../x`` or an absolute path is refused (the job logs to a run of its own,
    inside the root); a key from the environment is made safe; the backends refuse a bad key themselves too."""
    from distfn.tracking.base import run_directory
    from distfn.tracking.key import BadRecord, is_key

    for bad in ("../../x", "/tmp/x", "..", ".", ".hidden", "a/b", "a\\b", "", " x", "x" * 129, 3, None, ["k"]):
        with pytest.raises(BadRecord, match="is not a valid key"):
            key_in({RECORD_KEY: {"key": bad, "step": 3}})
    assert key_in({RECORD_KEY: {"key": "20261202-013005-3fa9c1", "step": 2**63}}) == ("20261202-013005-3fa9c1", None)
    assert key_in({"other": 1}) is None and key_in({RECORD_KEY: None}) is None
    for given in ("..", "../../x", "/abs/path", ".", "-", "x" * 1000, "é/ü"):
        key = job_key({KEY_ENV: given})
        assert is_key(key) and (tmp_path / key).resolve().parent == tmp_path.resolve(), (given, key)
    for bad in ("..", "../x", "/x", ""):
        with pytest.raises(ValueError, match="not one plain path component"):
            run_directory(str(tmp_path), bad)

    root = tmp_path / "deep" / "runs"
    session = Session((CSV(root=str(root)),), {}, {KEY_ENV: "own"}, flush_every=0.02)
    session.adopt({RECORD_KEY: {"key": "../../escape", "step": 3}})
    session.log_metrics({"loss": 1.0}, step=1)
    session.close("FINISHED")
    assert sorted(p.name for p in root.iterdir()) == ["own"] and not (tmp_path / "escape").exists()
    assert not (tmp_path / "deep" / "escape").exists()
    assert [m for m in warnings_seen if "tracking record is not used" in m and "'../../escape'" in m]


class _Bad(FakeBackend):
    """A backend whose run's ``floor`` and/or ``ids`` raise (item 9)."""

    def __init__(self, floor_raises: bool, ids_raise: bool) -> None:
        super().__init__()
        self.floor_raises, self.ids_raise = floor_raises, ids_raise

    def open(self, run: RunInfo) -> FakeRun:
        outer = self

        class Run(FakeRun):
            @property  # type: ignore[misc]
            def floor(self) -> int | None:
                if outer.floor_raises:
                    raise RuntimeError("floor exploded")
                return None

            @floor.setter
            def floor(self, value: Any) -> None:
                pass

            @property  # type: ignore[misc]
            def ids(self) -> Mapping[str, str]:
                if outer.ids_raise:
                    raise RuntimeError("ids exploded")
                return {"id": "fine"}

            @ids.setter
            def ids(self, value: Any) -> None:
                pass

        self.opened.append(run)
        return Run(self.log, self.fail)


def test_a_backend_whose_floor_or_ids_raise_never_stops_tracking_or_the_save(warnings_seen: Any) -> None:
    """Item 9: ``floor`` raising used to kill the tracking thread (nothing more sent, by any backend); ``ids``
    raising made ``stamp`` (ctx.save) raise. Now: one warning each, the rows arrive, the record is written."""
    floor_bad, ids_bad, good = _Bad(True, False), _Bad(False, True), FakeBackend()
    good.name = "good"  # type: ignore[misc]
    floor_bad.name, ids_bad.name = "floorbad", "idsbad"  # type: ignore[misc]
    session = _session(floor_bad, ids_bad, good)
    session.adopt({RECORD_KEY: {"key": "k1", "step": 2}})  # the record's floor applies to the one that cannot tell
    for step in range(1, 6):
        session.log_metrics({"loss": 1.0}, step=step)
    stamped = session.stamp({})  # ctx.save's part: never raises
    assert stamped is not None and stamped[RECORD_KEY]["runs"] == {"floorbad": {"id": "fine"}, "good": {"id": "fake"}}
    session.log_metrics({"loss": 1.0}, step=6)
    session.close("FINISHED")
    for backend in (floor_bad, ids_bad, good):
        assert [x for x in backend.log if isinstance(x, int)] == [3, 4, 5, 6], backend.name
    assert len([m for m in warnings_seen if "floor exploded" in m]) == 1
    assert len([m for m in warnings_seen if "ids exploded" in m]) == 1


def _csv_rows(rows: Sequence[tuple[int, str]]) -> bytes:
    import csv as csv_module
    import io

    from distfn.tracking.csv_backend import HEADER

    buffer = io.StringIO(newline="")
    writer = csv_module.writer(buffer)
    writer.writerow(HEADER)
    writer.writerows((step, name, 1.0, 2.0) for step, name in rows)
    return buffer.getvalue().encode()


def test_the_csv_floor_is_read_by_csv_rules_and_a_half_row_is_cut(tmp_path: Path) -> None:
    """Item 10: a name holding ``"\\n999,x"`` made the floor 999 (every later step dropped); a name over 4 KiB hid
    the floor (steps logged twice). The floor is the last whole row's step; a half row a killed write left is cut
    off before appending (appended to, it swallowed the next row)."""
    from distfn.tracking.csv_backend import scan

    path = tmp_path / "m.csv"
    for rows, floor in (([(1, "a"), (2, "\n999,x")], 2), ([(1, "a"), (2, "x" * 5000)], 2),
                        ([(1, "a"), (7, 'q"\n"' * 40_000 + "\n")], 7), ([], None), ([(1, "²"), (2, "\r\n")], 2)):
        path.write_bytes(_csv_rows(rows))
        assert scan(path) == (floor, path.stat().st_size), rows
    whole = _csv_rows([(1, "a"), (2, "b")])
    path.write_bytes(whole + b'3,"cut\n4,')  # killed inside a quoted name
    assert scan(path) == (2, len(whole))
    path.write_bytes(whole.replace(b"2,b", b"\xb2,b") + b"99999999999999999999999,x,1,2\r\n")  # not steps
    assert scan(path)[0] == 1

    # through the backend: continued twice, the name with a newline first, a half row between the attempts
    env = {KEY_ENV: "job"}
    first = Session((CSV(root=str(tmp_path)),), {}, env, flush_every=0.02)
    for step in (1, 2):
        first.log_metrics({"\n999,x": 1.0, "a" * 5000: 2.0, "\udc80": 3.0}, step=step)  # a lone surrogate too
    first.close("KILLED")
    metrics = tmp_path / "job" / "metrics.csv"
    with metrics.open("ab") as f:
        f.write(b'3,"half')
    second = Session((CSV(root=str(tmp_path)),), {}, env, flush_every=0.02)
    for step in (2, 3, 4):
        second.log_metrics({"loss": 1.0}, step=step)
    second.close("FINISHED")
    import csv as csv_module

    with metrics.open(newline="", encoding="utf-8") as f:
        rows = list(csv_module.reader(f))
    assert rows[0] == ["step", "name", "value", "time"]
    assert [(int(r[0]), r[1][:6]) for r in rows[1:]] == [
        (1, "\n999,x"), (1, "aaaaaa"), (1, "\\udc80"), (2, "\n999,x"), (2, "aaaaaa"), (2, "\\udc80"),
        (3, "loss"), (4, "loss")]


def test_arguments_are_checked_with_errors_naming_them(tmp_path: Path) -> None:
    """Item 11: the class instead of an object, a non-bool log_cfg, a non-path root, a metrics value that is no
    mapping: errors naming the argument (they were bare TypeError / AttributeError from inside distfn)."""
    from distfn.tracking import TensorBoard, WandB

    with pytest.raises(ConfigError, match=r"got the class CSV.*pass CSV\(\)"):
        make_options({"track": CSV})
    with pytest.raises(ConfigError, match=r"got the class MLflow"):
        make_options({"track": ["csv", MLflow]})
    with pytest.raises(ConfigError, match=r"CSV\(log_cfg='yes'\): this is True or False"):
        CSV(log_cfg="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"root=3 is not a directory"):
        CSV(root=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"root=None is not a directory"):
        TensorBoard(root=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"MLflow\(uri=5000\)"):
        MLflow(uri=5000)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"WandB\(project=\['p'\]\)"):
        WandB(project=["p"])  # type: ignore[arg-type]
    assert CSV(root=tmp_path).root == str(tmp_path) and WandB(dir=tmp_path).dir == str(tmp_path)

    class Odd(FakeBackend):
        pass

    for attribute, value, message in (("on_error", "keep", "on_error='keep' is not valid"),
                                      ("log_cfg", "yes", "its log_cfg is 'yes'"), ("name", "", "its name is ''")):
        odd = Odd()
        setattr(odd, attribute, value)
        with pytest.raises(ConfigError, match=message):
            make_options({"track": odd})

    session = _session(FakeBackend())
    for bad in (0.5, [("loss", 1.0)], None, "loss"):
        with pytest.raises(TypeError, match=r"ctx.log_metrics\(metrics\): metrics is a mapping"):
            session.log_metrics(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ctx.log_params\(params\): params is a mapping"):
        session.log_params(0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="too large for a float"):
        session.log_metrics({"n": 10**400}, step=1)
    assert not session.started


class _Off(FakeBackend):
    def open(self, run: RunInfo) -> FakeRun:
        raise ConfigError("the tracking URI 'file:/x' cannot be used")


def test_a_backend_that_can_never_open_is_off_at_once_and_counts_its_rows(warnings_seen: Any) -> None:
    """Item 12: settings that can never work (a ConfigError from open) are said once, at the first log call, not
    after the end; the backend is not retried, and the end counts the rows it did not record (no "kept")."""
    off, drop = _Off(), FakeBackend("drop", fail=1000)
    drop.name = "down"  # type: ignore[misc]
    session = _session(off, drop)
    session.log_metrics({"loss": 1.0, "acc": 0.5}, step=1)
    deadline = time.monotonic() + 10
    while not [m for m in warnings_seen if "fake is off for this run" in m] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [m for m in warnings_seen if "fake is off for this run" in m and "file:/x" in m]  # before the end
    for step in range(2, 6):
        session.log_metrics({"loss": 1.0}, step=step)
    session.close("FINISHED")
    assert len([m for m in warnings_seen if "fake is off" in m]) == 1
    assert [m for m in warnings_seen if "fake did not record 5 row(s)" in m and "it was off" in m]
    assert [m for m in warnings_seen if "down did not record 5 row(s)" in m and "ConnectionError" in m]
    assert not [m for m in warnings_seen if "fake could not" in m or ("kept" in m and "fake" in m)]


def _mlflow_refused_names_are_dropped_and_a_refused_store_is_off(tmp_path: Path, mlflow_server: str,
                                                                  warnings_seen: Any) -> None:
    """Items 8 and 12 against a real server (the server of the test above: a start costs 10-40 s): ``acc,top1``
    made the server refuse the whole batch, retried for ever (no metric arrived); MLflow 3 refusing a plain
    ``file:`` store is one "off" warning at once."""
    from distfn.tracking.mlflow_backend import valid_name

    assert valid_name("train/acc top-1:x.y") and not valid_name("acc,top1") and not valid_name("a/../b")
    assert not valid_name("x" * 251) and not valid_name("") and not valid_name("/abs") and not valid_name("acc\n")
    env = {KEY_ENV: "names", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    session = Session((MLflow(uri=mlflow_server, experiment="names"),), {"a,b": 1, "lr": 0.1}, env,
                      flush_every=0.05)
    for step in (1, 2, 3):
        session.log_metrics({"acc,top1": 0.5, "loss": 1.0 / step, "x" * 300: 1.0}, step=step)
    session.close("FINISHED")
    (run,) = _mlflow_runs(mlflow_server, "names")
    assert _history(mlflow_server, run.info.run_id, "loss") == [1, 2, 3] and set(run.data.metrics) == {"loss"}
    assert run.data.params == {"lr": "0.1"}
    refused = [m for m in warnings_seen if "MLflow refuses" in m]
    assert len(refused) == 3 and any("'acc,top1'" in m for m in refused) and any("'a,b'" in m for m in refused)
    assert not [m for m in warnings_seen if "could not send" in m]

    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    store = Session((MLflow(uri=f"file:{tmp_path / 'mlruns'}"),), {}, {KEY_ENV: "file"}, flush_every=0.05)
    for step in (1, 2):
        store.log_metrics({"loss": 1.0}, step=step)
    store.close("FINISHED")
    assert [m for m in warnings_seen if "mlflow is off for this run" in m and "cannot use the tracking URI" in m]
    assert [m for m in warnings_seen if "mlflow did not record 2 row(s)" in m]


# A 2-rank job whose rank 1 dies (SIGKILL) at step 12 of attempt 0 (max_restarts=1, resumed from ckpt-10),
# tracked by a backend that opens as slowly as MLflow's first import and one whose floor raises; both name their
# runs badly (ids raises). argv: ckpt_dir out_dir.
KILLED_JOB = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch
    from distfn import distributed

    ckpt, out = sys.argv[1], sys.argv[2]

    class FileRun:
        def __init__(self, path, floor_raises):
            self.path, self.floor_raises = path, floor_raises

        @property
        def floor(self):
            if self.floor_raises:
                raise RuntimeError("floor exploded")
            steps = [json.loads(line)[0] for line in open(self.path)] if os.path.exists(self.path) else []
            return max(steps, default=None)

        @property
        def ids(self):
            raise RuntimeError("ids exploded")

        def log_metrics(self, rows):
            with open(self.path, "a") as f:
                f.writelines(json.dumps([step, values]) + "\\n" for step, values in rows)

        def log_params(self, params):
            pass

        def close(self, status):
            pass

    class Slow:
        on_error, log_cfg = "buffer", False

        def __init__(self, name, floor_raises, delay):
            self.name, self.floor_raises, self.delay = name, floor_raises, delay

        def check(self):
            pass

        def open(self, run):
            time.sleep(self.delay)  # as long as importing mlflow
            return FileRun(os.path.join(out, self.name + ".jsonl"), self.floor_raises)

    track = [Slow("slow", False, 2.5), Slow("nofloor", True, 0)]

    @distributed(mode="ddp", nprocs=2, seed=0, max_restarts=1, track=track)
    def train(cfg, ctx):
        state = {"w": torch.zeros(2), "step": 0}
        start = ctx.resume(state, ckpt)
        for step in range(start + 1, 21):
            ctx.log_metrics({"loss": 1.0 / step, "ranks": ctx.all_reduce(1.0, op="sum")}, step=step)
            if step % 5 == 0:
                ctx.save({**state, "step": step}, f"{ckpt}/ckpt-{step}.safetensors")
            if step == 12 and ctx.restart == 0 and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        return ctx.restart

    if __name__ == "__main__":
        print("attempt", train({}))
''')


@pytest.mark.slow
def test_rows_logged_before_a_checkpoint_survive_a_killed_rank(tmp_path: Path) -> None:
    """Item 13: rank 1 SIGKILLed at step 12, the job restarted and resumed from ckpt-10: the run used to hold
    steps 11-20 only (the slow open had not finished when the launcher stopped rank 0). ctx.save now sends the
    rows logged before it; and a floor / ids that raise (item 9) stop neither the tracking nor the save."""
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB)
    (tmp_path / "out").mkdir()
    out = _run(script, [str(tmp_path / "ckpt"), str(tmp_path / "out")], _env(tmp_path), tmp_path)
    assert "attempt 1" in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "slow.jsonl").read_text().splitlines()]
    assert [step for step, _ in rows] == list(range(1, 21))  # each step once, none lost
    assert all(values["ranks"] == 2.0 for _, values in rows)  # both ranks reached every logged step
    steps = [json.loads(line)[0] for line in (tmp_path / "out" / "nofloor.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, 21))  # the floor from the record (10): 11-12 may come twice
    assert "floor exploded" in out and "ids exploded" in out and "Exception in thread" not in out


# -- property tests (issue 41 B): what tracking reads back from files and checkpoints, and what users hand it -----
def _hypothesis() -> Any:
    return pytest.importorskip("hypothesis", reason="needs hypothesis, from the 'test' extra: pip install -e '.[test]'")


#: Names that attack the CSV floor reader: a newline and a step inside quotes, quotes, CR, a lone surrogate (an
#: encoding attack), longer than the first tail read (64 KiB) and than csv's field limit (128 KiB).
_HOSTILE_NAMES = ["\n999,x", '"', '""\n"', "\r\n", ",", "\udc80", "x" * 5000, "y\n" * 40_000, "z" * 140_000, ""]


def test_property_the_csv_floor_of_rows_cut_anywhere(tmp_path: Path) -> None:
    """Rows with any names, the file cut at any byte (a killed write): `scan` finds the last whole row's step and
    where it ends, and a continued run starts right there (the cut-short row removed)."""
    _hypothesis()
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from distfn.tracking.csv_backend import CsvRun, scan

    names = st.one_of(st.text(max_size=40), st.sampled_from(_HOSTILE_NAMES))
    count = iter(range(10**6))

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 2**63 - 1), names), max_size=6), st.floats(0, 1))
    def prop(rows: list[tuple[int, str]], where: float) -> None:
        directory = tmp_path / str(next(count))
        info = RunInfo(key="k", name="k")
        run = CsvRun(directory, info)
        ends = [run.path.stat().st_size]  # the header's end
        steps = sorted(step for step, _ in rows)
        for step, (_, name) in zip(steps, rows, strict=True):
            run.log_metrics([(step, {name: 1.0})])
            ends.append(run.path.stat().st_size)
        run.close("KILLED")
        cut = round(where * ends[-1])
        os.truncate(run.path, cut)
        whole = [i for i, end in enumerate(ends) if end <= cut]
        floor = steps[whole[-1] - 1] if whole and whole[-1] > 0 else None
        assert scan(run.path) == (floor, ends[whole[-1]] if whole else 0)
        again = CsvRun(directory, info)
        assert again.floor == floor and again.path.stat().st_size == (ends[whole[-1]] if whole else ends[0])
        again.close("FINISHED")

    prop()


def test_property_the_csv_floor_of_any_bytes(tmp_path: Path) -> None:
    """Whatever bytes ``metrics.csv`` holds, `scan` answers ``(step or None, end)`` within the file, and quickly:
    no exception, no step that is not one."""
    _hypothesis()
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from distfn.tracking.csv_backend import scan

    pieces = st.sampled_from([b'"', b"\n", b"\r\n", b",", b"1", b"9" * 25, b"1,a,1.0,2\r\n", b"\xff\xfe", b"\x00",
                              "²".encode(), b"nan", b" "])
    path = tmp_path / "metrics.csv"

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.one_of(pieces, st.binary(max_size=16)), max_size=40).map(b"".join))
    def prop(data: bytes) -> None:
        path.write_bytes(data)
        started = time.monotonic()
        floor, end = scan(path)
        assert time.monotonic() - started < 2
        assert 0 <= end <= len(data) and (end == 0 or data[end - 1:end] == b"\n")
        assert floor is None or (type(floor) is int and 0 <= floor < 2**63)

    prop()


def test_property_run_keys_from_the_environment_and_checkpoints(tmp_path: Path) -> None:
    """Any key text (``DISTFN_TRACK_KEY``) becomes a key that is one path component under the root; any metadata
    read back from a checkpoint gives ``None``, a valid ``(key, step)``, or `BadRecord`, and `Session.adopt`
    never raises (the job goes on with its own key)."""
    _hypothesis()
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from distfn.tracking.key import BadRecord, is_key

    root = tmp_path.resolve()
    json_values = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                  st.sampled_from(["../../x", "/etc", "..", "ok-key", "a" * 200, "k\x00", "\udc80"])),
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
        max_leaves=12)
    records = st.one_of(json_values, st.fixed_dictionaries({"key": json_values, "step": json_values}))

    @settings(max_examples=200, deadline=None)
    @given(st.text(), records)
    def prop(given_key: str, entry: Any) -> None:
        key = job_key({KEY_ENV: given_key})
        assert is_key(key) and (root / key).resolve().parent == root
        try:
            found = key_in({RECORD_KEY: entry})
        except BadRecord:
            found = None
        if found is not None:
            assert is_key(found[0]) and (found[1] is None or 0 <= found[1] < 2**63)
        session = Session((FakeBackend(),), {}, {KEY_ENV: "own"})
        session.adopt({RECORD_KEY: entry})
        assert is_key(session.key)

    prop()
    deep: Any = "k"
    for _ in range(100_000):  # a record nested 100,000 deep is looked at one level only
        deep = {"key": deep}
    with pytest.raises(BadRecord):
        key_in({RECORD_KEY: deep})


def test_property_metric_names_and_values(tmp_path: Path) -> None:
    """Any metric name and value: ``log_metrics`` queues the row or raises `TypeError` (never another error);
    a name `valid_name` accepts is one MLflow accepts (checked with MLflow's own rule when it is installed)."""
    _hypothesis()
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from distfn.tracking.mlflow_backend import valid_name

    mlflow_check: Any = None
    if importlib.util.find_spec("mlflow") is not None:
        from mlflow.utils.validation import _validate_metric_name

        mlflow_check = _validate_metric_name
    values = st.one_of(st.floats(), st.integers(min_value=-(10**400), max_value=10**400), st.booleans(), st.none(),
                       st.text(max_size=5), st.lists(st.floats(), max_size=2), st.binary(max_size=3))
    session = Session((FakeBackend(),), {}, {KEY_ENV: "names"}, flush_every=60.0)

    @settings(max_examples=200, deadline=None)
    @given(st.dictionaries(st.one_of(st.text(max_size=300), st.sampled_from(_HOSTILE_NAMES[:6])), values,
                           max_size=4), st.text(max_size=260))
    def prop(metrics: dict[str, Any], name: str) -> None:
        try:
            session.log_metrics(metrics)
        except TypeError as exc:
            assert "ctx.log_metrics" in str(exc)
        if valid_name(name) and mlflow_check is not None:
            mlflow_check(name)  # raises when MLflow refuses it

    prop()
    session.close("FINISHED")


@requires("tensorboard", "tensorboard")
def test_property_the_tensorboard_floor_of_any_event_file(tmp_path: Path) -> None:
    """An event file read back when a run continues: a record claiming 64 GiB is not read (it was a MemoryError
    inside tensorboard's reader, a smaller claim a huge allocation); a cut or corrupted file gives the steps before
    the damage; any bytes give a step or ``None``, quickly."""
    _hypothesis()
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from torch.utils.tensorboard import SummaryWriter

    from distfn.tracking.tensorboard_backend import _last_step

    writer = SummaryWriter(log_dir=str(tmp_path / "ok"))
    for step in range(30):
        writer.add_scalar("x", 1.0, step)
    writer.close()
    (events,) = (tmp_path / "ok").glob("events.out.tfevents.*")
    whole = events.read_bytes()
    assert _last_step(tmp_path / "ok") == 29
    events.write_bytes(whole[:-5])
    assert _last_step(tmp_path / "ok") == 28
    claim = struct.pack("<Q", 2**36)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "events.out.tfevents.1.x").write_bytes(claim + struct.pack("<I", masked_crc32c(claim)) + b"abc")
    os.mkfifo(hostile / "events.out.tfevents.2.fifo")  # never opened (it would block)
    assert _last_step(hostile) is None

    fuzz = tmp_path / "fuzz"
    fuzz.mkdir()
    path = fuzz / "events.out.tfevents.3.x"

    @settings(max_examples=100, deadline=None)
    @given(st.binary(max_size=300), st.integers(0, len(whole)), st.integers(0, len(whole)))
    def prop(noise: bytes, at: int, cut: int) -> None:
        path.write_bytes((whole[:at] + noise + whole[at:])[:max(cut, 12)])
        started = time.monotonic()
        found = _last_step(fuzz)
        assert time.monotonic() - started < 2
        assert found is None or 0 <= found <= 29

    prop()


def test_damaged_run_files_and_refused_parameters_never_hold_the_metrics_back(tmp_path: Path,
                                                                             warnings_seen: Any) -> None:
    """A continued CSV run reads ``params.json`` back: nested 100,000 deep (RecursionError), or not JSON, made
    every send of parameters fail, and the rows waited behind them for ever. A damaged file is replaced (one
    warning); a backend that refuses parameters still gets its rows; a planted symlink is not written through."""
    run = tmp_path / "job"
    run.mkdir()
    (run / "params.json").write_text("[" * 100_000 + "]" * 100_000)
    (run / "run.json").write_text("{not json")
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (run / ".params.json.tmp").symlink_to(outside)
    session = Session((CSV(root=str(tmp_path)),), {"lr": 0.1}, {KEY_ENV: "job"}, flush_every=0.02)
    session.log_metrics({"loss": 1.0}, step=1)
    session.close("FINISHED")
    assert json.loads((run / "params.json").read_text()) == {"lr": "0.1"}
    assert json.loads((run / "run.json").read_text())["status"] == "FINISHED" and outside.read_text() == "keep"
    assert (run / "metrics.csv").read_text().splitlines()[1].startswith("1,loss,1.0,")
    assert [m for m in warnings_seen if "cannot be read back" in m and "RecursionError" in m]

    class NoParams(FakeRun):
        def log_params(self, params: Mapping[str, str]) -> None:
            raise ValueError("parameter refused")

    class Backend(FakeBackend):
        def open(self, run: RunInfo) -> FakeRun:
            return NoParams(self.log, self.fail)

    backend = Backend()
    session = _session(backend)
    for step in (1, 2):
        session.log_metrics({"loss": 1.0}, step=step)
    session.close("FINISHED")
    assert [x for x in backend.log if isinstance(x, int)] == [1, 2]
    assert len([m for m in warnings_seen if "fake could not send its parameters" in m]) == 1


def test_wandb_takes_a_run_name_and_keeps_the_key_as_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """``WandB(run_name=)`` reaches ``wandb.init(name=)``; the id (what every attempt continues) stays the key. A
    stand-in ``wandb`` module records the call, so this needs neither the extra nor W&B's service process."""
    import types

    from distfn.tracking import WandB
    from distfn.tracking.base import RunInfo

    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return types.SimpleNamespace(resumed=False, step=0, id=kwargs["id"], project=kwargs["project"])

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=lambda **kw: kw))
    info = RunInfo(key="job-1a2b", name="job-1a2b")
    WandB(run_name="gpt2-124M").open(info)
    WandB().open(info)
    assert [(c["name"], c["id"]) for c in calls] == [("gpt2-124M", "job-1a2b"), ("job-1a2b", "job-1a2b")]
    with pytest.raises(ConfigError, match=r"WandB\(run_name=3\)"):
        WandB(run_name=3)  # type: ignore[arg-type]
