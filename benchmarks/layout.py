"""The GPT's weight layout: ``models.gpt`` (the blocks' matrices stored [out, in] and applied
with ``F.linear``, as ``nn.Linear`` does) against the same model with them stored [in, out] and
applied as ``x @ w + b``: the same values (each matrix transposed), the same loss. Each is
``torch.compile``d, and one run is its forward and backward (the grads of every param); the two
alternate in blocks of ``--steps`` runs, and the ratio is the median over ``--rounds`` of the
ratio within each round.

    python benchmarks/layout.py                      # --config small, 4 x 128 tokens, FP32
    python benchmarks/layout.py --dtype fp32 bf16
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import optree
import torch
import torch.nn.functional as F
from einops import rearrange

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPT_CONFIGS, hardware, sample_times, table  # noqa: E402
from fzero.models import gpt  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transposed(params):
    """``models.gpt``'s params with the blocks' matrices stored [in, out]."""
    turn = lambda x: x.t().contiguous() if x.ndim == 2 else x  # noqa: E731
    return {**params, "blocks": [optree.tree_map(turn, blk) for blk in params["blocks"]]}


def loss_in_out(params, batch, config):
    """``gpt.loss`` of params whose blocks' matrices are stored [in, out]: ``x @ w + b``."""
    tokens, targets = batch
    x = F.embedding(tokens, params["wte"]) + params["wpe"][: tokens.shape[-1]]
    for blk in params["blocks"]:
        a = blk["attn"]
        qkv = gpt._layer_norm(blk["ln1"], x) @ a["qkv_w"] + a["qkv_b"]
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=config.n_head)
        y = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h t d -> b t (h d)")
        x = x + (y @ a["proj_w"] + a["proj_b"])
        m = blk["mlp"]
        h = F.gelu(gpt._layer_norm(blk["ln2"], x) @ m["fc_w"] + m["fc_b"], approximate="tanh")
        x = x + (h @ m["proj_w"] + m["proj_b"])
    logits = (gpt._layer_norm(params["ln_f"], x) @ params["wte"].T).float()
    return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"))


def forward_backward(loss_fn, params, batch):
    """One compiled forward and backward: ``run()`` returns the loss and the grads of every leaf."""
    leaves = [x.requires_grad_() for x in optree.tree_leaves(params)]
    compiled = torch.compile(loss_fn)

    def run():
        loss = compiled(params, batch)
        return loss, torch.autograd.grad(loss, leaves)

    return run


def measure(args, dtype_name: str) -> list:
    cfg = GPT_CONFIGS[args.config]()
    dtype = DTYPES[dtype_name]
    params = gpt.init(torch.Generator().manual_seed(0), cfg, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g) for _ in range(2))
    runs = {"[out, in], F.linear": forward_backward(functools.partial(gpt.loss, config=cfg), params, batch),
            "[in, out], x @ w + b": forward_backward(functools.partial(loss_in_out, config=cfg), transposed(params),
                                                     batch)}
    losses = [run()[0] for run in runs.values()]  # the same model: the same loss, to a few roundings
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)

    def block(run):
        return lambda: [run() for _ in range(args.steps)]

    times = sample_times({k: block(r) for k, r in runs.items()}, torch.device("cpu"), iters=args.rounds, warmup=1)
    (name, base), (other_name, other) = times.items()
    ms = lambda ts: f"{statistics.median(ts) / args.steps * 1e3:.1f}"  # noqa: E731
    ratio = statistics.median(o / b for b, o in zip(base, other))
    return [[dtype_name, name, ms(base), "1.00"], [dtype_name, other_name, ms(other), f"{ratio:.3f}"]]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=GPT_CONFIGS, default="small", help="GPT size: %(default)s")
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, default=["fp32"], help="param dtypes: %(default)s")
    ap.add_argument("--batch", type=int, default=4, help="sequences per run: %(default)s")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence: %(default)s")
    ap.add_argument("--steps", type=int, default=5, help="runs per timed block: %(default)s")
    ap.add_argument("--rounds", type=int, default=15, help="alternating blocks per layout: %(default)s")
    args = ap.parse_args(argv)
    rows = [row for d in args.dtype for row in measure(args, d)]
    print(f"\nGPT '{args.config}', {args.batch} x {args.seq} tokens, {hardware(torch.device('cpu'))}; compiled forward "
          f"and backward, median of {args.rounds} alternating blocks of {args.steps}\n")
    print(table(rows, ["dtype", "layout", "ms per forward and backward", "time / models.gpt's (paired)"]))
    return rows


if __name__ == "__main__":
    main()
