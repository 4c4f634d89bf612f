"""The ``distfn`` command (also ``python -m distfn``): ``distfn test``, ``distfn env``, ``distfn version``,
``distfn consolidate``.

This module only parses the command line and hands each command to its own module: `distfn.smoketest`
(``distfn test``), `distfn.envreport` (``distfn env``) and `distfn.checkpoint` (``distfn consolidate``). Those
import torch (3-5 s); ``--help`` and ``version`` need none of it and answer in a few tens of milliseconds, so
each command's module is imported only when that command runs (the package itself is lazy too: see `distfn`).

Output here is for a person at a terminal, so this module prints (the library itself logs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CheckpointError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distfn", description="distfn command line.")
    sub = parser.add_subparsers(dest="command")
    test = sub.add_parser("test", help="a 2-rank smoke test: all-reduce, barrier, save/load, a DDP step")
    test.add_argument("--gpu", action="store_true", help="on the GPUs over NCCL (default: CPU over gloo)")
    test.add_argument("--nprocs", type=int, default=None,
                      help="ranks to self-spawn (default 2; with --gpu, min(2, GPUs)); a launcher's count wins")
    test.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    env = sub.add_parser("env", help="print what distfn detects here (paste it into bug reports)")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument("--rank0", action="store_true", help="under a launcher, only rank 0 prints")
    # The names are `distfn.options.LAUNCHERS` (checked against it when env runs; not imported here, since
    # `distfn.options` imports torch); tests/test_cli.py checks that this text lists every one.
    env.add_argument("--launcher", default="auto",
                     help="detect as @distributed(launcher=...) would: auto, spawn, torchrun, slurm, mpi, ray")
    sub.add_parser("version", help="print the distfn version")
    merge = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one .safetensors file")
    merge.add_argument("directory", help="the sharded checkpoint: a directory or a URL (s3://bucket/run/ckpt-9) "
                       "with model.safetensors.index.json")
    merge.add_argument("out", help="the .safetensors file to write (streamed, one tensor in memory at a time)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m distfn`` and the ``distfn`` console script; returns the exit status."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # The legacy `python -m torch.distributed.launch` appends --local-rank=N to every process's arguments.
    args, unknown = parser.parse_known_args(given)
    unknown = [a for a in unknown if not a.startswith(("--local_rank", "--local-rank")) and not a.isdigit()]
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
