"""Numerics of the main job: FP32, FP16 (dynamic loss scale), BF16 and BF16 + remainder master,
at 1 and 2 ranks, side by side in one run.

Each row is ``examples/train.py`` (the nano GPT on the embedded text, same seed, same global
batch), eager (``--no-compile``), run here as a subprocess (``torchrun`` for 2 ranks). The table
gives the final val loss, its difference from FP32 at the same rank count, the largest per-step
difference of the training loss from FP32, and whether the run's params are bitwise those of
another row. Goals it checks: FP16 and BF16 final val loss within 1% of FP32; BF16 + remainder
bitwise equal to BF16 with an FP32 master (same losses at every step, same params sha256).

    python benchmarks/numerics.py                   # 600 steps, 8 runs (about 10 minutes on 2 CPU cores)
    python benchmarks/numerics.py --steps 60        # a quick look

``--moments``: AdamW's moments stored in FP32, BF16 or 8 bits (``train.py --moments``), with the
FP32 master and with the remainder, BF16 params, 1 rank, seeds 1-3 (``--seeds``) at the main
job's learning rate (``--lrs 3e-3 1e-2``: also a harder one); goals: the mean final val loss
within 1% of FP32 moments, every loss finite, no extra skipped steps.

    python benchmarks/numerics.py --moments --lrs 3e-3 1e-2   # 30 runs, about 20 minutes

``--optimizers``: AdamW against Muon + AdamW (``train.py --optimizer muon``: Muon on the blocks'
matrices), Lion (``--optimizer lion``, at its own ``--lr`` and ``--weight-decay``:
``OPTIMIZER_FLAGS``), AdEMAMix (``--optimizer ademamix``), LAMB (``--optimizer lamb``),
Schedule-Free AdamW (``--optimizer schedule_free``, evaluated at its averaged params) and
Adafactor (``--optimizer adafactor``) at equal steps, FP16 params, 1 rank, seeds 1-3: final val loss, time per step and state per param against
AdamW's, as measured.

    python benchmarks/numerics.py --optimizers                 # 21 runs
    python benchmarks/numerics.py --optimizers ademamix        # AdamW and AdEMAMix only
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "examples", "train.py")
ROWS = [("fp32", "fp32"), ("fp16", "fp32"), ("bf16", "fp32"), ("bf16", "remainder")]


def run(dtype: str, master: str, ranks: int, steps: int, out: str, *, moments: str = "fp32", seed: int = 0,
        lr: float | None = None, optimizer: str = "adamw", weight_decay: float | None = None) -> dict:
    """One main-job run; ``{"losses": [...], "summary": {...}}`` from its metrics.jsonl."""
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={ranks}"]
    cmd = [*launcher, TRAIN, "--device", "cpu", "--no-compile", "--dtype", dtype, "--keep-master", master,
           "--moments", moments, "--optimizer", optimizer, "--seed", str(seed), "--steps", str(steps), "--out", out,
           *([] if lr is None else ["--lr", str(lr)]),
           *([] if weight_decay is None else ["--weight-decay", str(weight_decay)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {"losses": [r["loss"] for r in lines[1:-1]], "summary": lines[-1]["summary"]}


# --optimizers: each optimizer's flags beside train.py's defaults. Lion's steps are lr per
# element: a third of AdamW's lr and 10x its decay (the best of lr 3e-4, 6e-4, 1e-3 at weight
# decay 0.1 on one seed, docs/optimizers.md). LAMB's are lr times each param's norm: 10x AdamW's
# lr (the best of 3e-3, 1e-2, 3e-2 on seed 1). Adafactor's are min(lr, 1/sqrt(t)) times each
# param's RMS: lr 0.1 (the best of 1e-2, 3e-2, 0.1, 0.3 on seed 1).
OPTIMIZER_FLAGS = {"adamw": {}, "muon": {}, "lion": {"lr": 1e-3, "weight_decay": 0.1}, "ademamix": {}, "lamb": {"lr": 3e-2},
                   "schedule_free": {}, "adafactor": {"lr": 0.1}}

# --moments: (master, moments) against (fp32, fp32), BF16 params
MOMENT_ROWS = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"), ("remainder", "bf16"), ("remainder", "int8")]


def moments_table(args, table) -> list:
    """The moment-dtype rows: BF16 params, each (master, moments) of ``MOMENT_ROWS`` over
    ``--seeds`` at each ``--lrs``; goals: the mean final val loss within 1% of FP32 moments, no
    more skipped steps, every loss finite."""
    jobs, t0 = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for lr in args.lrs:
            for master, moments in MOMENT_ROWS:
                for seed in args.seeds:
                    key = (lr, master, moments, seed)
                    out = os.path.join(tmp, f"{lr}-{master}-{moments}-{seed}")
                    jobs[key] = pool.submit(run, "bf16", master, 1, args.steps, out, moments=moments, seed=seed, lr=lr)
        results = {key: job.result() for key, job in jobs.items()}
    rows, goals = [], []
    for lr in args.lrs:
        def stats(master, moments):
            runs = [results[(lr, master, moments, s)] for s in args.seeds]
            vals = [r["summary"]["final_val_loss"] for r in runs]
            finite = all(x == x and abs(x) != float("inf") for r in runs for x in r["losses"] if x is not None)
            return sum(vals) / len(vals), vals, sum(r["summary"]["skipped_steps"] for r in runs), finite

        ref, _, ref_skipped, _ = stats("fp32", "fp32")
        for master, moments in MOMENT_ROWS:
            mean, vals, skipped, finite = stats(master, moments)
            name = f"lr {lr:g}: master {master}, moments {moments}"
            rows.append([name, f"{mean:.5f}", f"{100 * (mean - ref) / ref:+.2f}%", ", ".join(f"{v:.4f}" for v in vals),
                         skipped, "yes" if finite else "NO"])
            if (master, moments) != ("fp32", "fp32"):
                goals.append((f"{name}: mean final val within 1% of FP32 moments, no divergence, no extra skips",
                              abs(mean - ref) <= 0.01 * ref and finite and skipped <= ref_skipped))
    title = (f"AdamW's moments on the main job (nano GPT, BF16 params, 1 rank, eager), {args.steps} steps, seeds "
             f"{args.seeds}; {time.perf_counter() - t0:.0f} s")
    header = ["run", "final val loss (mean)", "vs FP32 moments", "per seed", "skipped", "losses finite"]
    summaries = {"/".join(map(str, k)): v["summary"] for k, v in results.items()}
    return report(title, table(rows, header), goals, args, summaries)


def optimizers_table(args, table) -> list:
    """AdamW against the other optimizers of ``train.py --optimizer`` (``OPTIMIZER_FLAGS``; those
    named by ``--optimizers``) on the main job: FP16 params with the dynamic loss scale, 1 rank,
    the same steps, ``--seeds``; reported as measured -- final val loss, time per step (from the
    runs' tokens per second, two runs side by side on the cores) and the optimizer state per
    param (FP32 master, the transform's state, the decay mask) against AdamW's -- with no goal on
    which wins, and the one goal that each trains: every loss finite, no extra skips."""
    names = ["adamw", *[o for o in (args.optimizers or OPTIMIZER_FLAGS) if o != "adamw"]]
    jobs, t0 = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for optimizer in names:
            for seed in args.seeds:
                out = os.path.join(tmp, f"{optimizer}-{seed}")
                jobs[(optimizer, seed)] = pool.submit(run, "fp16", "fp32", 1, args.steps, out, seed=seed,
                                                      optimizer=optimizer, **OPTIMIZER_FLAGS[optimizer])
        results = {key: job.result() for key, job in jobs.items()}
    stats = {}
    for optimizer in names:
        runs = [results[(optimizer, s)] for s in args.seeds]
        vals = [r["summary"]["final_val_loss"] for r in runs]
        finite = all(x == x and abs(x) != float("inf") for r in runs for x in r["losses"] if x is not None)
        tokens_per_s = sum(r["summary"]["mean_tokens_per_s"] for r in runs) / len(runs)
        state = runs[0]["summary"]["opt_state_bytes_per_rank"] / runs[0]["summary"]["param_count"]
        stats[optimizer] = (sum(vals) / len(vals), vals, sum(r["summary"]["skipped_steps"] for r in runs), finite,
                            tokens_per_s, state)
    ref, ref_speed = stats["adamw"][0], stats["adamw"][4]
    flags = lambda o: " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in OPTIMIZER_FLAGS[o].items()) or "defaults"  # noqa: E731
    rows = [[name, flags(name), f"{mean:.5f}", f"{100 * (mean - ref) / ref:+.2f}%", ", ".join(f"{v:.4f}" for v in vals),
             f"{ref_speed / speed:.2f}x", f"{state:.2f}", skipped, "yes" if finite else "NO"]
            for name, (mean, vals, skipped, finite, speed, state) in stats.items()]
    goals = [(f"{o}: every loss finite, no more skipped steps than adamw", stats[o][3] and stats[o][2] <= stats["adamw"][2])
             for o in names if o != "adamw"]
    title = (f"AdamW against {', '.join(names[1:])} on the main job (nano GPT, FP16 params, 1 rank, eager), "
             f"{args.steps} steps, seeds {args.seeds}; {time.perf_counter() - t0:.0f} s")
    header = ["optimizer", "flags", "final val loss (mean)", "vs adamw", "per seed", "time/step vs adamw",
              "state B/param", "skipped", "losses finite"]
    summaries = {"/".join(map(str, k)): v["summary"] for k, v in results.items()}
    return report(title, table(rows, header), goals, args, summaries)


def report(title: str, rows_table: str, goals: list, args, results) -> list:
    """Print the table and each goal (met / NOT MET); with ``--json``, write them too."""
    print(f"\n{title}\n")
    print(rows_table)
    print()
    for what, ok in goals:
        print(f"{'met' if ok else 'NOT MET'}: {what}")
    if args.json:
        from common import write_json  # on sys.path since main (as table)

        write_json(args.json, {"steps": args.steps, "results": results, "goals": goals})
    return goals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--moments", action="store_true",
                    help="instead: the moment-dtype table (BF16 params; FP32, BF16, int8 moments; FP32 master or remainder)")
    ap.add_argument("--optimizers", nargs="*", choices=list(OPTIMIZER_FLAGS),
                    help="instead: AdamW against the optimizers named (none named: every one of train.py "
                         "--optimizer), FP16 params, 1 rank, --seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="--moments, --optimizers: seeds (%(default)s)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-3], help="--moments: peak learning rates (%(default)s)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from common import table

    if args.moments:
        return moments_table(args, table)
    if args.optimizers is not None:
        return optimizers_table(args, table)

    results, t0 = {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            # one-rank runs use one core each (OMP_NUM_THREADS=1): two at a time on a 2-core box
            with concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 1) // ranks)) as pool:
                jobs = {}
                for dtype, master in ROWS:
                    key = f"{dtype}{' + remainder' if master == 'remainder' else ''}, {ranks} rank(s)"
                    jobs[key] = pool.submit(run, dtype, master, ranks, args.steps, os.path.join(tmp, key.replace(" ", "_")))
                for key, job in jobs.items():
                    results[key] = job.result()
                    print(f"{key}: final val {results[key]['summary']['final_val_loss']:.5f}", file=sys.stderr, flush=True)
    rows, goals = [], []
    for ranks in args.ranks:
        base = results[f"fp32, {ranks} rank(s)"]
        for dtype, master in ROWS:
            key = f"{dtype}{' + remainder' if master == 'remainder' else ''}, {ranks} rank(s)"
            r = results[key]
            val, ref = r["summary"]["final_val_loss"], base["summary"]["final_val_loss"]
            gap = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]) if a is not None and b is not None)
            same_as = [k for k, o in results.items() if k != key and o["summary"]["params_sha256"] == r["summary"]["params_sha256"]]
            rows.append([key, f"{val:.5f}", f"{100 * (val - ref) / ref:+.3f}%", f"{gap:.4f}",
                         r["summary"]["skipped_steps"], ", ".join(same_as) or "-"])
            if dtype in ("fp16", "bf16") and master == "fp32":
                goals.append((f"{key}: final val within 1% of FP32", abs(val - ref) <= 0.01 * ref))
            if master == "remainder":
                plain = results[f"bf16, {ranks} rank(s)"]
                bitwise = r["losses"] == plain["losses"] and r["summary"]["params_sha256"] == plain["summary"]["params_sha256"]
                goals.append((f"{key}: bitwise equal to BF16 with an FP32 master", bitwise))
    title = (f"The main job (nano GPT, embedded text, seed 0, global batch 16, eager), {args.steps} steps; "
             f"{time.perf_counter() - t0:.0f} s")
    header = ["run", "final val loss", "vs FP32", "max |train loss - FP32|", "skipped", "params bitwise equal to"]
    return report(title, table(rows, header), goals, args, results)


if __name__ == "__main__":
    main()
