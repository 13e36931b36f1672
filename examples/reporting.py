"""What the main job (examples/train.py) reports: the per-step records of a log window (kept on
the device until a log step), the progress bar or lines, ``<out>/metrics.jsonl`` (its config
record, its continuation after a resume), the end-of-run summary, the loss plot, the profiler's
trace and the warning that names the leaves of a stuck loss scale."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import time

import torch
from tqdm import tqdm

import fzero
from ranks import gather_to_all, mean_over_ranks


# ---------------------------------------------------------------- the log window and the progress
class LogWindow:
    """The steps since the last log step. Their per-step quantities (loss, found_inf, loss
    scale, grad norm) stay 0-d tensors on the device until ``drain`` converts them all at once,
    so the loop syncs the host once per window, not once per step."""

    INFO_KEYS = ("found_inf", "loss_scale", "grad_norm", "scale_stuck", "lr")

    def __init__(self, tokens_per_step: int, state_bytes: int, skipped: int = 0):
        self.tokens_per_step, self.state_bytes = tokens_per_step, state_bytes
        self.skipped = skipped  # over the whole run: a resumed run starts from the checkpoint's count
        self.steps, self.losses, self.infos = [], [], []
        self.restart_clock()

    def restart_clock(self):
        """The window's step time counts from now."""
        self.t0 = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, info: dict, lr: torch.Tensor):
        """Keep one step's 0-d loss, engine ``info`` and learning rate, as they are (no sync)."""
        self.steps.append(step)
        self.losses.append(loss)
        self.infos.append({**info, "lr": lr})

    def drain(self) -> tuple[list[dict], bool]:
        """``(records, stuck)``: one metrics record per step of the window (``val_loss`` None),
        and whether the loss scale was stuck at any of them; the window is then empty. One
        all-reduce (the losses' mean over ranks) and one host sync for the whole window. The
        step time is the window's wall time per step: the sync ends it, so it is the time the
        device took too, not just the time to queue the work."""
        columns = {"loss": mean_over_ranks(torch.stack(self.losses))}
        columns.update({k: torch.stack([info[k] for info in self.infos]) for k in self.INFO_KEYS})
        columns = {k: v.tolist() for k, v in columns.items()}  # the host sync
        step_time = (time.perf_counter() - self.t0) / len(self.steps)
        records = []
        for i, step in enumerate(self.steps):
            self.skipped += columns["found_inf"][i]
            records.append({
                "step": step,
                "loss": finite_or_none(columns["loss"][i]),
                "val_loss": None,
                "lr": columns["lr"][i],
                "loss_scale": columns["loss_scale"][i],
                "found_inf": columns["found_inf"][i],
                "skipped_total": self.skipped,
                "grad_norm": finite_or_none(columns["grad_norm"][i]),
                "step_time_s": step_time,
                "tokens_per_s": self.tokens_per_step / step_time,
                "opt_state_bytes": self.state_bytes,
            })
        self.steps, self.losses, self.infos = [], [], []
        return records, any(columns["scale_stuck"])


def finite_or_none(x: float):
    return x if math.isfinite(x) else None  # JSON has no inf/NaN


