"""Hang reports under every launcher (issue 26): the cross-rank report over the process group's store
(`distfn.hangs`), the ledger's one-line disagreement (`distfn.ledger`), the start-up fingerprint
(`distfn.fingerprint`), and the NCCL deadline (CUDA faked).

The end-to-end cases run tests/scripts/hang_job.py: rank 1 sleeps in user code while rank 0 waits at a barrier
with ``timeout=10``; the report must name rank 1 and its line, come once, within timeout + 15 s of the barrier,
and leave no process behind. Real ``srun -N2`` / ``mpirun -np 2``: tests/cluster/test_hangs_cluster.py.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from distfn import failures, hangs
from distfn.ledger import Entry, Ledger, RankState, disagreement

from conftest import clean_env, free_port

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "scripts" / "hang_job.py"
TIMEOUT = 10.0
SLEEP_LINE = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "HANG-SLEEP-LINE" in line)


# -- the ledger ---------------------------------------------------------------------------------------------------
def test_the_ledger_records_number_name_and_call_site_and_stays_inside_a_failed_collective() -> None:
    book = Ledger()
    with book.entered("barrier"):
        assert book.state(0).inside
    with pytest.raises(RuntimeError), book.entered("all_reduce"):
        raise RuntimeError("Timed out")
    state = book.state(3)
    here = f"test_hangs.py:{sys._getframe().f_lineno - 3}"
    assert state.last == Entry(2, "all_reduce", here) and state.inside  # a rank that timed out is still "in" it
    assert [e.op for e in state.tail] == ["barrier", "all_reduce"]
    assert RankState.from_dict(state.to_dict()) == state


def test_the_ledger_skips_other_threads_and_nested_entries() -> None:
    import threading

    book = Ledger()
    with book.entered("all_reduce"), book.entered("inner"):
        pass
    worker = threading.Thread(target=lambda: book.entered("gather_object").__enter__())
    worker.start()
    worker.join()
    assert [e.op for e in book.entries] == ["all_reduce"]


def test_disagreement_names_each_side_in_one_line() -> None:
    def at(rank: int, op: str, site: str, inside: bool = True, steps: int = 0) -> RankState:
        return RankState(rank, Entry(57, op, site), inside, steps)

    line = disagreement([at(0, "all_reduce", "train.py:40"), at(1, "broadcast_object", "train.py:52"),
                         at(2, "all_reduce", "train.py:40"), at(3, "all_reduce", "train.py:40")])
    assert line == ("rank 1 is in broadcast_object #57 (train.py:52); ranks 0, 2, 3 are in all_reduce #57 "
                    "(train.py:40)")
    assert disagreement([at(0, "barrier", "t.py:1"), at(1, "barrier", "t.py:1")]) is None
    assert disagreement([at(0, "barrier", "t.py:1", steps=4), at(1, "barrier", "t.py:1", steps=3)]) == (
        "DDP steps so far: rank 1 3; rank 0 4")


# -- the NCCL deadline (CUDA faked) ---------------------------------------------------------------------------------
def test_under_nccl_the_group_timeout_leaves_time_for_the_report() -> None:
    ten = datetime.timedelta(seconds=10)
    assert hangs.group_timeout(ten, "gloo") == ten
    assert hangs.group_timeout(ten, "nccl") == ten + datetime.timedelta(seconds=hangs.NCCL_MARGIN_S)
    assert hangs.group_timeout(ten, "cpu:gloo,cuda:nccl") > ten  # fsdp cpu_offload's combined backend


def test_the_deadline_watch_reports_a_collective_open_past_distfns_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 4: NCCL's watchdog would abort at timeout + margin; the responder reports at distfn's timeout, from its
    own thread, while the main thread is still blocked (faked: a ledger entry opened 11 s ago, timeout 10 s)."""
    import torch.distributed as dist

    from distfn.rankstore import Channel

    reported: list[BaseException] = []
    book = Ledger()
    monkeypatch.setattr(hangs, "POLL_S", 0.05)
    responder = hangs.Responder.start(Channel.open(dist.HashStore(), 0, 1).child("hang"), timeout_s=10.0,
                                      ledger=book, report=reported.append, deadline=True)
    try:
        with book.entered("all_reduce"):
            assert not responder._overdue(time.monotonic())
            book.inside_since = time.monotonic() - 11.0
            deadline = time.monotonic() + 5
            while not reported and time.monotonic() < deadline:
                time.sleep(0.05)
        # TORCH_NCCL_BLOCKING_WAIT=1: the same collective then fails in the main thread too (issue 42 item 7); that
        # error points at the report in one line instead of reporting the hang a second time
        later = RuntimeError("NCCL communicator was aborted on rank 0")
        responder.on_failure(later)
    finally:
        responder.stop()
    assert reported, "the deadline watch did not report"
    exc = reported[0]
    assert isinstance(exc, TimeoutError) and "all_reduce #1 (test_hangs.py:" in str(exc)
    diagnosis, stacks, reporter = failures.attached_report(later)
    assert reporter == -1 and stacks == "" and diagnosis.startswith("rank 0 reported this hang at distfn's deadline")
    assert len(reported) == 1
    # torch's watchdog: the group's timeout (distfn's + 15 s), then 4 x the 15 s dump wait before it aborts
    assert "NCCL's watchdog aborts this rank about 75 s later" in str(exc)
    assert hangs.nccl_abort_after({}) == 75.0
    assert hangs.nccl_abort_after({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"}) == 19.0
    assert hangs.nccl_abort_after({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "x"}) == 75.0
    for no_teardown in ("0", "2"):
        assert hangs.nccl_abort_after({"TORCH_NCCL_ASYNC_ERROR_HANDLING": no_teardown}) is None
    assert hangs.nccl_abort_after({"NCCL_ASYNC_ERROR_HANDLING": "1"}) == 75.0


# -- end to end -------------------------------------------------------------------------------------------------------
def _started(out: str) -> float:
    line = next(line for line in out.splitlines() if "STARTED " in line)  # Ray prefixes "(RankActor pid=...)"
    return float(line.split("STARTED ")[1].split()[0])


def _check_sleep_report(text: str) -> None:
    assert "timed out after 10 s" in text, text[-4000:]
    assert f"Rank 1 had not reached a collective: rank 1 was in sleepy ({JOB}:{SLEEP_LINE})" in text, text[-4000:]
    assert "Python stacks of the other ranks when rank 0 timed out" in text
    assert f'hang_job.py", line {SLEEP_LINE} in sleepy' in text
    assert text.count("Python stacks of the other ranks") == 1, "the report must appear once"


def _pods(case: str, *, world: int = 2, extra: dict[str, str] | None = None,
          timeout: float = 120) -> tuple[list[int | None], list[str], float]:
    """Run hang_job.py CASE as ``world`` env:// "pods" (plain processes with RANK/WORLD_SIZE/MASTER_*); returns the
    exit codes, the outputs and the time the last one ended. Whatever is left at ``timeout`` is killed."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(JOB), case, str(TIMEOUT)],
        env=clean_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra or {})),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(world)]
    outputs, codes = [], []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                outputs.append(p.communicate()[0])
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return codes, outputs, time.time()


@pytest.mark.slow
def test_self_spawned_job_reports_the_sleeping_rank() -> None:
    start = time.time()
    done = subprocess.run([sys.executable, str(JOB), "sleep", str(TIMEOUT)], capture_output=True, text=True,
                          timeout=120, env=clean_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr[-3000:]
    _check_sleep_report(done.stderr)
    assert time.time() - max(start, _started(done.stdout)) < TIMEOUT + 15


@pytest.mark.slow
def test_an_fsdp_save_waiting_for_a_sleeping_rank_ends_with_the_report_within_the_timeout() -> None:
    """Issue 41 item 14: rank 0 in ctx.save's full-state gather (its check-in) while rank 1 sleeps used to wait
    fsdp's save_timeout (300 s) with no report; the job's timeout (3 s here) covers every collective distfn starts,
    the checkpoint's included, and the report names the sleeping rank, its line, and the save rank 0 is in."""
    timeout = 3.0
    start = time.time()
    done = subprocess.run([sys.executable, str(JOB), "fsdp-save", str(timeout)], capture_output=True, text=True,
                          timeout=120, env=clean_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr[-3000:]
    text = done.stderr
    save_line = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "HANG-SAVE-LINE" in line)
    # the check-in's own wait, cut to the job's timeout, is what the diagnosis names (not a collective's timeout)
    assert f"waited {timeout:g} s in ctx.save" in text and "CheckInTimeout" in text, text[-4000:]
    assert "waited past its check-in deadline" in text, text[-4000:]
    assert f"rank 1 was in sleepy ({JOB}:{SLEEP_LINE})" in text
    assert f"Collectives: rank 0 is in ctx.save #2 (hang_job.py:{save_line})" in text
    assert "raise @distributed(timeout=...)" in text  # the wait to raise is the job's deadline, not save_timeout
    assert text.count("Python stacks of the other ranks") == 1
    assert time.time() - max(start, _started(done.stdout)) < timeout + 15


@pytest.mark.slow
def test_env_pods_report_the_sleeping_rank_once_and_every_rank_exits() -> None:
    codes, outputs, ended = _pods("sleep")
    assert codes == [1, 1], "\n".join(o[-3000:] for o in outputs)
    _check_sleep_report(outputs[0])
    assert "Python stacks" not in outputs[1]  # the report appears once: on the rank that collected it
    assert "rank 0 reported a hang of the job" in outputs[1]
    assert "Collectives: rank 0 is in barrier #2" in outputs[0]
    assert "rank 1 is not in a collective (last left barrier #1" in outputs[0]
    assert ended - _started(outputs[0]) < TIMEOUT + 15


@pytest.mark.slow
def test_ranks_in_different_collectives_get_the_one_line_disagreement() -> None:
    codes, outputs, _ = _pods("mismatch")
    assert codes == [1, 1], "\n".join(o[-3000:] for o in outputs)
    text = outputs[0]
    lines = JOB.read_text().splitlines()
    bline = next(i for i, line in enumerate(lines, 1) if "HANG-BROADCAST-LINE" in line)
    aline = next(i for i, line in enumerate(lines, 1) if "HANG-ALLREDUCE-LINE" in line)
    assert (f"Collectives: rank 0 is in all_reduce #2 (hang_job.py:{aline}); rank 1 is in broadcast_object #2 "
            f"(hang_job.py:{bline}).") in text, text[-4000:]
    assert "rank 1 failed with RuntimeError" in outputs[1] and "rank 0 reports this hang" in outputs[1]


@pytest.mark.slow
def test_a_killed_rank_is_named_dead_not_silent() -> None:
    codes, outputs, _ = _pods("kill")
    assert codes[0] == 1 and codes[1] == -signal.SIGKILL, "\n".join(o[-3000:] for o in outputs)
    assert "Rank 1 is dead (pid " in outputs[0] and "the process is gone" in outputs[0], outputs[0][-3000:]
    assert "did not answer" not in outputs[0]


@pytest.mark.slow
def test_a_rank_holding_the_gil_is_named_as_not_answering() -> None:
    codes, outputs, _ = _pods("gil", timeout=40)
    assert codes[0] == 1, outputs[0][-3000:]
    assert f"Rank 1 did not answer within {hangs.ANSWER_WAIT_S:g} s: dead, or holding the GIL" in outputs[0]


@pytest.mark.slow
def test_one_task_per_node_with_local_workers_reports_across_nodes() -> None:
    """Two env:// "pods", DISTFN_NPROCS=2 each (4 ranks, two launching processes that see only their own)."""
    codes, outputs, ended = _pods("sleep", extra={"DISTFN_NPROCS": "2"})
    assert codes == [1, 1], "\n".join(o[-3000:] for o in outputs)
    _check_sleep_report(outputs[0])
    assert "WorkerError" in outputs[1] and "Python stacks" not in outputs[1]  # once per job, not once per node
    assert ended - _started(outputs[0]) < TIMEOUT + 15


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_torchrun_two_nodes_puts_the_report_in_the_root_cause(tmp_path: Path) -> None:
    """torchrun --nnodes=2, two agents on loopback: the report is in the error file, so torchrun's own summary
    shows it as the root cause; every process is gone within timeout + 15 s of the barrier."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    port = free_port()
    agents = [subprocess.Popen(
        [torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}", "--rdzv-backend=static",
         "--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.5", str(JOB), "sleep",
         str(TIMEOUT)],
        env=clean_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True) for n in range(2)]
    results: list[Any] = []
    try:
        for a in agents:
            results.append(a.communicate(timeout=150))
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    ended = time.time()
    (out0, err0), (_, err1) = results
    assert [a.returncode for a in agents] == [1, 1], err0[-3000:] + err1[-3000:]
    summary = err0[err0.index("Root Cause (first observed failure)"):]
    assert "rank      : 0" in summary
    _check_sleep_report(summary.replace("\n  ", "\n"))  # torchrun indents the error file's text
    assert "Python stacks" not in err1 and "rank 0 reported a hang of the job" in err1
    assert ended - _started(out0) < TIMEOUT + 15


@pytest.mark.slow
def test_ray_job_reports_the_sleeping_rank(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    script = tmp_path / "ray_hang.py"
    script.write_text(RAY_JOB.format(repo=REPO))
    start = time.time()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env=clean_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0",
                                        HOME=str(tmp_path)))  # its ~/.ray/auth_token stays in tmp_path
    text = done.stdout + done.stderr
    assert "REPORTED" in done.stdout, text[-4000:]
    assert "Rank 1 had not reached a collective: rank 1 was in sleepy" in text
    assert "Python stacks of the other ranks when rank 0 timed out" in text
    assert time.time() - max(start, _started(done.stdout)) < TIMEOUT + 15 + 30  # + Ray's own shutdown


RAY_JOB = """
import sys, time
sys.path.insert(0, "{repo}/tests/scripts")
import ray
from distfn import distributed, WorkerError

def sleepy(seconds):
    time.sleep(seconds)

@distributed(mode="ddp", launcher="ray", nprocs=2, timeout=10)
def job(cfg, ctx):
    ctx.barrier()
    if ctx.rank == 0:
        print("STARTED", time.time(), flush=True)
    if ctx.rank == 1:
        sleepy(120)
    ctx.barrier()

if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own cluster, not one already running
    try:
        job()
    except WorkerError as exc:
        print(str(exc), file=sys.stderr)
        print("REPORTED", flush=True)
    ray.shutdown()
"""


# -- the start-up fingerprint (item 3) ------------------------------------------------------------------------------
def _agreements(world: int) -> list[Any]:
    import torch.distributed as dist

    from distfn.fingerprint import Agreement
    from distfn.rankstore import Channel

    store = dist.HashStore()
    return [Agreement.start(Channel.open(store, r, world).child("fingerprint"),
                            {"lr": 0.1 if r != 2 else 0.2, "opt": object()}, 5.0) for r in range(world)]


def test_cfg_items_flatten_mappings_dataclasses_and_namespaces_and_ignore_addresses() -> None:
    import argparse
    import dataclasses

    from distfn.fingerprint import cfg_items

    @dataclasses.dataclass
    class Opt:
        lr: float = 0.1
        betas: tuple[float, float] = (0.9, 0.99)

    items = cfg_items({"opt": Opt(), "args": argparse.Namespace(steps=3), "fn": lambda: 0})
    assert items == {"cfg.opt.lr": "0.1", "cfg.opt.betas.0": "0.9", "cfg.opt.betas.1": "0.99",
                     "cfg.args.steps": "3", "cfg.fn": "<function>"}  # a repr with an address: the type alone


def test_a_different_cfg_on_one_rank_names_the_key_and_both_sides() -> None:
    import threading

    from torch import nn

    from distfn.errors import ConfigError

    ranks = _agreements(3)
    errors: dict[int, str] = {}

    def wrap(r: int) -> None:
        try:
            ranks[r].check(nn.Linear(2, 2))
        except ConfigError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(errors) == [0, 1, 2] and len(set(errors.values())) == 1, errors
    assert "the cfg differs at 'cfg.lr': 0.1 on ranks 0, 1, 0.2 on rank 2" in errors[0]


def test_the_same_inputs_pass_and_a_different_layer_is_named() -> None:
    import threading

    from torch import nn

    from distfn.errors import ConfigError

    ranks = _agreements(2)
    for a in ranks:
        a.cfg = {"cfg.lr": "0.1"}
    threads = [threading.Thread(target=a.check, args=(nn.Linear(2, 2),)) for a in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors: dict[int, str] = {}

    def wrap(r: int) -> None:
        try:
            ranks[r].check(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 9 if r else 8)))
        except ConfigError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "ctx.wrap #2: the wrapped model differs at 'model.1.weight': (8, 8) float32 on rank 0, (9, 8) float32 " \
           "on rank 1" in errors[1], errors


@pytest.mark.slow
@pytest.mark.parametrize(("case", "expected"), [
    ("cfg", "the cfg differs at 'cfg.lr': 0.1 on rank 0, 0.2 on rank 1"),
    ("model", "the wrapped model differs at 'model.1.weight': (8, 8) float32 on rank 0, (9, 8) float32 on rank 1"),
])
def test_divergent_ranks_fail_at_the_first_wrap_on_every_rank(case: str, expected: str) -> None:
    codes, outputs, _ = _pods(case)
    assert codes == [1, 1], "\n".join(o[-3000:] for o in outputs)
    for out in outputs:
        assert f"ConfigError: the ranks were given different inputs at ctx.wrap #1: {expected}" in out, out[-3000:]


def test_long_lists_and_long_reprs_are_one_item_that_still_tells_them_apart() -> None:
    from distfn.fingerprint import cfg_items

    files = [f"shard-{i}.tar" for i in range(1000)]
    one, other = cfg_items({"files": files}), cfg_items({"files": [*files[:-1], "other.tar"]})
    assert list(one) == ["cfg.files"] and len(one["cfg.files"]) <= 120
    assert one != other  # the difference is past the shortened repr: the digest tells


def test_only_a_timeout_inside_a_collective_or_a_lost_peer_starts_a_report() -> None:
    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:  # noqa: BLE001
            return caught

    assert not hangs._is_hang(raised(TimeoutError("the HTTP request timed out")))  # no collective frame
    assert hangs._is_hang(raised(RuntimeError("Connection closed by peer [127.0.0.1]:5009")))
