"""The reference fzero training loop: ZeRO-1 mixed-precision AdamW on a GPT (or an MLP).

    python examples/train.py                                       # one process
    torchrun --standalone --nproc_per_node=2 examples/train.py     # 2 data-parallel ranks
    make train                                                     # nano GPT, FP16, 2 CPU ranks

Every rank samples the same global batch and trains on its own rows of it. The engine
reduce-scatters the grads (with --bucket-mb, bucket by bucket while backward still runs:
engine.grad_and_value), updates this rank's 1/N shard of the FP32 master weights and Adam
moments, and all-gathers the new FP16/BF16 params. The default data is character-level
Python: the standard library's own sources (see data.py); --data FILE trains on your text.

The loss (as a function of the flat param buffer) and the optimizer step are compiled
(torch.compile; --no-compile runs both eagerly; recipe.make_train_step says which is which), and the
loop syncs the host only at log steps: every --log-every steps, and at the steps that sync anyway
(evaluation, collective timing, checkpoints: --save-every stages the state and writes it in the
background, saving.py). Until then the per-step loss, found_inf, loss scale
and grad norm stay 0-d tensors on the device.

Writes <out>/metrics.jsonl: first {"config": ...} (every flag, world size, device, torch and
fzero versions, param count, optimizer-state bytes per rank), then one record per step (written
at the log steps; step_time_s and tokens_per_s are the means over the steps since the last log),
then {"summary": ...} (its "checkpoints" lists the ones saved, "compiled_graphs" the graphs
torch.compile made in the process -- the loss and the step, however long the run, the step
alone with --bucket-mb; after --resume its "resumed" holds
the checkpoint, its step and the hyperparameters the run continued with); <out>/loss.png
(loss, learning rate, loss scale); and <out>/model.safetensors, the params the run ends at (the
ones it evaluates: Schedule-Free's averaged x) in --dtype, keyed by leaf path
(``fzero.checkpoint.export_full``).

--resume DIR continues a checkpoint at any world size. A checkpoint records the flags that define
the training (--model, --config, --block-size, --mlp-dims, --dtype, --keep-master, --moments, --data, --seed,
--batch-size, --steps, --lr, --warmup, --weight-decay, --grad-clip) and --resume takes each one
not given from it, so "--resume DIR" alone continues the saved run exactly. A given one that
differs from the checkpoint's takes effect (a longer run, another learning rate, another seed:
other batches from there on), except the model's -- --model, --config, --block-size, --mlp-dims,
--dtype -- and a --grad-clip that turns clipping on or off: those are flag errors. One line names
the flags taken from the checkpoint (where they differ from the defaults) and the given ones that
differ from it; the config record holds both under "resumed". Resumed into the directory that
holds the checkpoint (--out <run>, --resume <run>/ckpt/step-N, also where that is a symlink to
another volume), the run continues that directory's metrics.jsonl: it keeps the records up to
step N, drops the later ones (the steps it replaces), appends a config record and its own, and
loss.png plots the whole run. Into another directory the log starts afresh. Either way
skipped_total goes on from the checkpoint's count (the summary's skipped_steps and steps count
this process's steps).

Progress: a tqdm bar on a terminal; without one (a file, a pipe, a terminal with no size) one
line per log step. A bad flag stops the run before any work with one line naming it and a valid
value, exit code 2.
"""
from __future__ import annotations

import json
import os
import time

import torch

import fzero
from fzero import transforms
from flags import DTYPES, UsageError, check_args, given_flags, parse_args, resume_line, training_flags
from ranks import exit_usage, gather_to_all, init_distributed, launched, rows_of
from recipe import (build, eval_params, evaluate, load_data, lr_schedule, make_mesh, make_optimizer, make_train_step,
                    schedule_count)
from reporting import (LogWindow, Progress, compiled_graphs, config_record, make_profiler, open_metrics, plot,
                       print_summary, sha256, summarize, warn_stuck)
from saving import BackgroundSaves


KEPT_MASTER = {"fp32": "FP32 master", "remainder": "int16 master remainder", "params": "the FP32 params as master"}


def check_resume_step(path: str) -> None:
    """The --resume checkpoint records the step it was saved at, ``extra["step"]``, as
    --save-every's do (fzero checks that one is an integer >= 0); ``UsageError`` naming the file
    and the key if it does not."""
    try:
        extra = fzero.checkpoint.read_manifest(path)["extra"]
    except fzero.checkpoint.CheckpointError as e:  # (check_args read it: changed since)
        raise UsageError(f"--resume {path}: {e}") from None
    if "step" not in extra:
        raise UsageError(f"--resume {path}: its manifest.json has no extra[\"step\"], the step train.py records "
                         "with each checkpoint (saved by other code?); resume from a checkpoint of --save-every")


