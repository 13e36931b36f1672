"""Chart a ``benchmarks/step.py --json`` result: milliseconds per step, one bar per row, with
each bar's ratio to torch's fused AdamW written on it (log scale: the rows span 100x).

    python benchmarks/plot.py benchmarks/results/step_cpu.json -o benchmarks/results/step_cpu.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FUSED = "torch AdamW(fused=True), FP32 params"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    res = json.load(open(args.json))
    names, ms = list(res["ms"]), list(res["ms"].values())
    fused = res["ms"].get(FUSED)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.2))
    colors = ["#999999" if n.startswith("floor") else "#d62728" if n.startswith("fzero") else "#1f77b4" for n in names]
    ax.barh(range(len(names)), ms, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per optimizer step (log scale)")
    for i, t in enumerate(ms):
        label = f"{t:.1f} ms" + (f"  ({t / fused:.2f}x fused)" if fused else "")
        ax.text(t * 1.05, i, label, va="center", fontsize=8)
    ax.set_xlim(min(ms) / 2, max(ms) * 8)
    ax.set_title(f"{res['numel']:.3g} elements, {res['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
