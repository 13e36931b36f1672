"""Per-rank memory: the textbook formulas beside the bytes fzero actually holds.

For each model size P and world size N, fzero is run as rank 0 of N ranks on one device
(``zero1(..., simulate=(0, N))``: the real layout and buffer sizes, no process group), with FP16
params, FP16 grads and AdamW. "held" counts the bytes of every distinct storage behind params,
grads, optimizer state and loss-scale state after one step; on a GPU, "peak" is
``torch.cuda.max_memory_allocated`` during that step (from a reset after init). The gradient
accumulation buffer is measured for stage 1 (full FP32 flat sum, 4P) and stage 2 (this rank's
FP32 shard of the reduced sum, 4P/N). "async_save staging" is the host buffer
``checkpoint.async_save`` keeps for the engine (``fzero.checkpoint.staging``): the real elements of
the rank's FP32 master and moments, 12P/N, outside the device.

    python benchmarks/memory.py                          # 124M and 1B params, N = 1, 8, 64 (CPU)
    python benchmarks/memory.py --sizes 1e9 --world-sizes 8 64 --device cuda
    python benchmarks/memory.py --sizes 1e6 --offload-sizes 1e8 --world-sizes 1 8 --device cuda

With ``--offload-sizes``, also ``offload="cpu"`` beside the on-device engine: the bytes left on
the device (it should drop by the 12P/N of master and moments) and both step times.

Formulas (bytes per rank, mixed-precision AdamW): DDP 16P; ZeRO-1 4P + 12P/N; ZeRO-2 2P + 14P/N;
ZeRO-3 16P/N. The "BF16 + remainder" column is the optimizer state of a BF16 engine with
``master="remainder"`` (an int16 remainder below the BF16 params instead of the FP32 master):
10P/N; "FP32 + params" that of an FP32 engine with ``master="params"`` (the FP32 params' own
shard is the master, no second copy): 8P/N.

A second table gives the optimizer state per element of the shard with AdamW's moments stored
in FP32, BF16 or 8 bits (``transforms.adamw(mu_dtype=..., nu_dtype=...)``), with the FP32 master
and with the remainder, and with Muon on ``--muon-fraction`` of the params (``partition``: one FP32
momentum per Muon element, AdamW's two moments on the rest: 12 - 4F on average over the ranks,
from 8 on a rank whose shard holds Muon's elements only to 12 on one that holds AdamW's only; the
first and the last rank), at ``--moment-world-sizes`` (8 and 64).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import optree
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.checkpoint import manifest, staging  # noqa: E402
from fzero.checkpoint.form import saved_form  # noqa: E402
from common import hardware, median_time, table, write_json  # noqa: E402

GB = 2**30


def formulas(P: int, N: int) -> dict[str, float]:
    return {"DDP": 16 * P, "ZeRO-1": 4 * P + 12 * P / N, "ZeRO-2": 2 * P + 14 * P / N, "ZeRO-3": 16 * P / N}


def storage_bytes(*trees) -> int:
    """Bytes of the distinct storages behind every tensor in ``trees`` (views counted once)."""
    seen = {}
    for t in optree.tree_leaves(trees):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def staging_bytes(engine, state) -> int:
    """Host bytes of ``checkpoint.async_save``'s staging buffer for rank 0's ``state``: the real
    elements of its ``[S]`` leaves as a checkpoint stores them, and the leaves every rank holds alike."""
    names, leaves, _, kinds = manifest.state_leaves(saved_form(state, engine.shard_context), engine.layout.shard_numel)
    return staging.nbytes(names, leaves, kinds, engine.layout.owned(0), whole=True)


def measure(P: int, N: int, device: torch.device, leaves: int = 16, replicas: int = 1) -> dict:
    """Run rank 0 of N (simulated; of ``replicas x N`` on a hybrid mesh) for one step; return
    held and peak bytes."""
    sizes = [P // leaves] * (leaves - 1) + [P - (P // leaves) * (leaves - 1)]
    # FP16 inputs keep the 1B-parameter rows within a 24 GiB host; init casts them to FP32 shards.
    init_params = {f"w{i}": torch.full((n,), 0.01, dtype=torch.float16, device=device) for i, n in enumerate(sizes)}
    engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=torch.float16, simulate=(0, N, replicas))
    params, state, ss = engine.init(init_params)
    del init_params
    grads = optree.tree_map(lambda p: torch.full_like(p, 1e-3), params)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    params, state, ss, info = engine.step(params, grads, state, ss)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    held = storage_bytes(params, grads, state, ss)
    out = {"held": held, "state": engine.state_bytes(state), "peak_step": peak, "shard": engine.layout.shard_numel,
           "staging": staging_bytes(engine, state)}
    # gradient accumulation buffers: stage 1 sums the full flat grads, stage 2 only its shard
    acc = engine.accumulate(engine.accumulate(None, grads), grads)
    out["acc_stage1"] = storage_bytes(acc)
    del acc, state
    stage2 = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=torch.float16, simulate=(0, N, replicas), stage=2)
    stage2.init(params)
    acc = stage2.accumulate(stage2.accumulate(None, grads), grads)
    out["acc_stage2"] = storage_bytes(acc)
    del acc, stage2
    del params, grads, ss, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def master_state(P: int, N: int, device: torch.device, param_dtype: torch.dtype, master: str, leaves: int = 16,
                 moments: torch.dtype | None = None, per_element: bool = False) -> float:
    """Optimizer-state bytes of rank 0 of N (simulated) with ``param_dtype`` params,
    ``master`` (``"remainder"``: an int16 remainder instead of the FP32 master, BF16 params;
    ``"params"``: the FP32 params' own shard) and AdamW's moments stored as ``moments``
    (``mu_dtype``/``nu_dtype``), after one step; ``per_element``: divided by the shard's
    elements."""
    sizes = [P // leaves] * (leaves - 1) + [P - (P // leaves) * (leaves - 1)]
    init_params = {f"w{i}": torch.full((n,), 0.01, dtype=param_dtype, device=device) for i, n in enumerate(sizes)}
    tx = transforms.adamw(lr=1e-4, mu_dtype=moments, nu_dtype=moments)
    engine = fzero.zero1(tx, param_dtype=param_dtype, simulate=(0, N), master=master)
    params, state, ss = engine.init(init_params)
    del init_params
    grads = optree.tree_map(lambda p: torch.full_like(p, 1e-3), params)
    params, state, ss, _ = engine.step(params, grads, state, ss)
    out = engine.state_bytes(state) / (engine.layout.shard_numel if per_element else 1)
    del params, grads, state, ss, engine
    gc.collect()
    return out


def muon_state(P: int, N: int, device: torch.device, fraction: float, rank: int, matrices: int = 12) -> float:
    """Optimizer-state bytes per element of rank ``rank``'s shard of N (simulated), FP16 params,
    FP32 master, ``partition`` of Muon on ``matrices`` square matrices holding ``fraction`` of P
    and AdamW on 1-D leaves holding the rest: Muon keeps one FP32 buffer per element of its
    group, AdamW two, each compacted to its group's elements of the shard (``fzero.shard_view``),
    so a rank's bytes depend on which leaves its shard holds. After ``init``: the state a step
    keeps is the same."""
    d = int((fraction * P / matrices) ** 0.5)
    rest = P - matrices * d * d
    init_params = {"m": [torch.full((d, d), 0.01, dtype=torch.float16, device=device) for _ in range(matrices)],
                   "v": [torch.full((rest // 4,), 0.01, dtype=torch.float16, device=device) for _ in range(4)]}
    labels = {"m": ["muon"] * matrices, "v": ["adamw"] * 4}
    tx = transforms.partition({"muon": transforms.muon(lr=1e-3), "adamw": transforms.adamw(lr=1e-4)}, labels)
    engine = fzero.zero1(tx, param_dtype=torch.float16, simulate=(rank, N))
    _, state, _ = engine.init(init_params)
    del init_params
    out = engine.state_bytes(state) / engine.layout.shard_numel
    del state, engine
    gc.collect()
    return out


# (name, param dtype, master, moments, goal: bytes of optimizer state per element of the shard)
MOMENT_ROWS = [
    ("FP16 + FP32 master + FP32 moments", torch.float16, "fp32", None, "12"),
    ("FP16 + FP32 master + BF16 moments", torch.float16, "fp32", torch.bfloat16, "8"),
    ("BF16 + remainder + BF16 moments", torch.bfloat16, "remainder", torch.bfloat16, "6"),
    ("FP16 + FP32 master + int8 moments", torch.float16, "fp32", torch.int8, "<= 6.1"),
    ("BF16 + remainder + int8 moments", torch.bfloat16, "remainder", torch.int8, "<= 4.1"),
]


def device_bytes(device: torch.device, *trees) -> int:
    """``storage_bytes`` of the tensors in ``trees`` that live on ``device``."""
    return storage_bytes([t for t in optree.tree_leaves(trees) if isinstance(t, torch.Tensor) and t.device == device])


def measure_offload(P: int, N: int, device: torch.device, steps: int = 2) -> dict:
    """Rank 0 of N (simulated), on the device and with ``offload="cpu"``: bytes on ``device``
    after a step, and the step's seconds (median of ``steps`` after one warm-up)."""
    out = {}
    for offload in (None, "cpu"):
        init_params = {"w": torch.full((P,), 0.01, dtype=torch.float16, device=device)}
        engine = fzero.zero1(transforms.adamw(lr=1e-4), param_dtype=torch.float16, simulate=(0, N), offload=offload)
        params, state, ss = engine.init(init_params)
        del init_params
        grads = optree.tree_map(lambda p: torch.full_like(p, 1e-3), params)
        carry = [params, state, ss]

        def step(carry=carry, engine=engine, grads=grads):  # bound now: the loop deletes its names
            carry[0], carry[1], carry[2], _ = engine.step(carry[0], grads, carry[1], carry[2])

        seconds = median_time(step, device, iters=steps, warmup=1)
        params, state, ss = carry
        key = "offload" if offload else "device"
        out[f"{key}_bytes"] = device_bytes(device, params, grads, state, ss)
        out[f"{key}_s"] = seconds
        del params, grads, state, ss, engine, carry, step
        gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[124_439_808, 1e9])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--moment-world-sizes", type=int, nargs="*", default=[8, 64],
                    help="world sizes of the moment-dtype table (bytes of state per element): %(default)s")
    ap.add_argument("--max-gib", type=float, default=14.0, help="skip rows whose ZeRO-1 formula exceeds this")
    ap.add_argument("--offload-sizes", type=float, nargs="*", default=[],
                    help="also measure offload='cpu' at these sizes: device bytes and step time beside on-device")
    ap.add_argument("--muon-fraction", type=float, default=0.68, metavar="F",
                    help="the moment table's Muon row: Muon on F of the params (GPT-2 small: 0.68), 0 for none")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows, results = [], []
    for P in map(int, args.sizes):
        for N in args.world_sizes:
            f = formulas(P, N)
            if f["ZeRO-1"] / GB > args.max_gib:
                print(f"skip P={P:.3g} N={N}: ZeRO-1 needs {f['ZeRO-1'] / GB:.1f} GiB > --max-gib", file=sys.stderr)
                continue
            m = measure(P, N, device)
            m["state_remainder"] = master_state(P, N, device, torch.bfloat16, "remainder")
            m["state_params"] = master_state(P, N, device, torch.float32, "params")
            results.append({"P": P, "N": N, **f, **m})
            rows.append([
                f"{P / 1e6:.0f}M", N,
                *(f"{f[k] / GB:.2f}" for k in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")),
                f"{m['held'] / GB:.2f}", f"{m['held'] / f['ZeRO-1']:.3f}",
                f"{m['state'] / GB:.3f}", f"{12 * P / N / GB:.3f}",
                f"{m['state_remainder'] / GB:.3f}", f"{10 * P / N / GB:.3f}",
                f"{m['state_params'] / GB:.3f}", f"{8 * P / N / GB:.3f}",
                f"{m['acc_stage1'] / GB:.3f}", f"{m['acc_stage2'] / GB:.3f}",
                "-" if m["peak_step"] is None else f"{m['peak_step'] / GB:.2f}",
                f"{m['staging'] / GB:.3f}",
            ])
    print(f"\nGiB per rank; fzero measured on {hardware(device)} as rank 0 of N (simulated)\n")
    print(table(rows, ["P", "N", "DDP 16P", "ZeRO-1 4P+12P/N", "ZeRO-2 2P+14P/N", "ZeRO-3 16P/N",
                       "fzero held", "held / ZeRO-1", "fzero opt state", "12P/N",
                       "opt state, BF16 + remainder", "10P/N", "opt state, FP32 + params", "8P/N",
                       "accum buf stage 1", "accum buf stage 2", "peak in step", "async_save staging (host) 12P/N"]))
    moment_rows = []
    for P in map(int, args.sizes):
        for N in args.moment_world_sizes:
            if formulas(P, N)["ZeRO-1"] / GB > args.max_gib:
                continue
            for name, param_dtype, master, moments, goal in MOMENT_ROWS:
                b = master_state(P, N, device, param_dtype, master, moments=moments, per_element=True)
                results.append({"P": P, "N": N, "moments_row": name, "state_bytes_per_element": b})
                moment_rows.append([f"{P / 1e6:.0f}M", N, name, f"{b:.4f}", goal])
    for P in map(int, args.sizes):
        for N in args.moment_world_sizes:
            if formulas(P, N)["ZeRO-1"] / GB > args.max_gib or not args.muon_fraction:
                continue
            f = args.muon_fraction
            first, last = (muon_state(P, N, device, f, r) for r in (0, N - 1))  # matrices first in the buffer
            name = f"FP16 + FP32 master + Muon on {f:g} of P, AdamW on the rest"
            results.append({"P": P, "N": N, "moments_row": name, "state_bytes_per_element": [first, last]})
            moment_rows.append([f"{P / 1e6:.0f}M", N, name, f"{first:.4f} (rank 0), {last:.4f} (rank {N - 1})",
                                f"mean over ranks 12 - 4F = {12 - 4 * f:.2f}; 8 to 12 by rank"])
    if moment_rows:
        print("\noptimizer state (master + moments + 0-d leaves) per element of the shard, rank 0 of N (simulated)\n")
        print(table(moment_rows, ["P", "N", "params + master + moments", "bytes / element", "goal"]))
    off_rows = []
    for P in map(int, args.offload_sizes):
        for N in args.world_sizes:
            m = measure_offload(P, N, device)
            results.append({"P": P, "N": N, "offload": m})
            off_rows.append([f"{P / 1e6:.0f}M", N, f"{m['device_bytes'] / GB:.3f}", f"{m['offload_bytes'] / GB:.3f}",
                             f"{(m['device_bytes'] - m['offload_bytes']) / GB:.3f}", f"{12 * P / N / GB:.3f}",
                             f"{m['device_s'] * 1e3:.1f}", f"{m['offload_s'] * 1e3:.1f}"])
    if off_rows:
        print(f"\noffload='cpu' (eager step): GiB on {device.type} after a step, and step ms (median)\n")
        print(table(off_rows, ["P", "N", "on device", "offload", "drop", "12P/N", "step ms on device",
                               "step ms offload"]))
    if args.json:
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
