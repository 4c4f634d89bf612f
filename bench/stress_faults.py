"""Run distfn's fault matrix N times and print a table: case, runs, passed, median time to the failure report,
leftovers. Writes the rows as JSON too.

    python bench/stress_faults.py --runs 5 --json stress_faults.json
    python bench/stress_faults.py --runs 2 --cases raise,segv,sigterm
    python bench/stress_faults.py --runs 2 --start-method forkserver

In-process cases run ``tests/scripts/rel_job.py CASE - N`` (N launches in one Python process, 2 ranks each);
"seconds" is the time from the decorated call to the ``WorkerError`` (or the return value). Signal cases start
one job per run in its own session, signal the launching process once both ranks are working, and time the
signal -> report. Leftovers: processes of the job's session still alive after it ended, sockets still
listening, /dev/shm segments no live process uses, temp files of multiprocessing/torch/distfn.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
JOB = str(SCRIPTS / "rel_job.py")
sys.path.insert(0, str(SCRIPTS))
from rel_leftovers import alive, processes, shm_segments, shm_snapshot

sys.path.insert(0, str(ROOT / "bench"))
import bench_restart  # the restart case: the restart benchmark's job, run the same way

# In-process cases: what the report must say (every needle), or for "ok"/"env_ok" what the value must hold.
EXPECT: dict[str, list[str]] = {
    "ok": ["'ranks': [0, 1]"],
    "env_ok": ["0"],
    "raise": ["rank 1 (pid", "failed with ValueError: boom on rank 1", 'raise ValueError("boom on rank 1")'],
    "sigkill": ["was killed by SIGKILL: often the out-of-memory killer"],
    "segv": ["was killed by SIGSEGV", "Fatal Python error: Segmentation fault", " in body"],
    "exit": ["failed with SystemExit: 3"],
    "early_return": ["Rank 1 had already returned from the function"],
    "unpicklable_return": ["rank 0 (pid", "return value['fn'] (a lambda", "Return plain data"],
    "nested": ["rank 1 (pid", "NestedLaunchError"],
    "dataloader": ["failed while DataLoader workers run"],
    "hang": ["timed out after 10 s", "Rank 1 had not reached a collective", "Python stacks of the other ranks"],
}
SIGNAL_CASES = ("sigint", "sigterm", "stubborn", "preempt-usr2", "preempt-term", "parent-kill")
# kill -9 of a process in the middle of a step-named save (ckpt-7), then a save of ckpt-8 by another process:
# the dead writer's temporary file must be gone and ckpt-8 complete.
SAVE_CASES = ("save-kill",)
# max_restarts=1: rank 1 is SIGKILLed at step 10 of attempt 0; the restarted job resumes from its checkpoint and
# must end with the weights of an uninterrupted run. "seconds": the death -> first step of the restarted job.
RESTART_CASES = ("restart",)
_SAVER = """
import sys, torch, distfn.checkpoint as c
c.save({"w": torch.randn(int(sys.argv[2]))}, sys.argv[1])
"""


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "DISTFN_NPROCS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    env.update(extra)
    return env


def _after_exit(sid: int, tmp: str, shm_before: set[str]) -> list[str]:
    time.sleep(0.2)  # let the kernel reap what was just killed
    forked = os.environ.get("REL_START_METHOD", "auto") in ("auto", "fork")  # auto forks in rel_job.py
    left = processes(sid, session=True) + shm_segments(shm_before, forked=forked)
    # torchinductor_<user>: torch's compile cache, which a fresh interpreter (spawn) may create; kept on purpose
    left += [f"temp {n}" for n in os.listdir(tmp) if not n.startswith("torchinductor_")]
    return left


def run_in_process(case: str, runs: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        shm_before = shm_snapshot()
        proc = subprocess.Popen([sys.executable, JOB, case, "-", str(runs)], env=_env(TMPDIR=tmp),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        out, err = proc.communicate(timeout=120 + runs * 60)
        after = _after_exit(proc.pid, tmp, shm_before)
    rows = []
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        succeeds = case in ("ok", "env_ok")
        text = rec["value"] if succeeds else rec["error"]
        passed = rec["ok"] == succeeds and all(n in (text or "") for n in EXPECT[case])
        rows.append({"passed": passed and not rec["leftovers"], "seconds": rec["seconds"],
                     "leftovers": rec["leftovers"]})
    if not rows:
        rows = [{"passed": False, "seconds": float("nan"), "leftovers": [f"no report: {err[-300:]}"]}]
    rows[-1]["leftovers"] = rows[-1]["leftovers"] + after
    rows[-1]["passed"] = rows[-1]["passed"] and not after
    return rows


def _wait_ready(marks: Path, proc: subprocess.Popen[str], count: int = 2, timeout: float = 90) -> bool:
    deadline = time.monotonic() + timeout
    while len(list(marks.glob("*.ready"))) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_signal_case(case: str) -> dict[str, Any]:
    job_case = {"preempt-usr2": "preempt", "preempt-term": "preempt", "parent-kill": "sigint"}.get(case, case)
    sigs = {"sigint": [signal.SIGINT], "sigterm": [signal.SIGTERM], "stubborn": [signal.SIGINT, signal.SIGINT],
            "preempt-usr2": [signal.SIGUSR2], "preempt-term": [signal.SIGTERM],
            "parent-kill": [signal.SIGKILL]}[case]
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        marks = Path(tmp, "marks")
        marks.mkdir()
        shm_before = shm_snapshot()
        proc = subprocess.Popen([sys.executable, JOB, job_case, str(marks)], env=_env(TMPDIR=str(marks)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if not _wait_ready(marks, proc):
            proc.kill()
            return {"passed": False, "seconds": float("nan"), "leftovers": ["never ready"]}
        pids = [int(p.read_text()) for p in marks.glob("*.pid")]
        t0, sent = time.monotonic(), time.time()
        for i, sig in enumerate(sigs):
            if i:
                time.sleep(0.3)  # the second Ctrl-C comes while the first one's finally blocks run
            proc.send_signal(sig)
        if case == "parent-kill":  # the workers must follow their parent (PDEATHSIG)
            while any(alive(p) for p in pids) and time.monotonic() - t0 < 10:
                time.sleep(0.005)
        seconds = time.monotonic() - t0
        out, _ = proc.communicate(timeout=90)
        recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if recs and case != "parent-kill":
            seconds = recs[-1]["ended"] - sent  # to the report, without the interpreter's exit
        finals = len(list(marks.glob("*.finally")))
        left = _after_exit(proc.pid, tmp, shm_before)
        left = [x for x in left if x != "temp marks"]
    checks: dict[str, Callable[[], bool]] = {
        "sigint": lambda: proc.returncode == -signal.SIGINT and finals == 2,
        "sigterm": lambda: proc.returncode == 1 and finals == 2 and "Terminated" in out,
        "stubborn": lambda: proc.returncode == -signal.SIGINT and seconds < 15,
        "preempt-usr2": lambda: proc.returncode == 0 and "'steps'" in out,
        "preempt-term": lambda: proc.returncode == 0 and "'steps'" in out,
        "parent-kill": lambda: not any(alive(p) for p in pids),
    }
    return {"passed": checks[case]() and not left, "seconds": round(seconds, 3), "leftovers": left}


def run_save_kill_case(numel: int = 64 * 2**20) -> dict[str, Any]:
    """kill -9 a writer of ``ckpt-7.safetensors`` once its temporary file exists; save ``ckpt-8`` in a new process;
    "seconds" is the second save's time; leftovers are the files other than ckpt-8 in the directory."""
    with tempfile.TemporaryDirectory(prefix="stress-save-") as tmp:
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(Path(tmp, "ckpt-7.safetensors")), str(numel)],
                                env=_env())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(n.endswith(".distfn-tmp") for n in os.listdir(tmp)):
                break
            time.sleep(0.01)
        killed_mid_save = proc.poll() is None
        proc.kill()
        proc.wait()
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", _SAVER, str(Path(tmp, "ckpt-8.safetensors")), "1024"], env=_env(),
                       check=True)
        seconds = time.perf_counter() - start
        left = sorted(n for n in os.listdir(tmp) if n != "ckpt-8.safetensors")
        return {"passed": killed_mid_save and not left, "seconds": round(seconds, 3), "leftovers": left}