def main(argv=None):
    args = parse_args(argv, description=__doc__)
    # Every bad flag fails here, before any rank joins a group or builds a model: one line, from
    # rank 0 only, exit code 2 (argparse's convention).
    world, rank = launched()
    try:
        resume = check_args(args, world, given_flags(argv))  # with --resume: the flags it took from the checkpoint
        if args.resume:  # checked once here: every rank reads extra["step"] after the load
            check_resume_step(args.resume)
        data = load_data(args)
    except UsageError as e:
        exit_usage("train.py", e, rank)
    if args.check_args:
        return
    device, rank, world = init_distributed(args.device)
    mine = rows_of(rank, world, args.batch_size)

    def my_rows(batch):  # this rank's rows of a global batch
        return tuple(t[mine].to(device) for t in batch)

    params_fp32, loss_fn, seq_items = build(args, data, device)

    # fzero: the optimizer (optax-style transforms), the engine, its state.
    tx = make_optimizer(args)
    dtype = DTYPES[args.dtype]
    loss_scale = fzero.DynamicLossScale() if dtype == torch.float16 else None  # BF16 and FP32 need none
    bucket_bytes = int(args.bucket_mb * 2**20) or None
    # donate: the loop never reuses a step's inputs, so the step writes state and params in place
    # (no new shard-sized buffers each step; on a CPU those are fresh pages from the OS).
    mesh = make_mesh(args.mesh, device)  # None: ZeRO-1 over all ranks
    engine = fzero.zero1(tx, param_dtype=dtype, loss_scale=loss_scale, bucket_bytes=bucket_bytes, donate=True, mesh=mesh,
                         master=args.keep_master)
    shards = engine.comm.world_size  # the optimizer state is split over these ranks
    params, state, scaler_state = engine.init(params_fp32)  # params in --dtype; FP32 state, 1/N of it

    state_bytes = engine.state_bytes(state)
    n_params = engine.layout.numel
    tokens_per_step = args.batch_size * seq_items
    val_batches = [my_rows(data.get_batch("val", i, args.batch_size, args.seed)) for i in range(args.eval_batches)]

    name = f"gpt {args.config}" if args.model == "gpt" else f"mlp {args.mlp_dims}"
    out = args.out or os.path.join("runs", f"{args.model}-{args.dtype}-{time.strftime('%Y%m%d-%H%M%S')}")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        if resume and resume_line(resume):
            print(resume_line(resume))
        print(f"{name}: {n_params:,} params | {args.dtype} | {world} rank(s) on {device.type} | {data}")
        how = f"{args.mesh[0]} replicas x {shards} shards" if args.mesh else f"{shards} shard(s)"
        kept = KEPT_MASTER[args.keep_master]
        moments = {"adamw": f"2 {args.moments} moments", "lion": f"Lion's {args.moments} momentum",
                   "ademamix": "AdEMAMix's 3 fp32 moments", "lamb": "LAMB's 2 fp32 moments",
                   "schedule_free": "Schedule-Free's z and second moment, fp32",
                   "adafactor": "Adafactor's fp32 row and column statistics (whole) and the vectors' second moment",
                   "muon": f"Muon's momentum on the blocks' matrices, 2 {args.moments} moments on the rest"}[args.optimizer]
        print(f"optimizer state: {state_bytes / 2**20:.2f} MiB per rank ({kept} + {moments} + the decay mask, "
              f"1/{shards} each: "
              f"{how}); {len(engine.layout.buckets)} communication bucket(s)")

    first_step, resumed, extra = 1, None, {}
    if args.resume:  # same model and optimizer, any world size; batches are seeded by step
        # The hyperparameters of this command line (--weight-decay, --grad-clip) take effect;
        # load warns about each one that differs from the checkpoint's.
        params, state, scaler_state, extra = fzero.checkpoint.load(args.resume, engine)
        first_step = extra["step"] + 1
        # The stored ones (a scheduled lr is not), once, before the loop.
        hyperparams = {name: float(v) for name, v in transforms.iter_hyperparams(state)}
        resumed = {"from": args.resume, "step": extra["step"], "hyperparams": hyperparams}
        if rank == 0:
            print(f"resumed from {args.resume} at step {extra['step']} with hyperparameters {json.dumps(hyperparams)}")

    # Opened once the checkpoint has loaded: a resume that fails leaves the run's log as it was.
    log, earlier = open_metrics(out, args.resume, first_step - 1) if rank == 0 else (None, [])
    if log:
        log.write(json.dumps(config_record(args, world, device, n_params, state_bytes, resume)) + "\n")

    if args.compile:  # the caches a compiled start can use (fzero.compile_cache: docs/startup.md)
        fzero.compile_cache.warm_start()
    train_step = make_train_step(engine, loss_fn, compile=args.compile)
    lr_fn, to_evaluate = lr_schedule(args), eval_params(engine, args)
    window = LogWindow(tokens_per_step, state_bytes, skipped=extra.get("skipped_total", 0))  # over the whole run
    records, warned_stuck, flags = [], False, training_flags(args)
    profiler = make_profiler(args.profile, rank)
    progress = Progress(rank == 0, first_step, args.steps)
    saves = BackgroundSaves(progress)
    start = time.perf_counter()
    with profiler as prof:
        for step in progress:
            batch = my_rows(data.get_batch("train", step, args.batch_size, args.seed))
            lr = lr_fn(schedule_count(state))  # the rate this step applies (a device tensor)
            params, state, scaler_state, loss, info = train_step(params, state, scaler_state, batch)
            window.add(step, loss, info, lr)  # still tensors: no host sync between log steps

            # A log step: every --log-every steps, the last one, and the steps that sync anyway
            # (evaluation, collective timing, checkpoint). The window's only host sync is here.
            evaluate_now = step == args.steps or (args.eval_every > 0 and step % args.eval_every == 0)
            time_comm_now = args.comm_every and world > 1 and (step % args.comm_every == 0 or step == first_step)
            save_now = args.save_every and (step % args.save_every == 0 or step == args.steps)
            if step % args.log_every == 0 or step == args.steps or evaluate_now or time_comm_now or save_now:
                new, stuck = window.drain()
                if evaluate_now:
                    new[-1]["val_loss"] = evaluate(to_evaluate(params, state), loss_fn, val_batches)
                if time_comm_now:
                    comm = engine.time_collectives()  # per bucket, each alone, max over ranks
                    new[-1]["comm_ms"] = {k: [round(t, 3) for t in ts] for k, ts in comm.items()}
                records += new
                if log:
                    log.writelines(json.dumps(r) + "\n" for r in new)
                    log.flush()
                progress.log(new[-1])
                if stuck and not warned_stuck:  # rare: find the culprits off the hot path
                    warned_stuck = True
                    warn_stuck(loss_fn, params, scaler_state, batch, rank)
                saves.poll()
                if save_now:  # in the background: the next steps run while it is written
                    saves.start(os.path.join(out, "ckpt", f"step-{step}"), params, state, scaler_state, engine,
                                extra={"step": step, "skipped_total": window.skipped, "flags": flags})  # what --resume reads
                window.restart_clock()  # evaluation, timing and checkpoints are not step time
            if prof:
                prof.step()
    total_time = time.perf_counter() - start
    saves.finish()  # the last checkpoint is committed before the run ends
    progress.close()
    # The trained model as one safetensors file keyed by leaf path, in --dtype: the params it is
    # evaluated at (Schedule-Free: its averaged sequence x), to serve or fine-tune elsewhere.
    weights = os.path.join(out, "model.safetensors")
    fzero.checkpoint.export_full(weights, to_evaluate(params, state), engine)

    # Every rank hashes its full param buffer: ZeRO-1 must leave them bit-identical.
    digests = gather_to_all(sha256(fzero.flatten(params, engine.layout)))
    summary = summarize(records, args, world, n_params, state_bytes, tokens_per_step, total_time, digests)
    summary["checkpoints"] = saves.saved
    summary["weights"] = weights
    summary["compiled_graphs"] = compiled_graphs()  # a recompile would show here
    if resumed:
        summary["resumed"] = resumed
    if rank == 0:
        log.write(json.dumps({"summary": summary}) + "\n")
        log.close()
        plot_path = plot(earlier + records, os.path.join(out, "loss.png"), title=f"{name}, {args.dtype}, {world} rank(s)")
        print_summary(summary, log.name, plot_path, args.profile)
    fzero.shutdown()  # every rank leaves together and the process group's threads end here


if __name__ == "__main__":
    main()
