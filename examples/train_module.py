"""Train any ``nn.Module`` with fzero: a small CNN with BatchNorm on synthetic images.

    python examples/train_module.py                                   # one process
    torchrun --standalone --nproc_per_node=2 examples/train_module.py # 2 data-parallel ranks

``fzero.module.functional(net)`` gives the module's params as a pytree, its buffers, and a pure
``apply(params, buffers, x) -> (logits, new_buffers)`` that casts ``x`` to the params' dtype.
fzero holds the params (FP32 master and moments, 1/N per rank), ``engine.grad_and_value``
differentiates the loss and ``engine.step`` updates.

**Buffers** (BatchNorm's running mean and variance, its batch counter) are not parameters: no
grad, no optimizer state. A forward in training mode updates them from this rank's rows of the
batch; ``apply`` returns them, kept in FP32 as ``torch.autocast`` keeps them. They agree across
ranks the way DDP keeps them (``broadcast_buffers=True``): before each forward every rank takes
rank 0's (``fzero.module.broadcast_buffers``), and once more after the last step, so the trained
module is the same on every rank. The module trained here equals the same module trained with
DDP and ``torch.optim.AdamW`` (``tests/test_train_module.py``; in BF16 against autocast:
``tests/test_module.py``).

At the end ``load_into`` writes the FP32 master weights and the buffers into ``net``: evaluate
it with ``net.eval()``, save it with ``torch.save(net.state_dict(), ...)`` (``--out``).

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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from flags import DTYPES, UsageError, check_batch_size  # noqa: E402
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps: %(default)s")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch, images: %(default)s")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate: %(default)s")
    p.add_argument("--weight-decay", type=float, default=0.01, help="decoupled, every parameter: %(default)s")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="param dtype (fp16: loss scaling): %(default)s")
    p.add_argument("--seed", type=int, default=0, help="%(default)s")
    p.add_argument("--out", metavar="DIR", help="save the trained net's state_dict here (net.pt), at the end")
    p.add_argument("--log-every", type=int, default=20, help="%(default)s")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--log-every", args.log_every)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not args.lr > 0 or not args.weight_decay >= 0:
        p.error("--lr must be > 0 and --weight-decay >= 0")
    return args


def train(args, net: nn.Module, rank: int, world: int):
    """Train ``net``, then write the FP32 master weights and the buffers into it; return
    ``(engine, params, state, losses)``."""
    fm = fzero.module.functional(net)
    tx = transforms.adamw(lr=args.lr, weight_decay=args.weight_decay)
    engine = fzero.zero1(tx, param_dtype=DTYPES[args.dtype], loss_scale="auto", donate=True)
    params, state, scaler_state = engine.init(fm.params)
    buffers = fm.buffers
    mine = rows_of(rank, world, args.batch_size)

    def loss_fn(params, buffers, images, labels):
        logits, buffers = fm.apply(params, buffers, images)
        return F.cross_entropy(logits.float(), labels), buffers

    grad_fn = engine.grad_and_value(loss_fn, has_aux=True)  # scales the loss itself; returns it unscaled
    net.train()
    losses = []
    for step in range(1, args.steps + 1):
        images, labels = batch(step, args.batch_size, args.seed)
        buffers = fzero.module.broadcast_buffers(engine, buffers)  # rank 0's, as DDP before each forward
        grads, (loss, buffers) = grad_fn(params, scaler_state, buffers, images[mine], labels[mine])
        params, state, scaler_state, info = engine.step(params, grads, state, scaler_state)
        losses.append(loss)
        if step % args.log_every == 0 and rank == 0:
            recent = torch.stack(losses[-args.log_every:]).mean().item()
            print(f"step {step}/{args.steps} | loss {recent:.4f} | scale {info['loss_scale'].item():g}", flush=True)
    buffers = fzero.module.broadcast_buffers(engine, buffers)  # the last forward updated each rank's own
    fm.load_into(params, buffers, engine=engine, state=state)
    return engine, params, state, torch.stack(losses)


@torch.no_grad()
def accuracy(net: nn.Module, seed: int) -> float:
    """Accuracy of the trained ``net`` on 512 fresh images, in eval mode (running statistics)."""
    images, labels = batch(10**6, 512, seed)
    return (net.eval()(images).argmax(-1) == labels).float().mean().item()


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
    acc = accuracy(net, args.seed)
    if rank == 0:
        n = sum(p.numel() for p in params.values())
        print(f"\n  {n:,} params ({args.dtype}), {world} rank(s): loss {losses[:10].mean():.4f} -> "
              f"{losses[-10:].mean():.4f}, accuracy {acc:.3f} on fresh images, {time.perf_counter() - t0:.1f} s")
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.out, "net.pt"))
        print(f"  the trained net (FP32 master weights, buffers): {os.path.join(args.out, 'net.pt')}")
    fzero.shutdown()


if __name__ == "__main__":
    main()
