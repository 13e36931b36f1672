"""The BF16 step with an FP32 master against the remainder master (``zero1(master=...)``):
bytes touched per element and time, eager and compiled, side by side in one process.

Both rows run the main job's step shape: BF16 params and grads on the flat buffer
(``engine.flat_params``), no loss scale, ``donate=True``, clip by the global grad norm, then
AdamW; world size 1; the leaves of ``benchmarks/traffic.py`` (8.4e6 elements by default).

- eager bytes: ``benchmarks/traffic.py``'s counter (every aten op's distinct tensors of >= 1024
  elements, one step after a warm-up step);
- compiled bytes: inductor's own count for the graph it generates
  (``GraphLowering.count_bytes``: the buffers each fused kernel reads and writes), compiled with
  inductor's caches off so that the count is taken;
- times: the median of ``--iters`` steps per row, and the remainder / FP32 ratio from
  alternating paired rounds (``--rounds``), eager and compiled.

What to expect: the FP32 master costs 8 B/elem (read 4, write 4); the remainder 4 (read 2,
write 2) plus what rebuilding needs from the BF16 params, which the step reads anyway.

    python benchmarks/master.py                            # CPU, 8.4e6 elements
    python benchmarks/master.py --numel 1e9 --device cuda  # one GPU
"""
from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from common import hardware, median_time, paired_ratio, sync, table, write_json  # noqa: E402
from traffic import Traffic, parse_sizes  # noqa: E402

MASTERS = ("fp32", "remainder")


def bf16_step(shapes, dev, master: str, *, compiled: bool):
    """One engine's step on the flat buffer as a no-argument function (params and state carried)."""
    tx = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(lr=1e-4, weight_decay=0.01))
    engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None, donate=True, master=master)
    params, state, scaler_state = engine.init({f"p{i}": torch.randn(s, device=dev) * 0.02 for i, s in enumerate(shapes)})
    carry = [engine.flat_params(params), state, scaler_state]
    grads = torch.randn(engine.layout.padded_numel, device=dev).to(torch.bfloat16) * 1e-2
    step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step

    def run():
        carry[0], carry[1], carry[2], _ = step(carry[0], grads, carry[1], carry[2])

    return run


def compiled_bytes(run, dev) -> int | None:
    """Bytes inductor counts for the graph it compiles on ``run``'s first call (``None`` where
    this torch does not count: the count is taken only with its metrics log enabled)."""
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    level, propagate = log.level, log.propagate
    log.setLevel(logging.INFO)  # count_bytes runs only when this log is enabled; print nothing
    log.propagate = False
    try:
        from torch._inductor import metrics
        metrics.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit skips the count
            run()
        sync(dev)
        return metrics.num_bytes_accessed or None
    except (ImportError, AttributeError):
        run()
        return None
    finally:
        log.setLevel(level)
        log.propagate = propagate


def main(argv=None):
    args, dev, shapes, P, iters, rounds = parse_sizes(argv, __doc__, "remainder vs FP32 master")
    try:  # an AOT-autograd cache hit would skip inductor, and its count, too
        torch._functorch.config.enable_autograd_cache = False
    except AttributeError:
        pass

    rows, paired = {}, {}
    for mode in ("eager", "compiled"):
        runs = {}
        for master in MASTERS:
            run = bf16_step(shapes, dev, master, compiled=mode == "compiled")
            if mode == "compiled":
                nbytes = compiled_bytes(run, dev)
            else:
                run()  # warm-up: first-call allocations
                sync(dev)
                counter = Traffic()
                with counter:
                    run()
                sync(dev)
                nbytes = counter.bytes
            ms = median_time(run, dev, iters=iters) * 1e3
            rows[f"{mode}, {master} master"] = {"B_per_elem": nbytes / P if nbytes else None, "ms": ms}
            runs[master] = run
        paired[mode] = paired_ratio(runs["remainder"], runs["fp32"], dev, rounds=rounds)
        del runs, run
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{P:,} elements in {len(shapes)} leaves on {hardware(dev)}; BF16 params on the flat buffer, clip + AdamW, "
          f"donate; median of {iters} steps\n")
    print(table([[name, f"{r['B_per_elem']:.1f}" if r["B_per_elem"] else "-", f"{r['ms']:.2f}"] for name, r in rows.items()],
                ["step", "B/elem", "ms"]))
    for mode, r in paired.items():
        print(f"\n{mode}: remainder / FP32 master = {r:.3f} (paired: median of {rounds} alternating rounds of 5 steps)")
    if args.json:
        write_json(args.json, {"numel": P, "device": hardware(dev), "iters": iters, "rounds": rounds, "rows": rows,
                               "paired_remainder_over_fp32": paired})
    return rows, paired


if __name__ == "__main__":
    main()
