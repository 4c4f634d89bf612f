"""The ``distfn`` command (also ``python -m distfn``): ``distfn test``, ``distfn env``, ``distfn inspect``,
``distfn ls``, ``distfn consolidate``, ``distfn version`` (and ``distfn --version``).

This module only parses the command line, checks the arguments (a bad one is an early error with exit status 2,
argparse's), and hands each command to its own module: `distfn.smoketest` (``distfn test``), `distfn.envreport`
(``distfn env``), `distfn.inspection` (``distfn inspect``, ``distfn ls``) and `distfn.checkpoint` (``distfn
consolidate``). Those import torch (3-5 s); ``--help`` and ``version`` need none of it and answer in a few tens of
milliseconds, so each command's module is imported only when that command runs (the package itself is lazy too:
see `distfn`). A command that fails on what it was given (a damaged checkpoint, a failed check) prints one line
on stderr and exits with status 1.

Output here is for a person at a terminal, so this module prints (the library itself logs).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CheckpointError

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of ranks (give 1 or more)")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names nothing")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distfn", description="distfn command line.")
    parser.add_argument("--version", action="version", version=f"distfn {__version__}")
    sub = parser.add_subparsers(dest="command")
    test = sub.add_parser("test", help="a 2-rank smoke test: all-reduce, barrier, save/load, a DDP step")
    test.add_argument("--gpu", action="store_true", help="on the GPUs over NCCL (default: CPU over gloo)")
    test.add_argument("--nprocs", type=_positive_int, default=None,
                      help="ranks to self-spawn, 1 or more (default 2; with --gpu, min(2, GPUs)); a launcher's "
                           "count wins")
    test.add_argument("--timeout", type=_positive_seconds, default=120.0,
                      help="seconds before a stuck collective fails (positive)")
    env = sub.add_parser("env", help="print what distfn detects here (paste it into bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument("--rank0", action="store_true", help="under a launcher, only rank 0 prints")
    # The names are `distfn.options.LAUNCHERS` (checked against it when env runs; not imported here, since
    # `distfn.options` imports torch); tests/test_cli.py checks that this text lists every one.
    env.add_argument("--launcher", default="auto",
                     help="detect as @distributed(launcher=...) would: auto, spawn, torchrun, slurm, mpi, ray")
    sub.add_parser("version", help="print the distfn version")
    inspect = sub.add_parser("inspect", help="what a checkpoint holds and what a resume restores (headers only)")
    inspect.add_argument("checkpoint", type=_non_empty,
                         help="a .safetensors file, a sharded checkpoint directory, or a URL of either")
    inspect.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    ls = sub.add_parser("ls", help="the checkpoints of a directory, newest first, and the one distfn.latest picks")
    ls.add_argument("directory", type=_non_empty, help="a directory or a URL (s3://bucket/run)")
    ls.add_argument("--prefix", default="ckpt-", help="the name before the step number, as distfn.latest's prefix= "
                                                     "(default: ckpt-)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of text")
    merge = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one .safetensors file")
    merge.add_argument("directory", help="the sharded checkpoint: a directory or a URL (s3://bucket/run/ckpt-9) "
                       "with model.safetensors.index.json")
    merge.add_argument("out", help="the .safetensors file to write (streamed, one tensor in memory at a time)")
    return parser


def _without_local_rank(unknown: list[str]) -> list[str]:
    """``unknown`` without the legacy launcher's ``--local-rank=N`` / ``--local_rank N`` (a number is dropped only
    right after a bare ``--local_rank``: a stray ``5`` elsewhere stays an unrecognized argument)."""
    out: list[str] = []
    after_flag = False
    for arg in unknown:
        if arg in ("--local_rank", "--local-rank"):
            after_flag = True
            continue
        if not (arg.startswith(("--local_rank=", "--local-rank=")) or (after_flag and arg.isdigit())):
            out.append(arg)
        after_flag = False
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m distfn`` and the ``distfn`` console script; returns the exit status."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # The legacy `python -m torch.distributed.launch` appends --local-rank=N to every process's arguments.
    args, unknown = parser.parse_known_args(given)
    unknown = _without_local_rank(unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "version":
        print(__version__)
        return 0
    # The imports below are here, not at the top, because each costs torch's import (3-5 s, measured with
    # `python -X importtime`), which --help and version must not pay.
    if args.command == "env":
        from .envreport import print_env
        from .options import LAUNCHERS

        if args.launcher not in LAUNCHERS:
            parser.error(f"--launcher must be one of {', '.join(LAUNCHERS)}")
        return print_env(given, launcher=args.launcher, as_json=args.json, rank0=args.rank0)
    if args.command in ("inspect", "ls"):
        from .inspection import run

        target = args.checkpoint if args.command == "inspect" else args.directory
        return run(args.command, target, prefix=getattr(args, "prefix", "ckpt-"), as_json=args.json,
                   every_tensor=getattr(args, "all", False))
    if args.command == "test":
        from .smoketest import run_test

        return run_test(gpu=args.gpu, nprocs=args.nprocs, timeout=args.timeout)
    if args.command == "consolidate":
        from .checkpoint import consolidate

        try:
            print(consolidate(args.directory, args.out))
        except CheckpointError as exc:
            print(f"distfn consolidate: {exc}", file=sys.stderr)
            return 1
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
