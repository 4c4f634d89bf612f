"""Logs from two ranks at several levels and reports each rank's CPU thread count (driven by tests/test_logs.py).

Usage: python logs_job.py USER_SINK_FILE. The user's own loguru sink is added before the launch and must survive.
"""

import json
import sys

import torch
from loguru import logger

from distfn import distributed


@distributed(nprocs=2)
def job(cfg, ctx):
    logger.debug("debug from rank {}", ctx.rank)
    logger.info("info from rank {}", ctx.rank)
    logger.warning("warning from rank {}", ctx.rank)
    return ctx.gather_object(torch.get_num_threads())


if __name__ == "__main__":
    logger.add(sys.argv[1], format="{message}", level="DEBUG")
    print(json.dumps(job()))
