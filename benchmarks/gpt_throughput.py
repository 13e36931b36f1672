"""GPT training throughput: fzero beside the usual recipe, same model shape, one run.

Baseline: an ``nn.Module`` GPT + ``torch.autocast`` + ``torch.amp.GradScaler`` (FP16) + fused
AdamW (FP32 params), as ``../shared/bench/gpu_e2e.py`` measures it. fzero: ``models.gpt`` with
FP16/BF16 params in one flat buffer, ``torch.func.grad_and_value`` + ``engine.step`` (world size
1), eager and with the whole train step (forward + backward + step) compiled into one graph.
Random tokens: throughput only. Prints tokens/s, ms/step and peak memory (GPU).

    python benchmarks/gpt_throughput.py --device cuda                      # GPT-2 small, batch 16 x 1024
    python benchmarks/gpt_throughput.py --device cpu --preset tiny --batch 8 --steps 3
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
import transforms  # noqa: E402
from common import hardware, median_time, table  # noqa: E402
from models import gpt  # noqa: E402


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ModuleGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer)])
        self.lnf = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def baseline(cfg, dtype, batch, dev, compiled):
    torch.manual_seed(0)
    model = ModuleGPT(cfg).to(dev)
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused, foreach=not fused)
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast(dev.type, dtype=dtype):
            loss = fwd(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def fzero_step(cfg, dtype, batch, dev, compiled):
    params32 = gpt.init(torch.Generator().manual_seed(0), cfg, device=dev)
    scaling = fzero.DynamicLossScale() if dtype == torch.float16 else None
    engine = fzero.zero1(transforms.adamw(lr=3e-4, weight_decay=0.1), param_dtype=dtype, loss_scale=scaling,
                         donate=compiled)
    carry = list(engine.init(params32))
    del params32
    loss_fn = functools.partial(gpt.loss, config=cfg)

    def train_step(params, state, ss):
        grads, loss = torch.func.grad_and_value(lambda p: fzero.scale_loss(loss_fn(p, batch), ss))(params)
        return engine.step(params, grads, state, ss)

    fn = torch.compile(train_step, fullgraph=True) if compiled else train_step

    def step():
        carry[0], carry[1], carry[2], _ = fn(*carry)

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="gpt2", choices=["tiny", "small", "gpt2"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's block size")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cfg = {"tiny": gpt.GPTConfig.tiny, "small": gpt.GPTConfig.small, "gpt2": lambda: gpt.GPTConfig.gpt2()}[args.preset]()
    if args.preset == "gpt2":  # GPT-2's vocabulary padded to a multiple of 64, as gpu_e2e.py does
        cfg = gpt.GPTConfig(50304, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)
    T = args.seq or cfg.block_size
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch, T), generator=g).to(dev) for _ in range(2))
    rows = []
    for name in args.dtypes:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        for label, make in (("nn.Module + autocast + GradScaler + AdamW", baseline), ("fzero", fzero_step)):
            for compiled in (False, True) if args.compile else (False,):
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                step = make(cfg, dtype, batch, dev, compiled)
                t = median_time(step, dev, iters=args.steps, warmup=3)
                peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if dev.type == "cuda" else "-"
                rows.append([name, label, "compiled" if compiled else "eager", f"{t * 1e3:.1f}",
                             f"{args.batch * T / t / 1e3:.1f}", peak])
                del step
    print(f"\nGPT {cfg.num_params() / 1e6:.0f}M params, batch {args.batch} x {T} tokens, {hardware(dev)}, "
          f"median of {args.steps}\n")
    print(table(rows, ["dtype", "recipe", "mode", "ms/step", "ktok/s", "peak GiB"]))


if __name__ == "__main__":
    main()
