"""Train any ``nn.Module`` with fzero: a small CNN with BatchNorm on synthetic images.

    python examples/train_module.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/train_module.py # 2 data-parallel ranks

The module stays an ``nn.Module``; ``models.module.functional(net)`` gives its parameters as a
pytree and ``apply(params, x) == net(x)``. fzero holds the params (FP32 master and moments, 1/N
per rank), ``engine.grad_and_value`` differentiates ``apply`` and ``engine.step`` updates.

**Buffers** (BatchNorm's running mean and variance, its batch counter) are not parameters: no
grad, no optimizer state. A forward in training mode updates them *in place*, from this rank's
rows of the batch. They are kept identical across ranks the way DDP keeps them
(``broadcast_buffers=True``): before each forward, rank 0's buffers are broadcast to every rank
(one collective per buffer dtype), and once more after the last step, so the trained module is the
same on every rank. So the module trained here equals the same module trained with
DDP and ``torch.optim.AdamW``, buffers included (``tests/test_train_module.py``). Evaluation
uses the running statistics (``net.eval()``).

At the end ``fzero.checkpoint.export_full`` writes the FP32 master weights, which load into the
module with ``load_state_dict(..., strict=False)`` (the buffers are the module's own: save them
with ``net.state_dict()`` if you need them).

The data ship with the script: 16x16 single-channel images of 4 classes (a bar at one of four
orientations, plus noise), made from a fixed seed.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fzero  # noqa: E402
import fzero.checkpoint  # noqa: E402
import transforms  # noqa: E402
from flags import DTYPES, UsageError, check_batch_size  # noqa: E402
from models.module import functional  # noqa: E402
from ranks import exit_usage, init_distributed, launched, rows_of  # noqa: E402

CLASSES, SIDE = 4, 16


def make_net() -> nn.Module:
    """A small CNN built from torch's own modules: conv -> BatchNorm -> ReLU, twice, then a
    linear classifier. The convs have no bias: the BatchNorm after them removes it (its grad
    would be zero up to rounding, and Adam would turn that rounding into full-size steps)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES),
    )


def batch(step: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` images ``[size, 1, 16, 16]`` and labels ``[size]``: a bar through the centre at
    0, 45, 90 or 135 degrees (the label), plus Gaussian noise; the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    labels = torch.randint(CLASSES, (size,), generator=g)
    coords = torch.arange(SIDE) - (SIDE - 1) / 2
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    angles = labels.float() * math.pi / CLASSES
    distance = (x * torch.sin(angles)[:, None, None] - y * torch.cos(angles)[:, None, None]).abs()
    images = (distance < 1.5).float() + 0.5 * torch.randn(size, SIDE, SIDE, generator=g)
    return images[:, None], labels


def sync_buffers(buffers: dict[str, torch.Tensor]) -> None:
    """Rank 0's buffers on every rank, in place (DDP's ``broadcast_buffers``): one broadcast of
    all of them, packed by dtype."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers.values():
        by_dtype.setdefault(b.dtype, []).append(b)
    for same in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in same])
        dist.broadcast(flat, src=0)
        pos = 0
        for b in same:
            b.copy_(flat[pos : pos + b.numel()].view_as(b))
            pos += b.numel()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps: %(default)s")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch, images: %(default)s")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate: %(default)s")
    p.add_argument("--weight-decay", type=float, default=0.01, help="decoupled, every parameter: %(default)s")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="param dtype (fp16: loss scaling): %(default)s")
    p.add_argument("--seed", type=int, default=0, help="%(default)s")
    p.add_argument("--out", metavar="DIR", help="write the FP32 master weights here (export_full), at the end")
    p.add_argument("--log-every", type=int, default=20, help="%(default)s")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--log-every", args.log_every)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not args.lr > 0 or not args.weight_decay >= 0:
        p.error("--lr must be > 0 and --weight-decay >= 0")
    return args


def train(args, net: nn.Module, rank: int, world: int):
    """Train ``net`` (its buffers in place); return ``(engine, params, state, losses)``."""
    dtype = DTYPES[args.dtype]
    params_fp32, apply = functional(net)
    buffers = dict(net.named_buffers())  # the tensors apply uses: updated in place by each forward
    tx = transforms.adamw(lr=args.lr, weight_decay=args.weight_decay)
    engine = fzero.zero1(tx, param_dtype=dtype, loss_scale="auto", donate=True)
    params, state, scaler_state = engine.init(params_fp32)
    # The module runs in the param dtype, its floating buffers too (torch's batch_norm takes
    # running stats in the input's dtype); they are updated in place, so cast them in place.
    for b in buffers.values():
        if b.is_floating_point():
            b.data = b.data.to(dtype)
    mine = rows_of(rank, world, args.batch_size)

    def loss_fn(params, images, labels):
        logits = apply(params, images.to(dtype))
        return F.cross_entropy(logits.float(), labels)

    grad_fn = engine.grad_and_value(loss_fn)
    net.train()
    losses = []
    for step in range(1, args.steps + 1):
        images, labels = batch(step, args.batch_size, args.seed)
        sync_buffers(buffers)  # rank 0's running stats, as DDP does before each forward
        grads, loss = grad_fn(params, scaler_state, images[mine], labels[mine])
        params, state, scaler_state, info = engine.step(params, grads, state, scaler_state)
        losses.append(loss)
        if step % args.log_every == 0 and rank == 0:
            recent = torch.stack(losses[-args.log_every:]).mean().item()
            print(f"step {step}/{args.steps} | loss {recent:.4f} | scale {info['loss_scale'].item():g}", flush=True)
    sync_buffers(buffers)  # the last forward updated each rank's own: leave them all as rank 0's
    return engine, params, state, torch.stack(losses)


@torch.no_grad()
def accuracy(net: nn.Module, params, apply_dtype: torch.dtype, seed: int) -> float:
    """Accuracy on 512 fresh images, in eval mode (running statistics)."""
    _, apply = functional(net)
    images, labels = batch(10**6, 512, seed)
    net.eval()
    correct = (apply(params, images.to(apply_dtype)).argmax(-1) == labels).float().mean().item()
    net.train()
    return correct


def main(argv=None):
    args = parse_args(argv)
    world, rank = launched()
    try:
        check_batch_size(args.batch_size, world)
    except UsageError as e:
        exit_usage("train_module.py", e, rank)
    init_distributed("cpu")  # under torchrun: join the gloo group
    torch.manual_seed(args.seed)
    net = make_net()
    t0 = time.perf_counter()
    engine, params, state, losses = train(args, net, rank, world)
    acc = accuracy(net, params, DTYPES[args.dtype], args.seed)
    if rank == 0:
        n = sum(p.numel() for p in params.values())
        print(f"\n  {n:,} params ({args.dtype}), {world} rank(s): loss {losses[:10].mean():.4f} -> "
              f"{losses[-10:].mean():.4f}, accuracy {acc:.3f} on fresh images, {time.perf_counter() - t0:.1f} s")
    if args.out:
        fzero.checkpoint.export_full(os.path.join(args.out, "master.safetensors"), state, engine)
        if rank == 0:
            print(f"  FP32 master weights: {os.path.join(args.out, 'master.safetensors')}")
    fzero.shutdown()


if __name__ == "__main__":
    main()
