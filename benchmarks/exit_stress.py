"""Exit-time stress: many short two-rank torchrun jobs that train a few steps and exit.

Each job runs this file under ``torchrun --nproc_per_node=2`` with ``--child``: gloo on CPU,
an MLP engine with buckets, a few steps with grads from ``torch.func.grad_and_value`` and from
``engine.grad_and_value``, then the job ends one of three ways:

* ``plain``: the script just ends (fzero's exit hook shuts the process group down);
* ``destroy``: ``torch.distributed.destroy_process_group()`` while the engine is still alive;
* ``shutdown``: ``fzero.shutdown()`` (barrier + destroy + a check that the backend is gone).

A job passes when both ranks exit with code 0; a rank that dies of a signal (SIGABRT:
``terminate called without an active exception``) fails it. ``--jobs`` runs jobs side by side
(more contention for the 2 cores of a small CI box, where the abort showed up)::

    python benchmarks/exit_stress.py --runs 50 --jobs 2      # 50 jobs per ending, 150 in all
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import sys
import time

ENDINGS = ("plain", "destroy", "shutdown")


def child(ending: str) -> None:
    import torch
    import torch.distributed as dist

    import fzero  # before init_process_group, as the README shows
    from fzero import transforms
    from fzero.models import mlp

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    engine = fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float16, bucket_bytes=4096)
    params, state, ss = engine.init(mlp.init(torch.Generator().manual_seed(0), (16, 64, 64, 4)))
    overlapped = engine.grad_and_value(mlp.loss)  # scales the loss itself
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        batch = (torch.randn(8, 16, generator=g).half(), torch.randn(8, 4, generator=g).half())
        if step % 2:
            grads, _ = overlapped(params, ss, batch)
        else:
            grads, _ = torch.func.grad_and_value(lambda p: fzero.scale_loss(mlp.loss(p, batch), ss))(params)
        params, state, ss, info = engine.step(params, grads, state, ss)
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "shutdown":
        fzero.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(ending: str) -> tuple[str, int, str]:
    """One two-rank torchrun job: ``(ending, return code, the lines naming a failure)``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.abspath(__file__), "--child", ending]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    why = [line for line in text.splitlines() if "terminate" in line or "exitcode" in line or "Error" in line]
    return ending, out.returncode, " | ".join(why[:3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="jobs per ending: %(default)s")
    p.add_argument("--jobs", type=int, default=2, help="jobs running side by side: %(default)s")
    p.add_argument("--endings", default=",".join(ENDINGS), help="comma-separated subset of %(default)s")
    p.add_argument("--child", metavar="ENDING", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    endings = args.endings.split(",")
    todo = [e for _ in range(args.runs) for e in endings]  # interleaved: same conditions for each ending
    failed = {e: [] for e in endings}
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for ending, rc, why in pool.map(job, todo):
            if rc != 0:
                failed[ending].append(f"rc={rc} {why}")
                print(f"{ending}: job failed: rc={rc} {why}", flush=True)
    print(f"\n{'ending':<10} {'jobs':>5} {'failed':>7}")
    for e in endings:
        print(f"{e:<10} {args.runs:>5} {len(failed[e]):>7}")
    n_failed = sum(len(v) for v in failed.values())
    print(f"({time.perf_counter() - start:.0f} s, {args.jobs} jobs side by side)")
    print(f"{len(todo) - n_failed} passed, {n_failed} failed")
    sys.exit(1 if n_failed else 0)


if __name__ == "__main__":
    main()
