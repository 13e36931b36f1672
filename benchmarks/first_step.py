"""Time to the first step: the main job's, and a compiled ``engine.step``'s, cold and warm.

Each measurement runs in a fresh process. *Cold*: empty caches (a new ``TORCHINDUCTOR_CACHE_DIR``
and a new ``FZERO_CACHE_DIR``; fzero's own CPU kernel stays built, as on any machine after its
first run). *Warm*: the same command again with those caches. Both programs call
``fzero.compile_cache.warm_start()`` before compiling.

* main job: ``python examples/train.py --device cpu --steps 4`` (one process), its first step's
  ``step_time_s`` from ``metrics.jsonl`` (the compiled loss and step: trace, lower, build or load
  the kernels, run), beside the fourth step's, and the whole process's wall time;
* engine step: ``torch.compile(engine.step, fullgraph=True)``'s first call on ``--numel`` FP16
  params split into 12 and into 1,200 leaves (AdamW, world size 1, ``donate=True``), from the
  flat buffer (the main job's form) and from the grads pytree, and its second call.

Medians over ``--runs`` cold/warm pairs, with the 1-minute load average before each pair.

    python benchmarks/first_step.py                      # main job and engine step, 3 runs
    python benchmarks/first_step.py --only engine --numel 1e8 --leaves 12 1200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import cpu_model, table, write_json  # noqa: E402


def run(cmd: list[str], cache: str) -> float:
    """Wall seconds of ``cmd`` in a fresh process with inductor's cache in ``cache/inductor`` and
    fzero's (``fzero.compile_cache``) in ``cache/fzero``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "FZERO_CACHE_DIR": os.path.join(cache, "fzero"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"first_step.py: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def main_job(cache: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        wall = run([sys.executable, "examples/train.py", "--device", "cpu", "--steps", "4", "--log-every", "1",
                    "--out", out], cache)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = {r["step"]: r["step_time_s"] for r in rows if "step" in r and "step_time_s" in r}
    return {"first_s": steps[1], "later_s": steps[max(steps)], "process_s": wall}


def engine(cache: str, numel: int, leaves: int, form: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        wall = run([sys.executable, __file__, "--child", "--numel", str(numel), "--leaves", str(leaves), "--form", form,
                    "--child-out", f.name], cache)
        with open(f.name) as result:
            return {**json.load(result), "process_s": wall}


def child(args) -> None:
    """Build the engine, then time the compiled step's first and second calls."""
    import optree
    import torch

    sys.path.insert(0, ROOT)
    import fzero
    from fzero import transforms

    torch.manual_seed(0)
    (leaves,) = args.leaves
    params = {f"p{i:04d}": torch.randn(args.numel // leaves) for i in range(leaves)}
    engine = fzero.zero1(transforms.adamw(lr=1e-3, weight_decay=0.1), param_dtype=torch.float16, loss_scale=None,
                         donate=True)
    params, state, ss = engine.init(params)
    fzero.compile_cache.warm_start()  # as the main job does
    step = torch.compile(engine.step, fullgraph=True)
    times = []
    for _ in range(2):
        grads = optree.tree_map(lambda p: torch.randn_like(p, dtype=torch.float32).half(), params)
        if args.form == "flat":
            params, grads = engine.flat_params(params), fzero.flatten(grads, engine.layout)
        t0 = time.perf_counter()
        params, state, ss, _ = step(params, grads, state, ss)
        times.append(time.perf_counter() - t0)
        if args.form == "flat":
            params = fzero.unflatten(params, engine.layout)
    write_json(args.child_out, {"first_s": times[0], "second_s": times[1]})


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["main", "engine"], help="measure one of the two (default: both)")
    ap.add_argument("--runs", type=int, default=3, help="cold/warm pairs per row: %(default)s")
    ap.add_argument("--numel", type=float, default=1e7, help="engine step: params: %(default)g")
    ap.add_argument("--leaves", type=int, nargs="+", default=[12, 1200], help="engine step: leaf counts: %(default)s")
    ap.add_argument("--forms", nargs="+", choices=["flat", "pytree"], default=["flat", "pytree"])
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--form", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.numel = int(float(args.numel))
        return child(args)
    numel = int(args.numel) // max(args.leaves) * max(args.leaves)
    cases = ([("main job", lambda c: main_job(c))] if args.only in (None, "main") else []) + (
        [(f"engine.step, {numel:.3g} FP16 params in {n} leaves, from the {form}",
          lambda c, n=n, form=form: engine(c, numel, n, form))
         for form in args.forms for n in args.leaves] if args.only in (None, "engine") else [])
    rows, results = [], []
    for name, measure in cases:
        cold, warm, loads = [], [], []
        for _ in range(args.runs):
            loads.append(os.getloadavg()[0])
            with tempfile.TemporaryDirectory(prefix="caches-") as cache:
                cold.append(measure(cache))
                warm.append(measure(cache))
        later = "later_s" if "later_s" in cold[0] else "second_s"
        rows.append([name, f"{median(cold, 'first_s'):.2f}", f"{median(warm, 'first_s'):.2f}",
                     f"{median(warm, later):.3f}", f"{median(cold, 'process_s'):.1f}", f"{median(warm, 'process_s'):.1f}",
                     f"{statistics.median(loads):.2f}"])
        results.append({"case": name, "cold": cold, "warm": warm, "load": loads})
    import torch
    print(f"\ntime to the first step, median of {args.runs} runs (fresh processes), {cpu_model()} x{os.cpu_count()}, "
          f"torch {torch.__version__}\n")
    print(table(rows, ["case", "first step, cold s", "first step, warm s", "a later step s", "process, cold s",
                       "process, warm s", "load (1 min)"]))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": results})
    return results


if __name__ == "__main__":
    main()
