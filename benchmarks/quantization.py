"""Which 8-bit map for AdamW's moments: the final val loss of the main job's model when the
moments are stored on each candidate map, against FP32 moments, 3 seeds.

AdamW (betas 0.9, 0.99, weight decay 0.1, warmup then cosine, as ``examples/train.py``) on the
nano GPT and the embedded text, one process, FP32 params, written out here as plain tensor
math so that only the moments' storage differs between rows: after every update each moment is
stored (rounded to BF16, or quantized to 8 bits in blocks of 256 with the block's largest
magnitude as scale) and read back for the next step. ``--direction new`` (default): the step's
own direction uses the unrounded new moments, as ``transforms.scale_by_adam`` does;
``--direction stored``: it uses the stored ones, so that every direction carries the storage
error (a harsher test of a map). Rows:

* ``fp32``, ``bf16``: the moments stored in FP32 (the reference) or BF16;
* ``fzero``: ``transforms.quantize`` itself -- the first moment on ``sign(c) (c/127)^2``, the
  second on ``((c+1)/256)^4`` (no 0);
* ``dynamic``: bitsandbytes' dynamic-tree map for both (signed and unsigned; the map torchao's
  ``AdamW8bit`` uses), codes to the nearest value;
* ``pow2/pow4``: fzero's first-moment map, and ``(c/255)^4`` for the second (with a 0);
* ``pow2/pow2``: ``(c/255)^2`` for the second moment (a square-root map, with a 0).

    python benchmarks/quantization.py                       # lr 3e-3 (the main job's) and 1e-2, 600 steps
    python benchmarks/quantization.py --direction stored
    python benchmarks/quantization.py --lrs 3e-3 --steps 200 --rows fp32 fzero
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import optree
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from common import table  # noqa: E402
from data import CharCorpus  # noqa: E402
from fzero.models import gpt  # noqa: E402
from fzero.transforms import quantize as Q  # noqa: E402


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic-tree map (``create_dynamic_map``, 7 exponent bits, 8 bits in all;
    the values torchao's AdamW8bit builds), sorted: each decade 10^-7..1 split linearly, finer
    toward 1, and 0 and 1."""
    values = []
    for i in range(7):
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        edges = torch.linspace(0.1, 1, n, dtype=torch.float64)
        means = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += means + ([-x for x in means] if signed else [])
    values += [0.0, 1.0]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``[blocks, 256]`` (zero-padded) and each block's largest magnitude."""
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % Q.BLOCK)).view(-1, Q.BLOCK)
    return flat, flat.abs().amax(1, keepdim=True)


def stored_on_table(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``x`` stored on a table of 256 values (nearest), per block of 256, read back."""
    rows, scale = blocks(x)
    y = rows / scale.clamp_min(1e-30)
    codes = torch.bucketize(y, (values[1:] + values[:-1]) / 2)
    return (values[codes] * scale).reshape(-1)[: x.numel()].view_as(x)


def stored_on_power(x: torch.Tensor, p: int) -> torch.Tensor:
    """A non-negative ``x`` stored on ``(c/255)^p`` (nearest in the ``y^(1/p)`` domain), read back."""
    rows, scale = blocks(x)
    c = torch.round(255 * (rows / scale.clamp_min(1e-30)) ** (1 / p))
    return ((c / 255) ** p * scale).reshape(-1)[: x.numel()].view_as(x)


def fzero_stored(x: torch.Tensor, signed: bool) -> torch.Tensor:
    return Q.dequantize(Q.quantize(x, signed=signed))


SIGNED, UNSIGNED = dynamic_map(True), dynamic_map(False)
ROWS = {  # name: (store the first moment, store the second moment); None: FP32
    "fp32": None,
    "bf16": (lambda m: m.bfloat16().float(), lambda v: v.bfloat16().float()),
    "fzero": (lambda m: fzero_stored(m, True), lambda v: fzero_stored(v, False)),
    "dynamic": (lambda m: stored_on_table(m, SIGNED), lambda v: stored_on_table(v, UNSIGNED)),
    "pow2/pow4": (lambda m: fzero_stored(m, True), lambda v: stored_on_power(v, 4)),
    "pow2/pow2": (lambda m: fzero_stored(m, True), lambda v: stored_on_power(v, 2)),
}


def train(row: str, *, steps: int, lr: float, seed: int, stored_direction: bool = False) -> float:
    """Final val loss (mean of 20 batches) of AdamW with the moments stored as ``row`` says;
    ``stored_direction``: each step's direction from the stored moments."""
    store = ROWS[row]
    data = CharCorpus.from_stdlib(64)
    config = gpt.GPTConfig(data.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64)
    params = gpt.init(torch.Generator().manual_seed(seed), config)
    loss_fn = functools.partial(gpt.loss, config=config)
    grad_fn = torch.func.grad(loss_fn)
    m = optree.tree_map(torch.zeros_like, params)
    v = optree.tree_map(torch.zeros_like, params)
    b1, b2, eps, wd, warmup = 0.9, 0.99, 1e-8, 0.1, 30
    for t in range(1, steps + 1):
        progress = min(1.0, max(0, t - warmup) / max(1, steps - warmup))
        lr_t = lr * min(1.0, t / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        grads = grad_fn(params, data.get_batch("train", t, 16, seed))

        def update(p, g, m, v):
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            kept = (m, v) if store is None else (store[0](m), store[1](v))
            m, v = kept if stored_direction else (m, v)
            u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
            return p * (1 - lr_t * wd) - lr_t * u, *kept

        spec = optree.tree_structure(params)
        out = spec.flatten_up_to(optree.tree_map(update, params, grads, m, v))
        params, m, v = (spec.unflatten(list(x)) for x in zip(*out))
    with torch.no_grad():
        return sum(loss_fn(params, data.get_batch("val", 10_000 + i, 16, 0)).item() for i in range(20)) / 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--direction", choices=("new", "stored"), default="new",
                    help="each step's direction from the unrounded new moments (as fzero) or the stored ones")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    out = []
    for lr in args.lrs:
        ref = None
        for row in args.rows:
            vals = [train(row, steps=args.steps, lr=lr, seed=s, stored_direction=args.direction == "stored")
                    for s in args.seeds]
            mean = sum(vals) / len(vals)
            ref = mean if row == "fp32" else ref
            vs = "-" if ref is None or row == "fp32" else f"{100 * (mean / ref - 1):+.2f}%"
            out.append([f"{lr:g}", row, f"{mean:.4f}", vs, ", ".join(f"{x:.4f}" for x in vals)])
            print(f"lr {lr:g} {row}: {mean:.4f}", file=sys.stderr, flush=True)
    print(f"\n{args.steps} steps, seeds {args.seeds}, direction from the {args.direction} moments, "
          f"{time.perf_counter() - t0:.0f} s\n")
    print(table(out, ["lr", "moments", "final val loss (mean)", "vs fp32", "per seed"]))


if __name__ == "__main__":
    main()
