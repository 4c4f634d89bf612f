"""`distfn.process.frozen_heap`: during a call the caller's objects are out of the cyclic collector's passes, the
ranks forked during it keep them so, and the caller gets them back after (issue 32: a full collection over
torch's objects cost 100-300 ms on the launch's critical path)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from distfn.process import frozen_heap


def test_frozen_during_the_block_and_given_back_after() -> None:
    assert gc.get_freeze_count() == 0
    junk = [object() for _ in range(10)]
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("an error in the call")
    assert gc.get_freeze_count() == 0  # given back on an error too
    del junk


def test_a_process_that_froze_its_objects_itself_keeps_them_frozen() -> None:
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == before  # not unfrozen behind the user's back
    finally:
        gc.unfreeze()


def test_garbage_cycles_made_before_the_call_are_collected_after_it() -> None:
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic collector frees it
    marker = [a]
    import weakref

    ref = weakref.ref(a)
    with frozen_heap():
        del a, b, marker
        gc.collect()
        assert ref() is not None  # frozen: left alone during the call
    gc.collect()
    assert ref() is None  # the caller's collector has it back


SCRIPT = textwrap.dedent("""
    import gc, sys
    import torch
    from distfn import distributed

    @distributed(nprocs=int(sys.argv[1]), backend="gloo", start_method=sys.argv[2])
    def job(cfg, ctx):
        return ctx.gather_object(gc.get_freeze_count() > 0)

    if __name__ == "__main__":
        print("FROZEN", job(None), gc.get_freeze_count())
""")


@pytest.mark.parametrize(("nprocs", "method"), [(1, "auto"), (2, "fork")])
def test_a_call_runs_frozen_and_the_caller_is_unfrozen_after(tmp_path, nprocs: int, method: str) -> None:
    """In place (one process) and in forked ranks: every rank runs with the launcher's objects frozen; the
    launching process has them back when the call returns."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(nprocs), method], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("FROZEN"))
    assert line == f"FROZEN {[True] * nprocs} 0", done.stdout