def run_restart_case() -> dict[str, Any]:
    """An uninterrupted run and a run killed once (`bench_restart.run_job`, the restart benchmark's runner of the
    same job); "ratio" = (death -> restarted first step) / (call -> first step of a fresh launch)."""
    with tempfile.TemporaryDirectory(prefix="stress-restart-") as tmp:
        reference, fresh = bench_restart.run_job(Path(tmp), "reference", None)
        result, killed = bench_restart.run_job(Path(tmp), "killed", 10)
        launch = bench_restart.launch_seconds(fresh)
        try:
            restart = bench_restart.restart_seconds(killed)
        except KeyError:  # the killed run never reached a restarted first step: the case failed
            restart = float("nan")
        return {"passed": bool(reference) and result == reference, "seconds": round(restart, 3),
                "ratio": round(restart / launch, 3), "leftovers": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per case (hang: at most --hang-runs)")
    parser.add_argument("--hang-runs", type=int, default=1, help="runs of the 10 s collective-timeout case")
    parser.add_argument("--cases", default=",".join([*EXPECT, *SIGNAL_CASES, *SAVE_CASES, *RESTART_CASES]))
    parser.add_argument("--json", default="stress_faults.json", help="where to write the rows")
    parser.add_argument("--start-method", default="auto", help="auto (fork here), spawn or forkserver")
    args = parser.parse_args()
    os.environ["REL_START_METHOD"] = args.start_method
    table = []
    for case in args.cases.split(","):
        if case in EXPECT:
            runs = min(args.runs, args.hang_runs) if case == "hang" else args.runs
            rows = run_in_process(case, runs)
        elif case in SIGNAL_CASES:
            rows = [run_signal_case(case) for _ in range(args.runs)]
        elif case in SAVE_CASES:
            rows = [run_save_kill_case() for _ in range(args.runs)]
        elif case in RESTART_CASES:
            rows = [run_restart_case() for _ in range(args.runs)]
        else:
            known = [*EXPECT, *SIGNAL_CASES, *SAVE_CASES, *RESTART_CASES]
            raise SystemExit(f"unknown case {case!r}; known: {', '.join(known)}")
        secs = [r["seconds"] for r in rows if r["seconds"] == r["seconds"]]
        table.append({
            "case": case, "runs": len(rows), "passed": sum(r["passed"] for r in rows),
            "median_s": round(statistics.median(secs), 3) if secs else None,
            "max_s": round(max(secs), 3) if secs else None,
            "leftovers": sorted({x for r in rows for x in r["leftovers"]}),
        })
        ratios = [r["ratio"] for r in rows if "ratio" in r]
        if ratios:
            table[-1]["median_ratio_to_fresh_launch"] = round(statistics.median(ratios), 3)
        row = table[-1]
        print(f"  {case}: {row['passed']}/{row['runs']}", file=sys.stderr, flush=True)
    print(f"\n{'case':<20}{'runs':>5}{'passed':>8}{'median s':>10}{'max s':>8}  leftovers")
    for r in table:
        print(f"{r['case']:<20}{r['runs']:>5}{r['passed']:>8}{r['median_s']!s:>10}{r['max_s']!s:>8}  "
              f"{len(r['leftovers']) or '-'}{'' if not r['leftovers'] else ': ' + ', '.join(r['leftovers'][:3])}")
    note = ("in-process cases: seconds from the call to the WorkerError/return; signal cases: from the (first) "
            "signal to the KeyboardInterrupt/WorkerError/return in the launching process (parent-kill: to the "
            "last worker's death); save-kill: the next save's time, leftovers = files besides that checkpoint; "
            "restart: death -> the restarted job's first step (passed = final weights equal an uninterrupted run's), "
            "with its ratio to a fresh launch's call -> first step")
    for r in table:
        if "median_ratio_to_fresh_launch" in r:
            print(f"{r['case']}: median ratio to a fresh launch {r['median_ratio_to_fresh_launch']}x (target <= 1.5x)")
    print(f"\n{note}")
    Path(args.json).write_text(json.dumps({"rows": table, "note": note, "python": sys.version.split()[0],
                                           "start_method": args.start_method}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
