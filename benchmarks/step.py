"""The optimizer step, side by side in one process: fzero vs torch's AdamW vs the classic recipe.

Every row updates the same number of elements, split into ``--tensors`` leaves, from FP16 (or
FP32) grads. The floor is the step's 28 bytes/element (read FP16 grad 2, FP32 master + 2 moments
12; write them back 12; write the FP16 param 2) at the copy bandwidth measured in this run.

    python benchmarks/step.py --numel 2e7 --device cpu          # CPU, 2e7 elements
    python benchmarks/step.py --numel 1e9 --device cuda         # one GPU, 1e9 elements
    python benchmarks/step.py --blocks 2 --device cpu           # 5e7 elements in 12 leaves of 2 MLP blocks
    python benchmarks/step.py --gpt small --device cpu          # the main job's GPT: 1.1e7 elements in 76 leaves

Rows: torch.optim.AdamW fused / foreach on FP32 params; the classic FP16-params + FP32-master
recipe (torch's amp unscale kernel, AdamW on the master, copy back); fresh outputs (allocate new
FP32 master and moments and FP16 params and write each once: the floor of a pure step where the
allocator hands out fresh pages; on a CPU each buffer is mapped for the call, ``common.fresh_pages``,
so the floor always pays them); the ideal mixed-precision step (``ideal_step``: AdamW alone in
one compiled loop over flat buffers, grads read and params written in the fzero rows' dtype, none
of the checks fzero's step makes: what mixed precision costs beside fused AdamW on FP32 params
before any guarantee; not with ``--no-compile``); fzero eager and fzero compiled
(``torch.compile(engine.step, fullgraph=True)``) from the grads pytree with ``donate=True`` and
with the pure default, and compiled on the flat buffer (``engine.flat_params``: params and grads
flat); world size 1, FP16 params and grads with a dynamic loss scale (``--dtype bf16``: BF16, no
loss scale; ``--dtype fp32``: FP32 params that are their own master, for the fzero rows). The
compiled step from the pytree runs its update leaf by leaf on a CPU where the model
and its leaves are large enough (``fzero.cpu.leafwise.worthwhile``), else (and on a GPU) in the
step's graph (``fzero.plan.kernels``); on a CPU a last row runs the other path. Prints a markdown
table with x floor and ratios and, on a CPU, each row's fresh MiB (the memory a call touched for
the first time, mean of 3 calls, ``common.fresh_mib``: whether the pure rows met as many fresh
pages as the floor in this run; an allocator that keeps freed memory hands out none), then the
ratio of each fzero row and the ideal step to torch's fused AdamW (and of the pure rows to fresh
outputs, of the compiled donated rows to the ideal step) from alternating paired rounds, then each
fzero row's first call in seconds (compiled: the compile; run with a new
``TORCHINDUCTOR_CACHE_DIR`` to time it from nothing). ``--profile ROWS``: after the timings, the
ops with the most self CPU time over one step of each compiled fzero row (``torch.profiler``;
each generated CPU kernel an op of its own, dynamo's guards as ``TorchDynamo Cache Lookup``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from unittest import mock

import optree
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
import fzero.cpu.leafwise  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.transforms import scalar  # noqa: E402
from fzero.models import gpt  # noqa: E402
from common import (GPT_CONFIGS, classic_step, fresh_mib, fresh_pages, hardware, leaf_by_leaf,  # noqa: E402
                    median_time, paired_ratio, profile_table, table, write_json)


def gpt_leaf_sizes(config) -> list[int]:
    """The element counts of ``fzero.models.gpt``'s leaves at ``config``, in the params' order."""
    return [x.numel() for x in optree.tree_leaves(gpt.init(torch.Generator().manual_seed(0), config, device="meta"))]


IDEAL = "ideal mixed-precision step (one loop: AdamW only)"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype: the fzero rows' params
IDEAL_HYPER = {"lr": 1e-4, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "wd": 1e-2}  # ideal_update's, in its order


def ideal_update(grads, master, m, v, params, count, lr, b1, b2, eps, wd):
    """The ideal mixed-precision AdamW step, in place: ``grads`` ``[n]`` (FP16/BF16) read,
    ``master``, ``m``, ``v`` ``[n]`` FP32 updated, ``params`` ``[n]`` written with the new master
    in its dtype (torch's cast); returns ``count + 1`` (0-d int32). ``transforms.adamw``'s
    arithmetic: the bias corrections from the count and the hyperparameters (0-d float64) once
    per step, ``m + (1 - b1)(g - m)``, ``sqrt(v)`` times ``1/sqrt(1 - b2^t)``, decoupled weight
    decay. Nothing else: no loss scale, norm, overflow check, skip or saturation."""
    count = count + 1
    t = count.double()
    # 0-d values computed once per step (``transforms.scalar``): inductor would otherwise inline
    # the float64 pow and sqrt into the loop, per vector of elements
    step_size, inv_bc2_sqrt = scalar(1 / (1 - b1**t)), scalar(1 / torch.sqrt(1 - b2**t))
    w1, b2, w2, eps, neg_lr, wd = (scalar(x) for x in (1 - b1, b2, 1 - b2, eps, -lr, wd))
    g = grads.float()
    m_new = m + w1 * (g - m)
    v_new = v * b2 + w2 * g * g
    u = (m_new * step_size) / (v_new.sqrt() * inv_bc2_sqrt + eps)
    new = master + neg_lr * (u + wd * master)
    for into, value in ((master, new), (m, m_new), (v, v_new), (params, new.to(params.dtype))):
        into.copy_(value)
    return count


def ideal_step(n: int, dtype: torch.dtype, device: torch.device):
    """``run()``: ``ideal_update`` on ``n`` elements in flat buffers of its own on ``device``
    (random values drawn there: at 1e9 elements a CPU's generator would take seconds per
    buffer), compiled into one loop (``torch.compile``): ``dtype`` grads, 2 + 12 bytes read and
    12 + 2 written per element, against fused AdamW's 16 and 12 on FP32 params. fzero's
    compiled step on the flat buffer over this row is what its guarantees cost (the loss scale,
    the grad norm and overflow check, the skip of an overflowed step, the saturation of the
    cast, BF16's ties-away rounding)."""
    gen = torch.Generator(device).manual_seed(0)
    master = torch.randn(n, generator=gen, device=device)
    moments = [torch.zeros_like(master), torch.zeros_like(master)]
    params, grads = master.to(dtype), (torch.randn(n, generator=gen, device=device) * 1e-3).to(dtype)
    hyper = [torch.tensor(x, dtype=torch.float64, device=device) for x in IDEAL_HYPER.values()]
    count = [torch.zeros((), dtype=torch.int32, device=device)]
    update = torch.compile(ideal_update, fullgraph=True)

    def run():
        count[0] = update(grads, master, *moments, params, count[0], *hyper)

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=2e7)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--blocks", type=int, help="instead of --numel/--tensors: this many MLP blocks of width "
                    "--width, 6 leaves each ([w, 4w], [4w], [4w, 4w], [4w], [4w, w], [w]; 2 blocks of 1024: 5e7 "
                    "elements in 12 leaves)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--gpt", choices=("small", "gpt2"), help="instead of --numel/--tensors: the leaves of fzero.models.gpt at this "
                    "config (small: the main job's, 1.1e7 elements in 76 leaves, 50 of them biases and norm gains; "
                    "gpt2: GPT-2 small's shapes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp16",
                    help="params and grads of the fzero rows: FP16 with a dynamic loss scale, or BF16 without, or FP32 "
                    "(the params their own master, master='params', as the main job keeps them; no ideal row: fused "
                    "AdamW is the ideal FP32 step)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=9, help="paired rounds of fzero (flat) vs torch fused")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="print the ROWS ops with the most self CPU time in one step of each compiled fzero row")
    args = ap.parse_args(argv)
    if args.profile:  # before anything compiles: each generated CPU kernel shows as an op of its own
        torch._inductor.config.cpp.enable_kernel_profile = True
    dev = torch.device(args.device)
    w = args.width
    sizes = ([w * 4 * w, 4 * w, 16 * w * w, 4 * w, 4 * w * w, w] * args.blocks if args.blocks
             else gpt_leaf_sizes(GPT_CONFIGS[args.gpt]()) if args.gpt
             else [int(args.numel) // args.tensors] * args.tensors)
    N = sum(sizes)
    gen = torch.Generator().manual_seed(0)
    rand = lambda n, dtype=torch.float32: torch.randn(n, generator=gen).to(dev, dtype)
    bench = lambda fn: median_time(fn, dev, iters=args.iters)
    ms, fresh = {}, {}

    def measure(label, fn, calls=3):
        """``fn``'s median time as row ``label``; on a CPU also the fresh MiB per call over
        ``calls`` more calls (glibc serves a large buffer from a free region of its heap where it
        has one, else maps fresh pages: from call to call the count moves with what is free)."""
        ms[label] = bench(fn)
        if dev.type == "cpu":
            fresh[label] = fresh_mib(lambda: [fn() for _ in range(calls)]) / calls

    # floor: copy bandwidth (bytes read + written per second)
    src = rand(N // 2)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src))
    del src, dst
    floor = 28 * N / bw
    ms["floor (28 B/elem at copy bandwidth)"] = floor

    # torch.optim.AdamW on FP32 params (the fused one is kept for the paired rounds below)
    keep = {}
    for impl in ("fused", "foreach"):
        ps = [torch.nn.Parameter(rand(s)) for s in sizes]
        for p in ps:
            p.grad = rand(p.numel()) * 1e-3
        opt = torch.optim.AdamW(ps, lr=1e-4, **{impl: True})
        try:
            measure(f"torch AdamW({impl}=True), FP32 params", opt.step)
            if impl == "fused":
                keep["fused"] = opt.step
        except RuntimeError as e:  # fused needs a device/dtype torch supports
            print(f"skip torch AdamW {impl}: {e}", file=sys.stderr)
        del opt, ps

    # classic: FP16 params + FP32 master, amp unscale + AdamW on master + copy back
    p16 = [rand(s, torch.float16) for s in sizes]
    g16 = [rand(s, torch.float16) for s in sizes]
    classic = classic_step(p16, g16, fused=dev.type == "cuda")

    measure("classic FP16 + FP32 master (amp unscale, AdamW, copy)", classic)
    del p16, classic

    # fresh pages: what the pure step must at least do on an allocator that does not cache --
    # allocate new master, moments (FP32) and params (FP16) and write them once (14 B/elem). On
    # a CPU each buffer is mapped for the call (common.fresh_pages): glibc would serve some from
    # free regions of its heap, as it chooses call by call, and the floor would move with that.
    new_buffer = (lambda dtype: fresh_pages(N, dtype)) if dev.type == "cpu" else (
        lambda dtype: torch.empty(N, dtype=dtype, device=dev))

    def fresh_outputs():
        for dtype in (torch.float32, torch.float32, torch.float32, torch.float16):
            new_buffer(dtype).fill_(1.0)

    measure("fresh outputs (new master, moments, params written once)", fresh_outputs)
    keep["fresh"] = fresh_outputs

    dtype = DTYPES[args.dtype]
    master = "params" if dtype == torch.float32 else "fp32"  # as the main job (examples/flags.py: default_master)
    if args.compile and dtype != torch.float32:  # a compiled loop, or it is not the ideal
        keep["ideal"] = ideal_step(N, dtype, dev)
        measure(IDEAL, keep["ideal"])

    # fzero, world size 1
    params32 = {f"p{i}": rand(s) for i, s in enumerate(sizes)}
    first_s = {}  # each fzero row's first call (compiled: the compile), seconds
    profiles = {}  # --profile: each compiled row's table
    grads = {k: g.to(dtype) for k, g in zip(params32, g16)}
    fzero_rows = [("fzero eager", "eager", False, False, True),
                  ("fzero compiled", "compiled", True, False, True),
                  ("fzero eager, donate=False (pure)", "eager pure", False, False, False),
                  ("fzero compiled, donate=False (pure)", "compiled pure", True, False, False),
                  ("fzero compiled, flat buffer (engine.flat_params)", "flat buffer", True, True, True)]
    # On a CPU the compiled update from the pytree runs leaf by leaf for enough elements (in large
    # enough leaves, unless fzero's own kernel runs it), else in the step's graph: what the
    # engine chose at init (fzero.cpu.leafwise.worthwhile); the other path too.
    runs_leaves = False
    if dev.type == "cpu":
        probe = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=dtype, donate=True, master=master)
        probe.init(params32)
        runs_leaves = leaf_by_leaf(probe)
        other = "in the step's graph" if runs_leaves else "leaf by leaf"
        fzero_rows.append((f"fzero compiled, update {other}", "other path", True, False, True))
    for label, key, compiled, flat_grads, donate in fzero_rows:
        if compiled and not args.compile:
            continue
        engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=dtype, donate=donate, master=master)
        other_path = (mock.patch.object(fzero.cpu.leafwise, "worthwhile", lambda numel, leaves, native: not runs_leaves)
                      if key == "other path" else contextlib.nullcontext())
        with other_path:  # the engine chooses at init
            carry = list(engine.init(params32))  # params, state, scaler_state
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        # d(loss)/d(flat buffer) arrives already laid out (engine.flat_params): no per-leaf copy
        g = fzero.flatten(grads, engine.layout) if flat_grads else grads
        if flat_grads:
            carry[0] = engine.flat_params(carry[0])

        def run(step=step, carry=carry, g=g):  # bound now: the loop deletes its names
            carry[0], carry[1], carry[2], _ = step(carry[0], g, carry[1], carry[2])

        t0 = time.perf_counter()
        run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        first_s[label] = time.perf_counter() - t0
        measure(label, run)
        keep[key] = run
        if args.profile and compiled:
            profiles[label] = profile_table(run, args.profile)
        del engine, carry, step
    del params32

    # Paired rounds: each compiled row against torch's fused AdamW (the CPU target), alternated
    # so that drift in the machine's speed hits both; the ratio is the median of per-round ratios.
    # The pure rows also against fresh outputs: the floor where the allocator does not cache.
    pairs = [(k, "fused") for k in ("compiled", "eager", "compiled pure", "eager pure", "flat buffer", "other path",
                                    "ideal")]
    pairs += [(k, "fresh") for k in ("compiled pure", "eager pure")]
    # What fzero's guarantees (loss scale, norm, skip, saturation) cost beyond the ideal loop: the
    # flat row; from the grads pytree, with the host work of its path besides.
    pairs += [(k, "ideal") for k in ("flat buffer", "compiled")]
    paired = {f"{a} / {b}": paired_ratio(keep[a], keep[b], dev, rounds=args.rounds)
              for a, b in pairs if a in keep and b in keep}
    keep.clear()

    fused_ms = ms.get("torch AdamW(fused=True), FP32 params")
    classic_ms = ms["classic FP16 + FP32 master (amp unscale, AdamW, copy)"]
    rows = [
        [name, f"{t * 1e3:.2f}", f"{t / floor:.2f}", f"{t / fused_ms:.2f}" if fused_ms else "-", f"{classic_ms / t:.2f}",
         f"{fresh[name]:.0f}" if name in fresh else "-"]
        for name, t in ms.items()
    ]
    print(f"\n{N:.3g} elements in {len(sizes)} tensors, fzero params and grads {args.dtype.upper()}, on {hardware(dev)}; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s; "
          f"median of {args.iters}\n")
    print(table(rows, ["step", "ms", "x floor", "x torch fused", "classic / this", "fresh MiB"]))
    names = {"fused": "torch fused AdamW", "fresh": "fresh outputs", "compiled": "fzero compiled (grads pytree, donate)",
             "eager": "fzero eager (grads pytree, donate)", "compiled pure": "fzero compiled (grads pytree, pure)",
             "eager pure": "fzero eager (grads pytree, pure)", "flat buffer": "fzero compiled (flat buffer, donate)",
             "other path": f"fzero compiled (grads pytree, donate, update {other})", "ideal": IDEAL}
    print(f"\npaired: median of {args.rounds} alternating rounds of 5 steps each\n")
    print(table([[names[k.split(" / ")[0]], names[k.split(" / ")[1]], f"{r:.2f}"] for k, r in paired.items()],
                ["step", "against", "ratio"]))
    print("\nfirst call (compiled: the compile), seconds\n")
    print(table([[label, f"{t:.1f}"] for label, t in first_s.items()], ["step", "s"]))
    for label, prof in profiles.items():
        print(f"\n{label}: ops by self CPU time over one step\n{prof}")
    if args.json:
        write_json(args.json, {"numel": N, "dtype": args.dtype, "device": hardware(dev), "copy_GBps": bw / 1e9, "ms": {k: v * 1e3 for k, v in ms.items()},
                               "paired_over_fused": paired, "first_call_s": first_s, "fresh_mib": fresh})
    return ms


if __name__ == "__main__":
    main()
