"""Data-parallel recipes side by side on 2-4 gloo ranks (CPU): step time, memory, collectives.

Same nn.Module, same global batch, one run, for each recipe:

* DDP + torch.optim.AdamW (FP32)                      -- the usual baseline
* DDP + torch ZeroRedundancyOptimizer(AdamW) (FP32)   -- torch's ZeRO-1 (whole params per rank)
* fzero stage 1, FP32 params and BF16 params          -- element-wise ZeRO-1, FP32 master
* fzero stage 1 + overlap (FP32)                      -- ``engine.grad_and_value``: reduce-scatter in backward
                                                         (micro-batches before the last: ``no_sync``)
* fzero stage 1 / stage 2 with 2 micro-batches (BF16)  -- gradient accumulation, 4P vs 4P/N buffer
* fzero stage 1 with ``offload="cpu"`` (BF16)          -- (on a CPU box this only shows the cost)

fzero runs the module through ``models.module.functional`` and ``torch.func.grad_and_value``
(or ``engine.grad_and_value`` for the overlapped row).
Per recipe and rank 0: median step time, optimizer-state bytes per param (rank max), bytes held
(params + grads + optimizer state + accumulation buffer), collectives per step and bytes per step
(counted by wrapping the calls: DDP through a comm hook, ZeRO by wrapping ``dist.broadcast``,
fzero through a wrapped table of its collectives, ``fzero.comm.Collectives.wrapped``).

    python benchmarks/comm.py --world-size 2 --model mlp          # the seed's MLP, 25.2M params
    python benchmarks/comm.py --world-size 2 --model gpt
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import itertools
import sys
import tempfile

import optree
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
import fzero.comm  # noqa: E402
from fzero import transforms  # noqa: E402
from common import median_time, table  # noqa: E402
from e2e import ModuleGPT  # noqa: E402
from fzero.models import gpt  # noqa: E402
from fzero.models.module import functional  # noqa: E402


def make_model(name):
    torch.manual_seed(0)
    if name == "mlp":
        dims = (1024, 4096, 4096, 1024)
        layers = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(dims) - 2 else [])
        model = nn.Sequential(*layers)
        return model, lambda m, batch: F.mse_loss(m(batch[0]), batch[1])
    cfg = gpt.GPTConfig.small(vocab_size=256)
    return ModuleGPT(cfg), lambda m, batch: m(*batch)


def make_batch(name, rank, world_size, global_batch, step):
    g = torch.Generator().manual_seed(step)
    if name == "mlp":
        x, y = torch.randn(global_batch, 1024, generator=g), torch.randn(global_batch, 1024, generator=g)
    else:
        x = torch.randint(0, 256, (global_batch, 128), generator=g)
        y = torch.randint(0, 256, (global_batch, 128), generator=g)
    per = global_batch // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def storage_bytes(*trees):
    seen = {}
    for t in optree.tree_leaves(trees):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Counter:
    def __init__(self):
        self.calls = 0
        self.bytes = 0

    def add(self, t):
        self.calls += 1
        self.bytes += t.numel() * t.element_size()


def ddp_recipe(model, loss_fn, zero, counter):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)

    def hook(state, bucket):
        counter.add(bucket.buffer())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        broadcast = dist.broadcast

        def counted(tensor, *a, **k):
            counter.add(tensor)
            return broadcast(tensor, *a, **k)

        dist.broadcast = counted
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def step(batches, eager=True):
        for b in batches:
            loss_fn(ddp, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def held():
        state = opt.optim.state if zero else opt.state
        return storage_bytes(list(state.values())), storage_bytes(list(ddp.parameters()), [p.grad for p in ddp.parameters()])

    return step, held


def counted_comm(counter):
    """The default communicator, counting each collective of an eager call (a traced count would
    run once, while compiling)."""
    def counting(name, fn):
        def call(x, *args):
            if not torch.compiler.is_compiling():
                counter.add(x)
            return fn(x, *args)
        return call

    return fzero.comm.Comm.of(None, collectives=fzero.comm.FUNCTIONAL.wrapped(counting))


def fzero_recipe(model, loss_fn, dtype, counter, overlap=False, compile=True, **kw):
    params32, apply = functional(model)
    engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=dtype, loss_scale=None, group=counted_comm(counter),
                         **kw)
    # the step compiled, as the README recommends on CPU (its eager update is ~40 separate passes)
    engine_step = torch.compile(engine.step, fullgraph=True) if compile else engine.step
    carry = list(engine.init(params32))
    del params32
    module_loss = lambda p, b: loss_fn(lambda *xs: apply(p, *[x.to(dtype) if x.is_floating_point() else x for x in xs]), b)
    # overlap: each bucket's reduce-scatter starts inside backward; else after it, in engine.step
    grad_fn = engine.grad_and_value(module_loss) if overlap else torch.func.grad_and_value(module_loss)
    last = {}

    def step(batches, eager=False):  # eager: for counting collectives (see counted_comm)
        acc = None
        for m, b in enumerate(batches):
            if not overlap:
                grads, _ = grad_fn(carry[0], b)
                acc = grads if len(batches) == 1 else engine.accumulate(acc, grads)
            elif m < len(batches) - 1:  # DDP's no_sync: summed on this rank, nothing communicated
                acc, _ = grad_fn.no_sync(acc, carry[0], carry[2], b)
            else:  # the sum joins the last micro-batch's reduce-scatters, inside backward
                grads, _ = grad_fn.sync(acc, carry[0], carry[2], b)
        last["acc"] = acc if len(batches) > 1 else None
        last["grads"] = grads
        total = grads if overlap else acc
        carry[0], carry[1], carry[2], _ = (engine.step if eager else engine_step)(carry[0], total, carry[1], carry[2])

    def held():
        return engine.state_bytes(carry[1]), storage_bytes(carry[0], last["grads"], last["acc"])

    return step, held


RECIPES = {
    "DDP + AdamW (FP32)": dict(kind="ddp", zero=False),
    "DDP + ZeroRedundancyOptimizer (FP32)": dict(kind="ddp", zero=True),
    "fzero stage 1 (FP32 params)": dict(kind="fzero", dtype=torch.float32),
    "fzero stage 1 + overlap, 8 MiB buckets (FP32)": dict(kind="fzero", dtype=torch.float32, overlap=True,
                                                           bucket_bytes=8 * 2**20),
    "fzero stage 1 (BF16 params)": dict(kind="fzero", dtype=torch.bfloat16),
    "fzero stage 1, 2 micro-batches (BF16)": dict(kind="fzero", dtype=torch.bfloat16, micro=2),
    "fzero stage 2, 2 micro-batches (BF16)": dict(kind="fzero", dtype=torch.bfloat16, micro=2, stage=2),
    "fzero stage 1 + offload cpu (BF16)": dict(kind="fzero", dtype=torch.bfloat16, offload="cpu"),
}


def worker(rank, world_size, rdzv, args, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    rows = []
    for name, spec in RECIPES.items():
        spec = dict(spec)
        torch._dynamo.reset()  # each recipe compiles its own engine.step from scratch
        model, loss_fn = make_model(args.model)
        P = sum(p.numel() for p in model.parameters())
        counter = Counter()
        micro = spec.pop("micro", 1)
        is_fzero = spec.pop("kind") == "fzero"
        if is_fzero:
            step, held = fzero_recipe(model, loss_fn, spec.pop("dtype"), counter, compile=args.compile, **spec)
        else:
            step, held = ddp_recipe(model, loss_fn, spec["zero"], counter)
        batches = lambda i: [make_batch(args.model, rank, world_size * micro, args.batch, i * micro + m)[0:2]
                             for m in range(micro)] if micro > 1 else [make_batch(args.model, rank, world_size, args.batch, i)]
        if micro > 1:  # micro-batch m of rank r: rows of the same global batch
            batches = lambda i: [make_batch(args.model, rank * micro + m, world_size * micro, args.batch, i) for m in range(micro)]
        i = itertools.count()
        seconds = median_time(lambda: step(batches(next(i))), torch.device("cpu"), iters=args.steps,
                              warmup=args.warmup, before=dist.barrier)
        # one more step, eager, counting every collective and its bytes
        counter.calls = counter.bytes = 0
        step(batches(0), eager=True)
        opt_bytes, other = held()
        dist.barrier()
        maxes = [None] * world_size
        dist.all_gather_object(maxes, opt_bytes)
        rows.append({"recipe": name, "P": P, "ms": seconds * 1e3,
                     "opt_B_per_param": max(maxes) / P, "held_GiB": (opt_bytes + other) / 2**30,
                     "calls": counter.calls, "MiB": counter.bytes / 2**20})
        dist.broadcast = orig_broadcast
        del step, held, model
    if rank == 0:
        torch.save(rows, out_path)
    dist.destroy_process_group()


orig_broadcast = dist.broadcast  # unwrapped: ZeroRedundancyOptimizer's count wraps it


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile fzero's engine.step (forward/backward stay eager, as for DDP)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(worker, args=(args.world_size, os.path.join(tmp, "rdzv"), args, out), nprocs=args.world_size)
        rows = torch.load(out, weights_only=True)
    print(f"\n{args.model}: {rows[0]['P'] / 1e6:.1f}M params, {args.world_size} gloo ranks on CPU (1 thread each), "
          f"global batch {args.batch}, median of {args.steps} steps; "
          f"fzero step {'compiled' if args.compile else 'eager'}\n")
    base = rows[0]["ms"]
    print(table([[r["recipe"], f"{r['ms']:.0f}", f"{r['ms'] / base:.2f}", f"{r['opt_B_per_param']:.2f}",
                  f"{r['held_GiB']:.3f}", f"{r['calls']:.0f}", f"{r['MiB']:.1f}"] for r in rows],
                ["recipe", "ms/step", "x DDP", "opt state B/param (max rank)", "held GiB (rank 0)",
                 "collectives/step", "MiB sent/step (rank 0)"]))
    return rows


if __name__ == "__main__":
    main()
