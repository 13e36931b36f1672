"""Where the compiled step from a grads pytree runs its update leaf by leaf (``fzero.cpu.leafwise``)
and where in the step's graph, on a CPU: both paths of ``fzero.plan._leafwise`` side by side on
``fzero.models.gpt`` at several widths (``--config``'s depth and leaves, ``n_embd`` each of
``--widths``), world size 1, ``donate=True``, AdamW, params and grads in ``--dtype`` (FP16 with
a dynamic loss scale). ``torch.compile(engine.step, fullgraph=True)`` from the grads pytree;
the two engines alternate in blocks of ``--steps`` steps and the ratio is the median over
``--rounds`` of the ratio within each round. Each row also says which path the engine picks at
that size (``leafwise.worthwhile``: with fzero's own CPU kernel, ``NATIVE_MIN_NUMEL`` elements)
and whether the two gave the same params, bit for bit.

    python benchmarks/leafwise.py                                 # BF16, widths 128-384
    python benchmarks/leafwise.py --dtype fp16 --widths 192 320
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from unittest import mock

import optree
import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GPT_CONFIGS, hardware, leaf_by_leaf, table  # noqa: E402
import fzero  # noqa: E402
import fzero.cpu.leafwise  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.models import gpt  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PATHS = {"graph": False, "leaves": True}  # in the step's graph, leaf by leaf: what _leafwise is told


def engine_on(path: str | None, dtype: torch.dtype, params):
    """``(engine, (params, state, scaler_state))`` whose compiled step from a grads pytree runs
    its update ``path``: "leaves" (leaf by leaf) or "graph" (in the step's graph), the engine's
    choice made for it at ``init``; ``None``: the engine's own choice."""
    scaling = fzero.DynamicLossScale() if dtype == torch.float16 else None
    engine = fzero.zero1(transforms.adamw(lr=3e-4, weight_decay=0.1), param_dtype=dtype, loss_scale=scaling,
                         donate=True)
    told = PATHS.get(path)
    forced = (mock.patch.object(fzero.cpu.leafwise, "worthwhile", lambda numel, leaves, native: told)
              if path is not None else contextlib.nullcontext())
    with forced:
        carry = engine.init(params)
    return engine, carry


def measure(width: int, dtype: torch.dtype, args) -> dict:
    """One row: both paths at ``n_embd = width``, paired."""
    torch._dynamo.reset()  # each engine's step is the one code object: no width counts toward its recompile limit
    cfg = dataclasses.replace(GPT_CONFIGS[args.config](), n_embd=width, n_head=4)
    params = gpt.init(torch.Generator().manual_seed(0), cfg)
    g = torch.Generator().manual_seed(1)
    grads = optree.tree_map(lambda p: (torch.randn(p.shape, generator=g) * 1e-2).to(dtype), params)
    runs, carries, first = {}, {}, {}
    for path in PATHS:
        engine, carry = engine_on(path, dtype, params)
        step = torch.compile(engine.step, fullgraph=True)
        carry = carries[path] = list(carry)

        def run(step=step, carry=carry):
            for _ in range(args.steps):
                carry[0], carry[1], carry[2], _ = step(carry[0], grads, carry[1], carry[2])

        t = time.perf_counter()
        run()  # the compile, then steps
        first[path] = time.perf_counter() - t
        runs[path] = run
    times = {path: [] for path in runs}
    for _ in range(args.rounds):
        for path, run in runs.items():
            t = time.perf_counter()
            run()
            times[path].append((time.perf_counter() - t) / args.steps)
    return {"width": width, "numel": sum(x.numel() for x in optree.tree_leaves(params)),
            "leaves": len(optree.tree_leaves(params)),
            "ms": {path: statistics.median(ts) * 1e3 for path, ts in times.items()},
            "ratio": statistics.median(b / a for a, b in zip(times["graph"], times["leaves"])),
            "chosen": leaf_by_leaf(engine_on(None, dtype, params)[0]),
            "same": all(torch.equal(a, b) for a, b in zip(*(optree.tree_leaves(c[0]) for c in carries.values()))),
            "first": first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--config", choices=GPT_CONFIGS, default="small", help="depth and vocabulary: %(default)s")
    ap.add_argument("--widths", nargs="+", type=int, default=[128, 192, 256, 320, 352, 384])
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=9, help="alternating blocks per path")
    args = ap.parse_args(argv)
    rows = [measure(w, DTYPES[args.dtype], args) for w in args.widths]
    print(f"\nfzero.models.gpt, --config {args.config} at each width, {args.dtype}, the compiled step from the grads "
          f"pytree, donate=True, {hardware(torch.device('cpu'))}; median of {args.rounds} alternating blocks of "
          f"{args.steps} steps. Where fzero's own kernel runs the update, the engine picks leaf by leaf from "
          f"{fzero.cpu.leafwise.NATIVE_MIN_NUMEL:,} elements (fzero.cpu.leafwise.NATIVE_MIN_NUMEL)\n")
    print(table([[r["width"], f"{r['numel']:.3g}", r["leaves"], f"{r['ms']['graph']:.2f}", f"{r['ms']['leaves']:.2f}",
                  f"{r['ratio']:.3f}", "leaf by leaf" if r["chosen"] else "step's graph", "yes" if r["same"] else "NO",
                  f"{r['first']['graph']:.1f} / {r['first']['leaves']:.1f}"] for r in rows],
                ["n_embd", "elements", "leaves", "step's graph, ms", "leaf by leaf, ms",
                 "leaf by leaf / step's graph (paired)", "the engine picks", "same params",
                 "first call, s (graph / leaves)"]))
    return rows


if __name__ == "__main__":
    main()
