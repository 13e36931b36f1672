"""gloo's reduce-scatter and all-gather against the table fzero issues on gloo, side by side.

``fzero.comm.collectives.over_all_reduce`` builds the reduce-scatter from one all-reduce (each
rank keeps its slice) and the all-gather from N broadcasts (rank ``i``'s shard from rank ``i``),
both through torch's functional collectives as the step issues them. This script times them
against the functional collectives that call gloo's own reduce-scatter and all-gather, on one
FP32 bucket of ``--numel`` elements (the 10.8M of ``e2e.py``'s ``small`` GPT by default),
alternating the two in each round; ms is the median over the rounds, measured on rank 0 after
a barrier.

    python benchmarks/collectives.py                    # 2 gloo ranks on CPU
    python benchmarks/collectives.py --ranks 4 --numel 1e6
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero.comm.collectives import FUNCTIONAL, over_all_reduce  # noqa: E402
from common import table  # noqa: E402


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        funcol.wait_tensor(fn())
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def child(args):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    n = int(args.numel) // world * world
    full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    shard = full[: n // world].clone()
    tables = {"gloo's own (functional collectives)": FUNCTIONAL, "fzero on gloo (over_all_reduce)": over_all_reduce(rank, world)}
    ops = {
        "reduce-scatter": lambda t: t.reduce_scatter(full, "sum", 0, group),
        "all-gather": lambda t: t.all_gather(shard, 0, group),
    }
    rows = []
    for op, call in ops.items():
        want = None
        ms = {}
        for name, t in tables.items():  # the results must agree bit for bit before they are timed
            got = funcol.wait_tensor(call(t))
            assert want is None or torch.equal(got, want), f"{op}: {name} differs"
            want = got
        samples = {name: [] for name in tables}
        for _ in range(args.rounds):  # alternate: drift hits both
            for name, t in tables.items():
                samples[name] += timed(lambda: call(t), 1)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        base = ms["gloo's own (functional collectives)"]
        rows += [[op, name, f"{v:.1f}", f"{base / v:.2f}"] for name, v in ms.items()]
    if rank == 0:
        print(f"\n{n:.3g} FP32 elements ({n * 4 / 2**20:.0f} MiB) on {world} gloo ranks, torch {torch.__version__}; "
              f"median of {args.rounds} alternating rounds\n")
        print(table(rows, ["collective", "implementation", "ms", "speed-up"]))
    fzero.shutdown()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=10_783_104)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--child"]
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