class Progress:
    """The loop's steps, with progress on rank 0: a tqdm bar on a sized terminal; otherwise (a
    file, a pipe, a terminal with no size: CI, ``docker exec``) one plain line per log step."""

    def __init__(self, show: bool, first: int, last: int):
        self.show, self.last, self.val = show, last, None
        self.steps = range(first, last + 1)
        self.bar = tqdm(self.steps, unit="step", dynamic_ncols=True) if show and sized_terminal() else None

    def __iter__(self):
        return iter(self.bar if self.bar is not None else self.steps)

    def log(self, r: dict) -> None:
        """Show a log step's record (loss, val loss, lr, loss scale, tokens/s)."""
        if not self.show:
            return
        self.val = r["val_loss"] if r["val_loss"] is not None else self.val
        fields = {"loss": "n/a" if r["loss"] is None else f"{r['loss']:.3f}",
                  "val": "-" if self.val is None else f"{self.val:.3f}", "lr": f"{r['lr']:.2e}",
                  "scale": f"{r['loss_scale']:g}", "tok_s": f"{r['tokens_per_s']:,.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(fields)
        else:
            print(f"step {r['step']}/{self.last} | " + " | ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def write(self, line: str) -> None:
        if self.show:
            (self.bar.write if self.bar is not None else functools.partial(print, flush=True))(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sized_terminal() -> bool:
    """stderr (where tqdm draws) is a terminal that reports a width."""
    try:
        return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError):
        return False


def dir_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (a checkpoint's size)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------- metrics.jsonl
def open_metrics(out: str, resume: str | None, step: int):
    """``(file, earlier step records)``: ``<out>/metrics.jsonl`` opened for this run's records.

    A run resumed from a checkpoint inside ``out`` (its own ``<out>/ckpt/step-N``) continues the
    file: it keeps the lines up to the record of the resumed ``step`` -- the summary of a run
    that ended there too -- and drops the rest (the steps this run replaces, and the config and
    summary records of the run that took them); the kept step records come back for the plot.
    Any other run starts the file afresh."""
    path = os.path.join(out, "metrics.jsonl")
    if not (resume and in_run(resume, out) and os.path.isfile(path)):
        return open(path, "w"), []
    earlier, read, keep = [], 0, 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a crash: neither it nor what follows is kept
                break
            if not (isinstance(record, dict) and line.endswith(b"\n")) or record.get("step", 0) > step:
                break
            read += len(line)
            if "step" in record:
                earlier.append(record)
            if "config" not in record:  # a config record is kept only with a step after it: it starts a run
                keep = read
    os.truncate(path, keep)
    return open(path, "a"), earlier


def in_run(resume: str, out: str) -> bool:
    """Whether the checkpoint ``resume`` belongs to the run directory ``out``: it is under
    ``out`` as given (``<out>/ckpt/step-N``, even where the checkpoint, or ``ckpt``, is a
    symlink to another volume), or where it really lies."""
    real_out, real = os.path.realpath(out), os.path.realpath(resume)
    if os.path.commonpath([real, real_out]) == real_out:
        return True
    parent = os.path.dirname(os.path.abspath(resume))  # each directory on the way, its links resolved
    while os.path.realpath(parent) != real_out:
        if parent == os.path.dirname(parent):
            return False
        parent = os.path.dirname(parent)
    return True


def config_record(args, world: int, device: torch.device, n_params: int, state_bytes: int, resume: dict | None):
    """The first record of a run in metrics.jsonl: its settings (after a resume, from the resumed
    step on), to read a log without its command line."""
    config = {"args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
              "world_size": world, "device": str(device), "torch": torch.__version__, "fzero": fzero_version(),
              "param_count": n_params, "opt_state_bytes_per_rank": state_bytes}
    if resume:
        config["resumed"] = resume
    return {"config": config}


def fzero_version() -> str:
    try:
        return importlib.metadata.version("fzero")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- the end of the run
def summarize(records, args, world, n_params, state_bytes, tokens_per_step, total_time, digests) -> dict:
    val = [r["val_loss"] for r in records if r["val_loss"] is not None]
    return {
        "model": args.model,
        "dtype": args.dtype,
        "master": args.keep_master,
        "moments": args.moments,
        "optimizer": args.optimizer,
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": val[-1] if val else None,
        "best_val_loss": min(val) if val else None,
        "skipped_steps": sum(r["found_inf"] for r in records),
        "total_time_s": total_time,
        "mean_tokens_per_s": len(records) * tokens_per_step / total_time,
        "world_size": world,
        "global_batch_size": args.batch_size,
        "param_count": n_params,
        "opt_state_bytes_per_rank": state_bytes,
        "params_sha256": digests,
        "params_identical_across_ranks": len(set(digests)) == 1,
    }


def compiled_graphs() -> int:
    """The graphs torch.compile has made in this process (dynamo's ``unique_graphs``): the main
    job compiles the loss (with its backward) and the optimizer step once each (with several
    buckets the step alone); a recompile or a graph break adds one."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def sha256(t: torch.Tensor) -> str:
    """The SHA-256 of ``t``'s bytes, as hex."""
    # As bytes through numpy's buffer: bytes(untyped_storage()) builds them one int at a time
    # (seconds per MB).
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def print_summary(s, log_path, plot_path, trace_dir):
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    unit = "tokens" if s["model"] == "gpt" else "samples"
    same = "identical on every rank" if s["params_identical_across_ranks"] else "DIFFER across ranks"
    rows = [
        ("steps", f"{s['steps']} ({s['skipped_steps']} skipped on overflow)"),
        ("train loss", f"{fmt(s['first_loss'])} -> {fmt(s['final_loss'])}"),
        ("val loss", f"{fmt(s['final_val_loss'])} (best {fmt(s['best_val_loss'])})"),
        ("time", f"{s['total_time_s']:.1f} s, {s['mean_tokens_per_s']:,.0f} {unit}/s"),
        ("params", f"{s['param_count']:,} ({s['dtype']})"),
        ("optimizer state", f"{s['opt_state_bytes_per_rank']:,} bytes per rank, {s['world_size']} rank(s); "
                            f"{s['optimizer']}, master {s['master']}, moments {s['moments']}"),
        ("params sha256", f"{s['params_sha256'][0][:16]}... {same}"),
        ("weights", f"{s['weights']} (the params evaluated, {s['dtype']})"),
        ("compiled", f"{s['compiled_graphs']} graph(s) in this process"),
        ("metrics", log_path),
        ("plot", plot_path or "not written (matplotlib is not installed)"),
    ]
    if s["checkpoints"]:
        rows.append(("checkpoints", ", ".join(s["checkpoints"])))
    if trace_dir:
        rows.append(("profile", trace_dir))
    print()
    for name, value in rows:
        print(f"  {name:<16} {value}")


def plot(records, path, title):
    """Train and val loss against steps, and below them the learning rate and the loss scale,
    as a PNG; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if r["loss"] is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    skipped = [(r["step"], r["loss"]) for r in records if r["found_inf"] and r["loss"] is not None]
    fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(*zip(*train), lw=1, label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    if skipped:
        ax.plot(*zip(*skipped), "rx", label="skipped step (overflow)")
    ax.set(ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    steps = [r["step"] for r in records]
    low.plot(steps, [r["lr"] for r in records], color="tab:green", lw=1)
    low.set(xlabel="step", ylabel="learning rate")
    low.grid(alpha=0.3)
    scale = low.twinx()  # the loss scale spans orders of magnitude: its own log axis
    scale.plot(steps, [r["loss_scale"] for r in records], color="tab:purple", lw=1)
    scale.set(ylabel="loss scale", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- diagnostics
def make_profiler(trace_dir: str | None, rank: int):
    """Skip 1 step, warm up 1, record 3; then write a chrome trace (Perfetto, TensorBoard) into
    ``trace_dir``. Without one, a null context (which enters as None)."""
    if not trace_dir:
        return contextlib.nullcontext()
    os.makedirs(trace_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{rank}.json")),
    )


def warn_stuck(loss_fn, params, scaler_state, batch, rank):
    """The loss scale sits at its minimum and grads are still non-finite: name the leaves."""
    grads = torch.func.grad(lambda p: fzero.scale_loss(loss_fn(p, batch), scaler_state))(params)
    culprits = gather_to_all(fzero.nonfinite_leaves(grads))
    if rank == 0:
        where = "; ".join(f"rank {r}: {', '.join(c)}" for r, c in enumerate(culprits) if c) or "no leaf (the reduction)"
        tqdm.write(f"WARNING: loss scale stuck at {float(scaler_state.scale):g}: overflow persists at the minimum scale. "
                   f"Non-finite grads in {where}")
