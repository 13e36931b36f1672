"""The optimizer step with AdamW's moments stored in FP32, BF16 or 8 bits, eager and compiled:
time, bytes touched per element (eager, ``benchmarks/traffic.py``'s counter) and the paired ratio
to the FP32-moment step of the same kind.

Every row is ``engine.step`` at world size 1 on ``traffic.py``'s leaves (8.4e6 elements in 24 leaves
by default), FP16 grads in a pytree, dynamic loss scale, ``donate=True``, FP32 master;
``adamw(lr=1e-4, mu_dtype=m, nu_dtype=m)``. Eager, FP32 moments take torch's fused AdamW kernel
chunk by chunk; BF16 and 8-bit ones the generic update, each chunk's compiled from
``fzero.update.COMPILE_NUMEL`` elements up (no bytes counted then: under the counter they would run
eagerly, ``fzero.update.own_compile``).
Compiled: ``torch.compile(engine.step, fullgraph=True)``. The ratio of each row to the FP32-moment
row of the same kind comes from alternating paired rounds (``--rounds``), which cancel drift in the
machine's speed.

The last row, ``codec``, is the floor under the 8-bit step: only decoding and encoding both
moments of every shard element (``transforms.quantize``'s ``dequantize`` then ``quantize``, in
place, compiled, nothing else), paired against the compiled FP32-moment step. An 8-bit step does
at least this work on top of Adam's arithmetic.

    python benchmarks/moments.py                          # 8.4e6 elements, CPU or the GPU
    python benchmarks/moments.py --numel 1e9 --device cuda
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.transforms import quantize  # noqa: E402
from fzero.update import COMPILE_NUMEL  # noqa: E402
from common import hardware, median_time, paired_ratio, table, write_json  # noqa: E402
from traffic import measure, parse_sizes  # noqa: E402

MOMENTS = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}
GOAL = 1.25  # the 8-bit step against the FP32-moment step, eager and compiled


def fzero_step(shapes, dev, moments, *, compiled: bool):
    """One ``engine.step`` call on a fresh engine (params, state and grads built once)."""
    tx = transforms.adamw(lr=1e-4, mu_dtype=moments, nu_dtype=moments)
    engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(), donate=True)
    params32 = {f"p{i}": torch.randn(s, device=dev) * 0.02 for i, s in enumerate(shapes)}
    carry = list(engine.init(params32))  # params, state, scaler_state
    del params32
    grads = {k: torch.randn(v.shape, device=dev).half() for k, v in carry[0].items()}
    step_fn = torch.compile(engine.step, fullgraph=True) if compiled else engine.step

    def step():
        carry[0], carry[1], carry[2], _ = step_fn(carry[0], grads, carry[1], carry[2])

    return step, engine.state_bytes(carry[1]) / engine.layout.shard_numel


def codec_step(shapes, dev):
    """Decode and encode both moments of ``sum(shapes)`` elements in place, compiled: the
    quantization work of one 8-bit step and nothing else."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    numel += -numel % quantize.BLOCK
    state = [quantize.quantize(torch.randn(numel, device=dev) * 1e-3, signed=True),
             quantize.quantize(torch.rand(numel, device=dev) * 1e-6, signed=False)]

    def roundtrip(qs):
        for q in qs:
            again = quantize.quantize(quantize.dequantize(q), signed=q.codes.dtype == torch.int8)
            q.codes.copy_(again.codes)
            q.scale.copy_(again.scale)

    compiled = torch.compile(roundtrip, fullgraph=True)
    return lambda: compiled(state)


def main(argv=None):
    args, dev, shapes, P, iters, rounds = parse_sizes(argv, __doc__, "each row vs the FP32-moment row")
    results, rows = {}, []
    for kind in ("eager", "compiled"):
        steps = {}
        for name, moments in MOMENTS.items():
            step, state_bytes = fzero_step(shapes, dev, moments, compiled=kind == "compiled")
            if kind == "eager" and (moments is None or P < COMPILE_NUMEL):
                nbytes, t = measure(step, dev, iters)
            else:  # the counter is a dispatch mode: under it dynamo compiles nothing, so the eager step's
                # compiled chunks (BF16 and 8-bit moments, fzero.cpu.chunked.compiled_chunks) run the same
                # function eagerly (fzero.update.own_compile), and it would count those eager ops' bytes,
                # not the compiled kernel's
                nbytes, t = None, median_time(step, dev, iters=iters, warmup=2)
            steps[name] = step
            results[f"{kind} {name}"] = {"ms": t * 1e3, "state_B_per_elem": state_bytes,
                                         "B_per_elem": None if nbytes is None else nbytes / P}
        for name in MOMENTS:
            r = results[f"{kind} {name}"]
            r["x_fp32"] = 1.0 if name == "fp32" else paired_ratio(steps[name], steps["fp32"], dev, rounds=rounds)
            rows.append([kind, name, f"{r['state_B_per_elem']:.3f}", "-" if r["B_per_elem"] is None else
                         f"{r['B_per_elem']:.1f}", f"{r['ms']:.2f}", f"{r['x_fp32']:.2f}"])
        if kind == "compiled":
            codec = codec_step(shapes, dev)
            t = median_time(codec, dev, iters=iters, warmup=2)
            results["codec"] = {"ms": t * 1e3, "x_fp32": paired_ratio(codec, steps["fp32"], dev, rounds=rounds)}
            rows.append(["codec (floor)", "int8", "-", "-", f"{t * 1e3:.2f}", f"{results['codec']['x_fp32']:.2f}"])
        steps.clear()
    print(f"\n{P:,} elements in {len(shapes)} leaves on {hardware(dev)}; median of {iters} steps; x FP32 moments: "
          f"median of {rounds} alternating rounds of 5 steps (goal for int8: <= {GOAL}x, eager and compiled)\n")
    print(table(rows, ["step", "moments", "state B/elem", "B/elem touched (eager)", "ms", "x FP32 moments (paired)"]))
    if args.json:
        write_json(args.json, {"numel": P, "device": hardware(dev), "iters": iters, "rounds": rounds, "rows": results,
                               "goal_x_fp32": GOAL})
    return results


if __name__ == "__main__":
    main()
