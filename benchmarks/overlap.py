"""Does inductor overlap fzero's per-bucket reduce-scatters with backward? Measured side by side.

The whole train step -- forward, backward and ``engine.step`` with ``bucket_bytes`` -- is one
``torch.compile(fullgraph=True)`` graph; each bucket's flat grad buffer depends only on its own
grads, so its reduce-scatter may start while backward still runs. Run twice on N gloo ranks:
with inductor's compute/communication reordering off, and on
(``torch._inductor.config.reorder_for_compute_comm_overlap``). Prints median step times and
writes a Chrome trace of the reordered run to ``--trace`` (rank 0).

    python benchmarks/overlap.py --world-size 2
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
import transforms  # noqa: E402
from models import gpt  # noqa: E402


def worker(rank, world_size, rdzv, args, reorder, out):
    torch.set_num_threads(1)
    torch._inductor.config.reorder_for_compute_comm_overlap = reorder
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10))
    cfg = gpt.GPTConfig(256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=torch.float32, loss_scale=None,
                         bucket_bytes=args.bucket_mb * 2**20, donate=True)
    params, state, ss = engine.init(gpt.init(torch.Generator().manual_seed(0), cfg))
    loss_fn = functools.partial(gpt.loss, config=cfg)

    def train_step(params, state, ss, batch):
        grads, loss = torch.func.grad_and_value(lambda p: loss_fn(p, batch))(params)
        return engine.step(params, grads, state, ss)

    step = torch.compile(train_step, fullgraph=True)
    g = torch.Generator().manual_seed(rank)
    batch = tuple(torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2))
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        params, state, ss, _ = step(params, state, ss, batch)
        times.append(time.perf_counter() - t0)
    if reorder and args.trace and rank == 0:
        with torch.profiler.profile() as prof:
            for _ in range(2):
                params, state, ss, _ = step(params, state, ss, batch)
        prof.export_chrome_trace(args.trace)
    elif reorder and args.trace:
        for _ in range(2):
            params, state, ss, _ = step(params, state, ss, batch)
    if rank == 0:
        torch.save({"ms": statistics.median(times[args.warmup:]) * 1e3, "buckets": len(engine.layout.buckets),
                    "P": engine.layout.numel}, out)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trace", default="benchmarks/results/overlap_trace_rank0.json")
    args = ap.parse_args(argv)
    res = {}
    for reorder in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "res.pt")
            mp.spawn(worker, args=(args.world_size, os.path.join(tmp, "rdzv"), args, reorder, out), nprocs=args.world_size)
            res[reorder] = torch.load(out, weights_only=True)
    r0 = res[False]
    print(f"\nGPT {r0['P'] / 1e6:.2f}M params (FP32), {r0['buckets']} buckets, {args.world_size} gloo ranks, "
          f"batch {args.batch}x{args.seq} per rank, whole train step compiled, median of {args.steps}")
    print(f"  reordering off: {res[False]['ms']:.1f} ms/step")
    print(f"  reordering on:  {res[True]['ms']:.1f} ms/step  ({res[False]['ms'] / res[True]['ms']:.2f}x)")
    if args.trace:
        print(f"  trace: {args.trace}")


if __name__ == "__main__":
    main()
