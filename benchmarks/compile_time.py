"""What compiling ``engine.step`` costs before any kernel is built: dynamo's trace of the step's
Python. A first call of ``torch.compile(engine.step)`` traces the step (bytecode by bytecode,
with every library call it makes), then lowers the graph and builds its kernels; the kernels
come from inductor's cache after the first time, the trace never does. Per form of the step
(from the flat buffer, from the grads pytree) and param dtype: the bytecode instructions dynamo
interpreted and its ``bytecode_tracing`` seconds, the median over ``--rounds`` compiles from
empty dynamo caches (one untimed compile first fills inductor's cache). AdamW with weight decay
on ``models.gpt``'s params (``--config``), world size 1, ``donate=True``.

    python benchmarks/compile_time.py                    # --config nano, FP16, both forms
    python benchmarks/compile_time.py --dtype fp16 bf16 fp32 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import optree
import torch
import torch._dynamo
from torch._dynamo import symbolic_convert

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from common import GPT_CONFIGS, hardware, table  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.models import gpt  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FORMS = ("flat", "pytree")


class InstructionCount:
    """Counts the bytecode instructions dynamo interprets while it is entered (its
    ``InstructionTranslatorBase.step``, one call per instruction, inlined calls included)."""

    def __enter__(self):
        self.n, self._step = 0, symbolic_convert.InstructionTranslatorBase.step

        def step(tracer):
            self.n += 1
            return self._step(tracer)

        symbolic_convert.InstructionTranslatorBase.step = step
        return self

    def __exit__(self, *exc):
        symbolic_convert.InstructionTranslatorBase.step = self._step


def tracing_seconds() -> float:
    """Dynamo's ``bytecode_tracing`` seconds since its counters were last cleared."""
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    return float(dict(zip(names, values)).get("bytecode_tracing", 0.0))


def compile_once(config, dtype, form: str) -> tuple[int, float, float]:
    """``(instructions, tracing s, first call s)`` of one compile of the step from empty dynamo
    caches, on a fresh engine."""
    params = gpt.init(torch.Generator().manual_seed(0), config)
    tx = transforms.adamw(lr=1e-3, weight_decay=0.1)
    engine = fzero.zero1(tx, param_dtype=dtype, donate=True, master="params" if dtype == torch.float32 else "fp32")
    params, state, scaler_state = engine.init(params)
    grads = optree.tree_map(lambda x: torch.full_like(x, 1e-3), params)
    carry, grads = (engine.flat_params(params), fzero.flatten(grads, engine.layout)) if form == "flat" else (params, grads)
    torch._dynamo.reset()
    before = tracing_seconds()
    step = torch.compile(engine.step, fullgraph=True)
    with InstructionCount() as count:
        t0 = time.perf_counter()
        step(carry, grads, state, scaler_state)
        first = time.perf_counter() - t0
    return count.n, tracing_seconds() - before, first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=GPT_CONFIGS, default="nano", help="GPT size: %(default)s")
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, default=["fp16"], help="param dtypes: %(default)s")
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="%(default)s")
    ap.add_argument("--rounds", type=int, default=3, help="compiles per row after the untimed one: %(default)s")
    args = ap.parse_args(argv)
    config = GPT_CONFIGS[args.config]()
    rows = []
    for name in args.dtype:
        for form in args.forms:
            compile_once(config, DTYPES[name], form)  # fills inductor's cache: the rows time no kernel build
            runs = [compile_once(config, DTYPES[name], form) for _ in range(args.rounds)]
            rows.append({"dtype": name, "form": form, "instructions": runs[0][0],
                         "tracing_s": statistics.median(r[1] for r in runs),
                         "first_call_s": statistics.median(r[2] for r in runs)})
    print(f"\nengine.step compiled, AdamW, GPT '{args.config}' ({config.num_params() / 1e6:.2f}M params), world size 1; "
          f"{hardware(torch.device('cpu'))}; median of {args.rounds} compiles, inductor's cache warm\n")
    print(table([[r["dtype"], r["form"], f"{r['instructions']:,}", f"{r['tracing_s']:.2f}", f"{r['first_call_s']:.2f}"]
                 for r in rows], ["dtype", "step from", "instructions traced", "tracing s", "first call s"]))
    return rows


if __name__ == "__main__":
    main()
