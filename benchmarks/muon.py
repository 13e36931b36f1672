"""Muon on ZeRO-1 shards against AdamW: the step's time, its bytes on the wire, and Newton–Schulz
divided among the ranks, side by side in one run.

The params are a GPT's (``--config``, the main job's models) or ``--blocks`` MLP blocks of
``--width`` (the step benchmark's shapes; 40 blocks of 1024: 1e9 elements). Two engines on the
same params, ``donate=True``, stepping the flat buffer (as the main job does), BF16 params by
default:

* *adamw*: ``transforms.adamw`` on every leaf;
* *muon*: ``transforms.partition`` of ``muon`` for the blocks' matrices and ``adamw`` for the rest
  (``models.gpt.muon_labels``: the nanoGPT-speedrun split), each matrix orthogonalized by one rank
  (``fzero.shard_view``: all-gather of the BF16 momentum, Newton–Schulz on this rank's matrices,
  reduce-scatter of the results).

Eager and compiled (``torch.compile(engine.step, fullgraph=True)``) alternate in rounds after a
warm-up; times are medians, ratios the median over rounds of the ratio within a round. Columns:
ms per step of each; muon / adamw; the bytes each step hands to collectives, counted on rank 0
(a reduce-scatter's and an all-reduce's input, an all-gather's output: the buffers
``benchmarks/comm_model.py``'s ring model prices; for an all-to-all, the pieces sent to other
ranks); the
Newton–Schulz ms of the matrices this rank computes and of all of them (what each rank would
spend if every rank repeated the iteration, as Moonlight's ZeRO-1 does).

    python benchmarks/muon.py --device cpu --ranks 1 2                  # the small GPT on 1 and 2 CPU ranks
    python benchmarks/muon.py --device cuda --ranks 1 --blocks 40 --width 1024   # 1e9 elements, one GPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.comm import Comm  # noqa: E402
from fzero.comm.collectives import FUNCTIONAL  # noqa: E402
from fzero.models import gpt  # noqa: E402
from fzero.whole_leaves import assign  # noqa: E402
from fzero.transforms.muon import newton_schulz  # noqa: E402
from common import GPT_CONFIGS, hardware, profile_table, rows_of_ranks, sample_times, sync, table, write_json  # noqa: E402

CONFIGS = {k: GPT_CONFIGS[k] for k in ("nano", "small", "gpt2")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAMW = {"lr": 3e-3, "weight_decay": 0.1}
MUON = {"lr": 0.02, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"}


def model(args):
    """The params and their labels (``"muon"``/``"adamw"``)."""
    if args.blocks:
        w, g = args.width, torch.Generator().manual_seed(0)
        shapes = [(w, 4 * w), (4 * w,), (4 * w, 4 * w), (4 * w,), (4 * w, w), (w,)]
        params = {"blocks": [[torch.randn(s, generator=g) * 0.02 for s in shapes] for _ in range(args.blocks)]}
    else:
        params = gpt.init(torch.Generator().manual_seed(0), CONFIGS[args.config]())
    return params, gpt.muon_labels(params)


def counting_comm(counts: dict) -> Comm | None:
    """The default group with its collectives wrapped to add up the bytes they are handed
    (``None`` at one process)."""
    if not dist.is_initialized():
        return None

    def wrap(name, fn):
        def counted(x, *rest):
            n, me = dist.get_world_size(), dist.get_rank()
            if name == "all_to_all":  # what leaves this rank: not the pieces it keeps
                sizes = rest[1]
                moved = (sum(sizes) - sizes[me]) * x.element_size()
            else:
                moved = x.numel() * x.element_size() * (n if name.startswith("all_gather") else 1)
            counts[name] = counts.get(name, 0) + moved
            return fn(x, *rest)
        return counted

    return Comm.of(None, collectives=FUNCTIONAL.wrapped(wrap))


def flat_steps(tx, params, dtype, dev, **engine_kw):
    """An engine's eager and compiled step on the flat buffer (``donate=True``), each a function
    of no arguments that runs one step."""
    engine = fzero.zero1(tx, param_dtype=dtype, loss_scale=None, donate=True, **engine_kw)
    p, state, ss = engine.init(optree.tree_map(lambda x: x.to(dev), params))
    flat = engine.flat_params(p)
    grads = (torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dev, dtype)
    box = [flat, state, ss]

    def run(step):
        def once():
            box[0], box[1], box[2], _ = step(box[0], grads, box[1], box[2])
        return once

    return run(engine.step), run(torch.compile(engine.step, fullgraph=True))


def wire_bytes(tx, params, dtype, dev) -> dict:
    """Bytes by collective of one eager step (the second: the first works out the plans), on an
    engine of its own whose update stays eager (``chunk_numel=None``): the counting wrapper is
    Python, which a compiled update would run only while tracing."""
    counts: dict = {}
    eager, _ = flat_steps(tx, params, dtype, dev, group=counting_comm(counts), chunk_numel=None)
    eager()
    counts.clear()
    eager()
    return dict(counts)


def newton_schulz_ms(shapes, dev, iters: int) -> float:
    """Median ms of Newton–Schulz (5 steps, BF16) over ``shapes``, one after another."""
    ms = [torch.randn(s, device=dev) for s in shapes]

    def once():
        for m in ms:
            newton_schulz(m)

    return 1e3 * statistics.median(sample_times(once, dev, iters=iters, warmup=1)) if shapes else 0.0


def measure(args, world: int, rank: int, dev) -> list[dict]:
    params, labels = model(args)
    dtype = DTYPES[args.dtype]
    numel = sum(x.numel() for x in optree.tree_leaves(params))
    matrices = [x.shape for x, l in zip(optree.tree_leaves(params), optree.tree_leaves(labels)) if l == "muon"]
    txs = {"adamw": lambda: transforms.adamw(**ADAMW),
           "muon": lambda: transforms.partition({"muon": transforms.muon(**MUON), "adamw": transforms.adamw(**ADAMW)},
                                                gpt.muon_labels)}
    bytes_of = {name: wire_bytes(tx(), params, dtype, dev) for name, tx in txs.items()}
    adamw, muon = (flat_steps(tx(), params, dtype, dev) for tx in txs.values())
    before = dist.barrier if world > 1 else None
    modes = ("eager", "compiled") if args.compile else ("eager",)
    rows = []
    for i, mode in enumerate(modes):
        times = sample_times({"adamw": adamw[i], "muon": muon[i]}, dev, iters=args.rounds, warmup=2, before=before)
        owner = assign(matrices, world)
        rows.append({
            "ranks": world, "mode": mode, "params": numel, "muon_params": sum(s.numel() for s in matrices),
            "adamw_ms": 1e3 * statistics.median(times["adamw"]), "muon_ms": 1e3 * statistics.median(times["muon"]),
            "ratio": statistics.median(m / a for m, a in zip(times["muon"], times["adamw"])),
            "adamw_wire_mb": sum(bytes_of["adamw"].values()) / 1e6, "muon_wire_mb": sum(bytes_of["muon"].values()) / 1e6,
            "ns_mine_ms": newton_schulz_ms([s for s, o in zip(matrices, owner) if o == rank], dev, args.rounds),
            "ns_all_ms": newton_schulz_ms(matrices, dev, args.rounds)})
        if args.profile:  # every rank steps (the collectives), rank 0 prints
            for name, step in (("adamw", adamw[i]), ("muon", muon[i])):
                found = profile_table(lambda: [step() for _ in range(3)], args.profile)
                if rank == 0:
                    print(f"\n{name}, {mode}, {world} rank(s), rank 0: ops by self CPU time over 3 steps\n{found}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", choices=CONFIGS, default="small", help="GPT size (default: %(default)s)")
    ap.add_argument("--blocks", type=int, help="instead of a GPT: this many MLP blocks of --width")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16", help="param dtype (default: %(default)s)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="world sizes: %(default)s")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="after the timing, print rank 0's top ROWS ops by self CPU time over 3 steps of each "
                         "(torch.profiler; inductor's CPU kernels named)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.profile:  # before anything compiles: each generated CPU kernel shows as an op of its own
        torch._inductor.config.cpp.enable_kernel_profile = True
    if args.child_out:  # a rank under torchrun
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if cuda else "gloo")
        rows = measure(args, dist.get_world_size(), dist.get_rank(), dev)
        if dist.get_rank() == 0:
            write_json(args.child_out, rows)
        fzero.shutdown()
        return rows
    dev = torch.device(args.device)
    rows = []
    for world in args.ranks:
        rows += measure(args, 1, 0, dev) if world == 1 else rows_of_ranks(__file__, sys.argv[1:], world)
    what = f"{args.blocks} MLP blocks of {args.width}" if args.blocks else f"GPT '{args.config}'"
    print(f"\n{what}: {rows[0]['params'] / 1e6:.2f}M params, {rows[0]['muon_params'] / 1e6:.2f}M of them in Muon's "
          f"matrices; {args.dtype} params, donate=True, the flat buffer; {hardware(dev)}; median of {args.rounds} "
          f"alternating rounds\n")
    print(table([[r["ranks"], r["mode"], f"{r['adamw_ms']:.1f}", f"{r['muon_ms']:.1f}", f"{r['ratio']:.2f}",
                  f"{r['adamw_wire_mb']:.1f}", f"{r['muon_wire_mb']:.1f}", f"{r['ns_mine_ms']:.1f}", f"{r['ns_all_ms']:.1f}"]
                 for r in rows],
                ["ranks", "step", "adamw ms", "muon ms", "muon / adamw (paired)", "adamw wire MB/step",
                 "muon wire MB/step", "Newton-Schulz ms, rank 0's matrices", "Newton-Schulz ms, all matrices"]))
    if args.json:
        write_json(args.json, {"device": hardware(dev), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
