"""The processes of a data-parallel run (examples/train.py, examples/train_module.py): which rank
this is, joining the process group, the one-line report of a bad flag under torchrun, and the
small collectives the logs use."""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

RANK_0_REPORT_WAIT_S = 60.0


def launched() -> tuple[int, int]:
    """``(world_size, rank)`` as the launcher set them (torchrun's WORLD_SIZE and RANK; a plain
    script is ``(1, 0)``), known before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def rows_of(rank: int, world: int, batch_size: int) -> slice:
    """This rank's contiguous rows of a global batch of ``batch_size`` rows (the same number on
    every rank once ``flags.check_batch_size`` has passed)."""
    return slice(rank * batch_size // world, (rank + 1) * batch_size // world)


def exit_usage(prog: str, error: Exception, rank: int):
    """Report a bad flag as one line, ``<prog>: error: <error>``, from rank 0 only, and exit with
    code 2 (argparse's convention). Every rank checks the same flags, so rank 0 fails too and
    prints the line; another rank leaves it to rank 0 (``rank_0_reported``)."""
    if rank == 0:
        print(f"{prog}: error: {error}", file=sys.stderr)
    elif not rank_0_reported():
        print(f"{prog}: error (rank {rank}): {error}", file=sys.stderr)
    raise SystemExit(2) from None


def rank_0_reported() -> bool:
    """On a rank other than 0 that found a bad flag: leave the report to rank 0.

    Rank 0 runs the same check on the same flags, fails too and prints the one line. Under
    torchrun this rank must not exit first: torchrun's agent stops every worker (SIGTERM) as
    soon as one exits with an error, which could cut rank 0 off before its line reached stderr.
    So it waits to be stopped. If it is still running after ``RANK_0_REPORT_WAIT_S``, rank 0 did
    not fail (the ranks were given different flags or files) and this rank reports the error
    itself (returns False).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun's worker: nobody cuts rank 0 off
        return True
    time.sleep(RANK_0_REPORT_WAIT_S)
    return False


def init_distributed(device: str) -> tuple[torch.device, int, int]:
    """``(device, rank, world_size)``. Under torchrun (WORLD_SIZE is set) join the process
    group, NCCL on CUDA and gloo on CPU; run as a plain script, be one process without one."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    return device, dist.get_rank(), dist.get_world_size()


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of a small tensor (for logging only)."""
    if not dist.is_initialized():
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def gather_to_all(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

