"""Skipped steps from a high initial loss scale: fzero with FP16 params against
``torch.autocast(float16)`` + ``torch.amp.GradScaler`` on the same net, data and schedule.

With FP16 params fzero's param grads are FP16 (largest finite 65504); under autocast the params
and their grads stay FP32 and only the activations' grads are FP16. From the same large initial
scale, fzero therefore finds an inf at scales where GradScaler's FP32 param grads still fit, and
halves its way down in a few more skipped steps; after that both train alike. The script prints,
per initial scale, the steps each skipped and the scale each settled at.

Both sides: ``TokenNet`` (an embedding, a LayerNorm, an MLP, a head at every position; 64 x 64
tokens a batch), cross-entropy, AdamW lr 1e-3, ``growth_interval`` 2000 (no growth within the run),
backoff 0.5, one process, CPU.

    python benchmarks/overflow.py                       # initial scales 2^16, 2^20, 2^24, 2^28
    python benchmarks/overflow.py --scales 24 --steps 40
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from common import hardware  # noqa: E402


class TokenNet(nn.Module):
    """Token embeddings, a LayerNorm, an MLP and a head over every position: the embedding and
    the LayerNorm are the modules autocast runs in FP32 (their grads FP32, sums over every
    token), the linear layers the ones it runs in FP16."""

    def __init__(self, vocab: int = 256, dim: int = 64):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.norm(h + self.mlp(h)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return TokenNet()


def batch(step: int):
    """A batch of 64 x 64 tokens; each position predicts the next token."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(256, (64, 65), generator=g)
    return ids[:, :-1], ids[:, 1:]


def cross_entropy(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def fzero_skips(model: nn.Module, scale: float, steps: int) -> tuple[int, float]:
    fm = fzero.module.functional(model)
    engine = fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(init_scale=scale, max_scale=max(scale, 2.0**24)))
    params, state, ss = engine.init(fm.params)
    buffers, skipped = fm.buffers, 0

    def loss_fn(p, b, x, y):
        out, b = fm.apply(p, b, x)
        return cross_entropy(out, y), b

    grad_fn = engine.grad_and_value(loss_fn, has_aux=True)
    for step in range(steps):
        grads, (_, buffers) = grad_fn(params, ss, buffers, *batch(step))
        params, state, ss, info = engine.step(params, grads, state, ss)
        skipped += int(info["found_inf"])
    return skipped, float(ss.scale)


def autocast_skips(model: nn.Module, scale: float, steps: int) -> tuple[int, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2000)
    skipped = 0
    for step in range(steps):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        opt.zero_grad()
        scaler.scale(cross_entropy(out, y)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.get_scale() < before)
    return skipped, float(scaler.get_scale())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=int, nargs="+", default=[16, 20, 24, 28], help="initial scales, as powers of two")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    print(hardware(torch.device("cpu")))
    print(f"steps: {args.steps}; skipped steps and the scale at the end, per initial scale")
    print(f"{'initial scale':>13} | {'fzero, FP16 params':>24} | {'autocast + GradScaler':>24}")
    for power in args.scales:
        base = net()
        ours = fzero_skips(copy.deepcopy(base), 2.0**power, args.steps)
        theirs = autocast_skips(copy.deepcopy(base), 2.0**power, args.steps)
        row = [f"{n} skipped, 2^{math.log2(s):g}" for n, s in (ours, theirs)]
        print(f"{'2^' + str(power):>13} | {row[0]:>24} | {row[1]:>24}")

if __name__ == "__main__":
    main()
