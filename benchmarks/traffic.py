"""Bytes touched per element by one eager optimizer step, beside its time, for torch and fzero.

The counter is the project's definition of the eager step's traffic (the reference is
``shared/bench/traffic_counter.py``, next to this repository; the copy here keeps its rules, so
that this script runs on its own): a ``TorchDispatchMode`` that adds, for every aten op, the
bytes of every distinct tensor of >= 1024 elements among its inputs and outputs (an in-place
operand once; view ops and bare allocations nothing), divided by the parameter count. The ideal
fused mixed-precision step touches 16 B/elem (FP16 grad 2 + FP32 master and moments 12 in place +
FP16 param 2); the goal for fzero's eager step is <= 48 B/elem and <= 3x torch's fused AdamW.

Every row has the same leaves: the reference's 24 (``(h, d), (d,), (d, d), (d,), (d, h), (h,)``
four times, ``d = 1024``, ``h = 512``: 8.4e6 elements), ``d`` and ``h`` scaled to ``--numel``.
Each row is warmed up with one step, counted on the next, then timed (median of ``--iters``).

    python benchmarks/traffic.py                              # 8.4e6 elements, CPU or the GPU
    python benchmarks/traffic.py --numel 1e9 --device cuda    # one GPU, 1e9 elements

Rows: torch.optim.AdamW fused / foreach on FP32 params; the classic FP16 params + FP32 master
recipe (as in ``benchmarks/step.py``); fzero eager ``engine.step``, world size 1: from an FP16
grads pytree with a dynamic loss scale and ``donate=True`` (the reference's configuration), the
same with ``donate=False``, from the flat buffer's grads (``engine.flat_params``), and BF16
params with no loss scale. The last line is the fzero pytree row against the goals, its time
ratio from alternating paired rounds with torch's fused AdamW (``--rounds``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from common import classic_step, hardware, median_time, paired_ratio, sync, table, write_json  # noqa: E402

BIG = 1024  # tensors of fewer elements (0-d scalars, small biases) count nothing
REF_D, REF_H = 1024, 512
REF_NUMEL = 4 * (2 * REF_H * REF_D + REF_D * REF_D + 2 * REF_D + REF_H)  # 8,398,848
GOAL_BYTES, GOAL_RATIO = 48, 3.0
PYTREE_ROW = "fzero eager, FP16 pytree grads, dynamic scale, donate"
FUSED_ROW = "torch AdamW(fused=True), FP32 params"


def _moves_nothing(func) -> bool:
    """View ops (slice, view, expand, as_strided, detach, ...) and bare allocations touch no bytes."""
    rets = func._schema.returns
    if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        return True
    return func.__name__.split(".")[0] in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_")


class Traffic(TorchDispatchMode):
    """Adds up the bytes each aten op touches (the reference definition, see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _moves_nothing(func):
            return out
        seen = set()
        for t in optree.tree_leaves((args, kwargs or {}, out), none_is_leaf=False):
            if isinstance(t, torch.Tensor) and t.numel() >= BIG:
                key = (t.data_ptr(), t.numel(), t.dtype)
                if key not in seen:
                    seen.add(key)
                    self.bytes += t.numel() * t.element_size()
        return out


def leaf_shapes(numel: float) -> list[tuple[int, ...]]:
    """The reference's 24 leaf shapes with both widths scaled by ``sqrt(numel / 8.4e6)``."""
    s = math.sqrt(numel / REF_NUMEL)
    d, h = max(2, round(REF_D * s)), max(1, round(REF_H * s))
    return [(h, d), (d,), (d, d), (d,), (d, h), (h,)] * 4


def torch_adamw(shapes, dev, impl):
    ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device=dev) * 1e-3
    return torch.optim.AdamW(ps, lr=1e-4, **{impl: True}).step


def classic(shapes, dev):
    """FP16 params + FP32 master: grads cast up, amp's unscale kernel, fused AdamW, copy back."""
    return classic_step([torch.randn(s, device=dev).half() for s in shapes],
                        [torch.randn(s, device=dev).half() for s in shapes], fused=True)


def fzero_eager(shapes, dev, *, dtype=torch.float16, loss_scale="auto", donate=True, flat=False):
    engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=dtype, loss_scale=loss_scale, donate=donate)
    params32 = {f"p{i}": torch.randn(s, device=dev) * 0.02 for i, s in enumerate(shapes)}
    carry = list(engine.init(params32))  # params, state, scaler_state
    del params32
    grads = {k: torch.randn(v.shape, device=dev).to(dtype) for k, v in carry[0].items()}
    if flat:  # the grad of the flat buffer arrives laid out already, and params go in flat
        grads = fzero.flatten(grads, engine.layout)
        carry[0] = engine.flat_params(carry[0])

    def step():
        carry[0], carry[1], carry[2], _ = engine.step(carry[0], grads, carry[1], carry[2])

    return step


