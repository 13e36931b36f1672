"""gloo's reduce-scatter and all-gather against the table fzero issues on gloo, side by side.

``fzero.comm.collectives.over_all_reduce`` builds the reduce-scatter from one all-reduce (each
rank keeps its slice) and the all-gather from N broadcasts (rank ``i``'s shard from rank ``i``),
both through torch's functional collectives as the step issues them. This script times them
against the functional collectives that call gloo's own reduce-scatter and all-gather, on one
FP32 bucket of ``--numel`` elements (the 10.8M of ``e2e.py``'s ``small`` GPT by default),
alternating the two in each round; ms is the median over the rounds, measured on rank 0 after
a barrier; the reduce-scatter also as ``Comm`` issues it for grads summed wider than they
travel (an all-to-all, each rank summing the pieces of its shard: ``sum_received``). Third:
BF16 grads summed in FP32: gloo's own reduce-scatter of an FP32 copy (NCCL's form, and
``wire_dtype=torch.float32``'s on NCCL), fzero's all-reduce of that copy (``wire_dtype=torch.float32``
on gloo), and the all-to-all of the BF16 grads, each rank summing its shard in FP32 (the default).

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
from fzero.comm.collectives import FUNCTIONAL, completed, over_all_reduce, sum_received  # noqa: E402
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
    # integers: their sums are exact in any order, so every form must agree bit for bit
    full = torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(rank)).float()
    shard = full[: n // world].clone()
    low = full.bfloat16()  # BF16 grads
    own, fz = FUNCTIONAL, over_all_reduce(rank, world)

    def summed_where_it_lands(x):  # Comm.reduce_scatter_bucket(x, ..., dtype=torch.float32)
        return sum_received(completed(fz.all_to_all(x, None, None, group)), world, torch.float32)

    ops = {  # op -> implementation -> call; the first is the baseline of the speed-up column
        "reduce-scatter": {"gloo's own (functional collectives)": lambda: own.reduce_scatter(full, "sum", 0, group),
                           "fzero on gloo (over_all_reduce)": lambda: fz.reduce_scatter(full, "sum", 0, group),
                           "fzero on gloo: all-to-all, summed": lambda: summed_where_it_lands(full)},
        "all-gather": {"gloo's own (functional collectives)": lambda: own.all_gather(shard, 0, group),
                       "fzero on gloo (over_all_reduce)": lambda: fz.all_gather(shard, 0, group)},
        "reduce-scatter of BF16 grads, summed in FP32": {
            "gloo's own, of an FP32 copy": lambda: own.reduce_scatter(low.float(), "sum", 0, group),
            "fzero's all-reduce of an FP32 copy": lambda: fz.reduce_scatter(low.float(), "sum", 0, group),
            "fzero: all-to-all in BF16, summed in FP32": lambda: summed_where_it_lands(low)},
    }
    rows = []
    for op, impls in ops.items():
        want = None
        for name, call in impls.items():  # the results must agree bit for bit before they are timed
            got = funcol.wait_tensor(call())
            assert want is None or torch.equal(got, want), f"{op}: {name} differs"
            want = got
        samples = {name: [] for name in impls}
        for _ in range(args.rounds):  # alternate: drift hits all
            for name, call in impls.items():
                samples[name] += timed(call, 1)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        base = next(iter(ms.values()))
        rows += [[op, name, f"{v:.1f}", f"{base / v:.2f}"] for name, v in ms.items()]
    if rank == 0:
        print(f"\n{n:.3g} elements ({n * 4 / 2**20:.0f} MiB in FP32, {n * 2 / 2**20:.0f} MiB in BF16) on {world} gloo "
              f"ranks, torch {torch.__version__}; median of {args.rounds} alternating rounds\n")
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
