"""Does fzero overlap the grads' reduce-scatter with backward? Measured side by side.

A GPT on N gloo ranks, ``bucket_bytes`` buckets, eager. Each timed iteration runs, in turn,
on the same params and batch:

* ``backward only``: ``torch.func.grad_and_value``, no communication (the compute floor);
* ``reduce in step``: the same grads, reduce-scattered in ``engine.step`` after backward;
* ``grad_and_value, overlap=False``: reduce-scatter per bucket inside backward, each waited at once;
* ``grad_and_value, overlap=True``: the same collectives, left in flight until backward ends.

It prints median milliseconds of forward+backward(+reduce-scatter) and of the whole step
(+ ``engine.step``), and the share of the reduce-scatter time that overlap hides. Rank 0 writes
a Chrome trace of two overlapped steps to ``--trace`` (the ``gloo:`` events on the gloo
threads run beside the ``autograd::engine`` events on the main thread).

``--compiled`` adds the other mechanism: the whole train step (forward, backward,
``engine.step``) as one ``torch.compile`` graph, inductor's compute/communication reordering
off and on (``torch._inductor.config.reorder_for_compute_comm_overlap``).

    python benchmarks/overlap.py --world-size 2 [--compiled]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from common import median_time, sample_times  # noqa: E402
from fzero.models import gpt  # noqa: E402

EAGER = ("backward only", "reduce in step", "grad_and_value, overlap=False", "grad_and_value, overlap=True")


def setup(rank, world_size, rdzv, args):
    torch.set_num_threads(1)  # N ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10))
    cfg = gpt.GPTConfig(256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=torch.float32, loss_scale=None,
                         bucket_bytes=int(args.bucket_mb * 2**20), donate=True)
    params, state, ss = engine.init(gpt.init(torch.Generator().manual_seed(0), cfg))
    g = torch.Generator().manual_seed(rank)
    batch = tuple(torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2))
    return engine, params, state, ss, functools.partial(gpt.loss, config=cfg), batch


def eager_worker(rank, world_size, rdzv, args, out):
    engine, params, state, ss, loss_fn, batch = setup(rank, world_size, rdzv, args)
    grad_fns = {
        "backward only": lambda p, ss: torch.func.grad_and_value(loss_fn)(p, batch),  # no loss scale (FP32)
        "reduce in step": lambda p, ss: torch.func.grad_and_value(loss_fn)(p, batch),
        "grad_and_value, overlap=False": lambda p, ss: engine.grad_and_value(loss_fn, overlap=False)(p, ss, batch),
        "grad_and_value, overlap=True": lambda p, ss: engine.grad_and_value(loss_fn, overlap=True)(p, ss, batch),
    }
    grad_s = {m: [] for m in EAGER}  # the forward+backward part of each run, warm-up runs first

    def one(mode):
        nonlocal params, state, ss
        t0 = time.perf_counter()
        grads, _ = grad_fns[mode](params, ss)
        grad_s[mode].append(time.perf_counter() - t0)
        if mode != "backward only":
            params, state, ss, _ = engine.step(params, grads, state, ss)

    # interleaved: drift in machine load hits every mode alike
    step_s = sample_times({m: functools.partial(one, m) for m in EAGER}, torch.device("cpu"), iters=args.steps,
                          warmup=args.warmup, before=dist.barrier)
    res = {m: (statistics.median(grad_s[m][args.warmup:]) * 1e3, statistics.median(step_s[m]) * 1e3) for m in EAGER}
    if args.trace:
        with torch.profiler.profile() as prof:
            for _ in range(2):
                dist.barrier()
                one("grad_and_value, overlap=True")
        if rank == 0:
            prof.export_chrome_trace(args.trace)
    if rank == 0:
        torch.save({"ms": res, "buckets": len(engine.layout.buckets), "P": engine.layout.numel}, out)
    dist.destroy_process_group()


def compiled_worker(rank, world_size, rdzv, args, reorder, out):
    torch._inductor.config.reorder_for_compute_comm_overlap = reorder
    engine, params, state, ss, loss_fn, batch = setup(rank, world_size, rdzv, args)

    def train_step(params, state, ss, batch):
        grads, loss = torch.func.grad_and_value(lambda p: loss_fn(p, batch))(params)
        return engine.step(params, grads, state, ss)

    step = torch.compile(train_step, fullgraph=True)

    def run():
        nonlocal params, state, ss
        params, state, ss, _ = step(params, state, ss, batch)

    seconds = median_time(run, torch.device("cpu"), iters=args.steps, warmup=args.warmup, before=dist.barrier)
    if rank == 0:
        torch.save({"ms": seconds * 1e3}, out)
    dist.destroy_process_group()


def spawn(worker, world_size, *args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pt")
        mp.spawn(worker, args=(world_size, os.path.join(tmp, "rdzv"), *args, out), nprocs=world_size)
        return torch.load(out, weights_only=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="per rank")
    ap.add_argument("--bucket-mb", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="also the whole step compiled, reordering off/on")
    ap.add_argument("--trace", default="benchmarks/results/overlap_trace_rank0.json", help="'' for none")
    args = ap.parse_args(argv)

    r = spawn(eager_worker, args.world_size, args)
    ms = r["ms"]
    print(f"\nGPT {r['P'] / 1e6:.2f}M params (FP32 grads, {4 * r['P'] / 2**20:.0f} MiB), {r['buckets']} buckets, "
          f"{args.world_size} gloo ranks, batch {args.batch}x{args.seq} per rank, eager, "
          f"median of {args.steps} interleaved iterations, {datetime.date.today()}")
    print(f"  {'':34s} {'fwd+bwd(+RS) ms':>16s} {'whole step ms':>14s}")
    for m in EAGER:
        print(f"  {m:34s} {ms[m][0]:16.1f} {ms[m][1] if m != 'backward only' else float('nan'):14.1f}")
    floor, sync, over = ms["backward only"][0], ms["grad_and_value, overlap=False"][0], ms["grad_and_value, overlap=True"][0]
    print(f"  reduce-scatter cost beyond backward: waited {sync - floor:.1f} ms, overlapped {over - floor:.1f} ms "
          f"({(sync - over) / max(sync - floor, 1e-9):.0%} hidden)")
    whole = {m: ms[m][1] for m in EAGER[1:]}
    print(f"  whole step, overlapped / reduced in step: {whole[EAGER[3]] / whole[EAGER[1]]:.3f}x; "
          f"overlapped / waited in backward: {whole[EAGER[3]] / whole[EAGER[2]]:.3f}x")
    if args.trace:
        print(f"  trace (rank 0, two overlapped steps): {args.trace}")
    if args.compiled:
        off = spawn(compiled_worker, args.world_size, args, False)["ms"]
        on = spawn(compiled_worker, args.world_size, args, True)["ms"]
        print(f"  whole step compiled, inductor reordering off: {off:.1f} ms, on: {on:.1f} ms ({off / on:.2f}x)")


if __name__ == "__main__":
    main()