def measure(step, dev, iters):
    """``(bytes touched by one step, median seconds)``: after one warm-up step (optimizer state,
    first-call allocations), one step under the counter, then the timing."""
    step()
    sync(dev)
    mode = Traffic()
    with mode:
        step()
    sync(dev)
    return mode.bytes, median_time(step, dev, iters=iters)


def parse_sizes(argv, doc: str, rounds_of: str):
    """The command line of this script and of ``benchmarks/master.py``: ``(args, device, leaf
    shapes, their total P, iters, rounds)``; ``rounds_of`` names what the paired rounds pair."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, help="total elements (default 8.4e6, the reference's; 2e5 with --quick)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, help="timed steps per row (default 20; 3 with --quick)")
    ap.add_argument("--rounds", type=int, help=f"paired rounds of {rounds_of} (default 9; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a tiny run: 2e5 elements, 3 timed steps")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    shapes = leaf_shapes(args.numel or (2e5 if args.quick else REF_NUMEL))
    iters = args.iters or (3 if args.quick else 20)
    rounds = args.rounds or (2 if args.quick else 9)
    torch.manual_seed(0)
    return args, torch.device(args.device), shapes, sum(math.prod(s) for s in shapes), iters, rounds


def main(argv=None):
    args, dev, shapes, P, iters, rounds = parse_sizes(argv, __doc__, "the fzero pytree row vs torch fused")

    rows = {  # built one at a time below, so that only one row's tensors are alive
        FUSED_ROW: lambda: torch_adamw(shapes, dev, "fused"),
        "torch AdamW(foreach=True), FP32 params": lambda: torch_adamw(shapes, dev, "foreach"),
        "classic FP16 + FP32 master (amp unscale, fused AdamW, copy)": lambda: classic(shapes, dev),
        PYTREE_ROW: lambda: fzero_eager(shapes, dev, loss_scale=fzero.DynamicLossScale()),
        "fzero eager, same, donate=False": lambda: fzero_eager(shapes, dev, loss_scale=fzero.DynamicLossScale(),
                                                               donate=False),
        "fzero eager, flat buffer grads (engine.flat_params), donate": lambda: fzero_eager(
            shapes, dev, loss_scale=fzero.DynamicLossScale(), flat=True),
        "fzero eager, BF16 pytree grads, no loss scale, donate": lambda: fzero_eager(
            shapes, dev, dtype=torch.bfloat16, loss_scale=None),
    }
    results, keep = {}, {}
    for name, build in rows.items():
        try:
            step = build()
        except RuntimeError as e:  # fused AdamW needs a device/dtype this torch supports
            print(f"skip {name}: {e}", file=sys.stderr)
            continue
        nbytes, t = measure(step, dev, iters)
        results[name] = {"B_per_elem": nbytes / P, "ms": t * 1e3}
        if name in (FUSED_ROW, PYTREE_ROW):  # kept for the paired rounds
            keep[name] = step
        del step
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # The goal's ratio from alternating rounds: drift in the machine's speed hits both rows.
    paired = paired_ratio(keep[PYTREE_ROW], keep[FUSED_ROW], dev, rounds=rounds) if len(keep) == 2 else None
    keep.clear()

    fused = results.get(FUSED_ROW)
    for r in results.values():
        r["x_fused"] = r["ms"] / fused["ms"] if fused else None
    print(f"\n{P:,} elements in {len(shapes)} leaves on {hardware(dev)}; median of {iters} steps; "
          f"bytes counted over one step after one warm-up step\n")
    print(table([[name, f"{r['B_per_elem']:.1f}", f"{r['ms']:.2f}", f"{r['x_fused']:.2f}" if fused else "-"]
                 for name, r in results.items()], ["row", "B/elem", "ms", "x fused AdamW"]))
    goal = results[PYTREE_ROW]
    ratio = f"{paired:.2f}" if paired is not None else "-"
    print(f"\neager fzero step (pytree grads): {goal['B_per_elem']:.1f} B/elem, {ratio}x fused AdamW, paired: median "
          f"of {rounds} alternating rounds of 5 steps (goals: <= {GOAL_BYTES} B/elem and <= {GOAL_RATIO:g}x)")
    if args.json:
        write_json(args.json, {"numel": P, "leaves": [list(s) for s in shapes], "device": hardware(dev), "iters": iters,
                               "rows": results, "goal_row": PYTREE_ROW, "paired_x_fused": paired,
                               "goals": {"B_per_elem": GOAL_BYTES, "x_fused": GOAL_RATIO}})
    return results


if __name__ == "__main__":
    main()
