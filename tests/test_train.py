"""End-to-end tests of examples/train.py, run as users run it (subprocesses; torchrun for ranks).

Small models and batches so the whole file takes about four minutes on 2 CPU cores, 45 s of it
the test marked slow. Most runs are eager (``--no-compile``): compiling the step
costs 5-20 s a process, so only the tests about the compiled main job pay for it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import pty
import select
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optree
import pytest
import torch
from safetensors.torch import load_file

import fzero
from fzero import transforms
from fzero.checkpoint import read_manifest
from fzero.models import gpt

import data
from helpers import (EXAMPLES, TRAIN, edit_manifest, forbid_host_syncs, grads_like, load_train_module, made_once, run_script,
                     tree_assert_close)
from ranks import RANK_0_REPORT_WAIT_S

STEP_KEYS = {
    "step", "loss", "val_loss", "lr", "loss_scale", "found_inf", "skipped_total",
    "grad_norm", "step_time_s", "tokens_per_s", "opt_state_bytes",
}
# A small character-level GPT: 2 layers, width 64, context 32.
SMALL_GPT = ["--model", "gpt", "--config", "nano", "--block-size", "32", "--batch-size", "8", "--eval-batches", "2"]


def train(out: Path, *args: str, nproc: int | None = None, compile: bool = False, timeout: float = 300,
          check: bool = True, script: Path = TRAIN):
    """Run examples/train.py (or ``script``, which runs it) into ``out`` (plain python, or
    torchrun with ``nproc`` ranks), with its step compiled (train.py's default) or
    ``--no-compile``; return ``(step records, summary, completed process)``."""
    launcher = [sys.executable]
    if nproc is not None:  # --standalone: a private rendezvous on a free port, so runs never collide
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    mode = "--compile" if compile else "--no-compile"
    cmd = launcher + [str(script), "--device", "cpu", "--out", str(out), mode, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_script(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=timeout)
    if not check:
        return None, None, proc
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    return (*read_log(out), proc)


def read_log(out: Path):
    """``(step records, summary)`` of the run in ``out`` (its metrics.jsonl)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "config" in lines[0], "the log must start with the config record"
    assert "summary" in lines[-1], "the log must end with the summary record"
    return lines[1:-1], lines[-1]["summary"]


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.e2e
def test_two_ranks_fp16_log_is_complete_loss_falls_params_agree(tmp_path):
    """The main job as `make train` runs it (2 ranks, FP16, the step compiled), smaller."""
    steps = 40
    records, summary, proc = train(
        tmp_path / "run", *SMALL_GPT, "--dtype", "fp16", "--steps", str(steps), "--eval-every", "10",
        "--bucket-mb", "0.1", "--comm-every", "20", nproc=2, compile=True,
    )
    # One record per step, in order, with every key and sane types.
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    skipped = 0
    for r in records:
        if r["step"] in (1, 20, 40):  # per-bucket collective times, every --comm-every steps and the first
            assert set(r) == STEP_KEYS | {"comm_ms"}
            assert sorted(r["comm_ms"]) == ["all_gather_ms", "reduce_scatter_ms"]
            assert len(r["comm_ms"]["reduce_scatter_ms"]) == len(r["comm_ms"]["all_gather_ms"]) >= 2
            assert all(t > 0 for ts in r["comm_ms"].values() for t in ts)
        else:
            assert set(r) == STEP_KEYS
        assert isinstance(r["found_inf"], bool)
        skipped += r["found_inf"]
        assert r["skipped_total"] == skipped
        assert isinstance(r["loss"], float) and math.isfinite(r["loss"]) and r["loss"] > 0
        if r["found_inf"]:
            assert r["grad_norm"] is None  # non-finite: null, JSON has no inf
        else:
            assert isinstance(r["grad_norm"], float) and r["grad_norm"] > 0
        assert r["loss_scale"] >= 1 and math.log2(r["loss_scale"]).is_integer()  # dynamic: powers of 2
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["opt_state_bytes"] == summary["opt_state_bytes_per_rank"]
        if r["step"] % 10 == 0:
            assert isinstance(r["val_loss"], float) and math.isfinite(r["val_loss"])
        else:
            assert r["val_loss"] is None
    # The loss falls from ~ln(97) = 4.57.
    first, last = mean([r["loss"] for r in records[:5]]), mean([r["loss"] for r in records[-5:]])
    assert first > 4.0 and last < first - 0.8, (first, last)
    assert records[-1]["val_loss"] < records[9]["val_loss"]
    # Summary: 2 ranks, ZeRO-1 state of about 13 bytes per param / 2 (FP32 master and moments, and
    # the weight-decay mask as a bool shard), identical params everywhere.
    assert summary["world_size"] == 2 and summary["steps"] == steps
    assert summary["skipped_steps"] == skipped
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["best_val_loss"] == min(r["val_loss"] for r in records if r["val_loss"] is not None)
    p = summary["param_count"]
    assert 13 * p / 2 <= summary["opt_state_bytes_per_rank"] <= 13 * (p / 2 + 64) + 64
    digests = summary["params_sha256"]
    assert len(digests) == 2 and len(set(digests)) == 1 and len(digests[0]) == 64
    assert summary["params_identical_across_ranks"] is True
    assert "identical on every rank" in proc.stdout
    # The model file: every param, by leaf path, in FP16 (rank 0 wrote it).
    weights = load_file(summary["weights"])
    assert summary["weights"] == str(tmp_path / "run" / "model.safetensors")
    assert sum(x.numel() for x in weights.values()) == p and {x.dtype for x in weights.values()} == {torch.float16}
    assert "still referenced" not in proc.stderr  # the compiled step let go of the process group
    # The learning rate each step applied: warmup from 0 towards --lr 3e-3 over 30 updates (skipped
    # steps do not count), then cosine down towards 3e-4 at step 40.
    lrs = [r["lr"] for r in records]
    assert lrs[0] == 0.0 and lrs[:10] == sorted(lrs[:10]) and 2.5e-3 < max(lrs) <= 3e-3 and 3e-4 <= lrs[-1] < max(lrs)
    # The log starts with the run's settings.
    config = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["config"]
    assert config["args"]["steps"] == steps and config["args"]["bucket_mb"] == 0.1 and config["world_size"] == 2
    assert config["torch"] == torch.__version__ and config["fzero"] and config["device"] == "cpu"
    assert config["param_count"] == p and config["opt_state_bytes_per_rank"] == summary["opt_state_bytes_per_rank"]
    # stderr is a pipe here: no bar, one plain line per log step (every 10 steps) on stdout
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in progress] == [f"step {s}/{steps}" for s in (1, 10, 20, 30, 40)]
    assert all(" | lr " in line and " | scale " in line and " | val " in line for line in progress)


@pytest.mark.e2e
def test_progress_on_a_terminal_without_a_size_is_plain_lines(tmp_path):
    """A pseudo-terminal with no size (what `script -c`, CI and `docker exec` give): the bar
    would not draw, so the job prints plain lines instead."""
    leader, follower = pty.openpty()  # a new pty reports 0 rows x 0 columns
    cmd = [sys.executable, str(TRAIN), "--device", "cpu", "--no-compile", "--model", "mlp", "--steps", "20",
           "--log-every", "5", "--out", str(tmp_path / "run")]
    proc = run_script(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, cwd=tmp_path,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(follower)
    assert proc.returncode == 0
    err = b""
    while select.select([leader], [], [], 0)[0]:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(leader)
    assert b"\r" not in err.replace(b"\r\n", b"\n")  # no bar redraws
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == [f"step {s}/20" for s in (5, 10, 15, 20)]


@pytest.mark.e2e
@pytest.mark.slow
def test_fp16_and_bf16_track_fp32(tmp_path):
    """Same seed, same batches, 100 steps: the final loss of FP16 (dynamic loss scaling) and
    BF16 is within 3% of FP32's (the mean train loss of the last 20 steps, and the val loss)."""
    common = [*SMALL_GPT, "--steps", "100", "--lr", "3e-3", "--eval-every", "0", "--eval-batches", "8"]
    result = {}
    for dtype in ("fp32", "fp16", "bf16"):
        records, summary, _ = train(tmp_path / dtype, *common, "--dtype", dtype)
        assert summary["first_loss"] > 4.0
        result[dtype] = (mean([r["loss"] for r in records[-20:]]), summary["final_val_loss"])
    ref_train, ref_val = result["fp32"]
    assert ref_train < 3.0  # it learned something for the comparison to mean anything
    for dtype in ("fp16", "bf16"):
        train_loss, val_loss = result[dtype]
        assert abs(train_loss - ref_train) <= 0.03 * ref_train, (dtype, result)
        assert abs(val_loss - ref_val) <= 0.03 * ref_val, (dtype, result)


# An FP32 run of 25 steps, and the same on 2 ranks saving a checkpoint every 8 steps (saving
# syncs the host, it changes no number): two tests hold the 2-rank run, each to its own claim.
FP32_RUN = [*SMALL_GPT, "--dtype", "fp32", "--steps", "25", "--eval-every", "0"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, list[dict], dict, str]:
    """``(run directory, step records, summary, stdout)`` of FP32_RUN on 2 ranks with
    ``--save-every 8``, run once per test session (``helpers.made_once``)."""
    def make(path):
        _, _, proc = train(path / "run", *FP32_RUN, "--save-every", "8", nproc=2)
        (path / "stdout.txt").write_text(proc.stdout)

    path = made_once(tmp_path_factory, "two_rank_run", make)
    return (path / "run", *read_log(path / "run"), (path / "stdout.txt").read_text())


@pytest.mark.e2e
def test_two_ranks_match_one_rank_on_the_same_global_batch(two_rank_run, tmp_path):
    """Each rank takes half the rows of the same global batch: the 2-rank loss curve (mean over
    ranks) is the 1-process curve, and so is the final val loss."""
    one, one_summary, _ = train(tmp_path / "one", *FP32_RUN)
    _, two, two_summary, _ = two_rank_run
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
    assert len(diffs) == 25 and max(diffs) < 1e-2, diffs
    assert abs(one_summary["final_val_loss"] - two_summary["final_val_loss"]) < 1e-2
    assert one[-1]["loss"] < one[0]["loss"] - 0.5  # it trained, so the curves say something
    # Same number of params; each of 2 ranks holds about half the optimizer state of 1.
    assert one_summary["param_count"] == two_summary["param_count"]
    assert two_summary["opt_state_bytes_per_rank"] < 0.55 * one_summary["opt_state_bytes_per_rank"]


@pytest.mark.e2e
def test_mesh_of_two_replicas_by_two_shards_follows_four_flat_ranks(tmp_path):
    """``--mesh 2,2`` on 4 ranks (2 "nodes" x 2): the same loss curve as ZeRO-1 over all 4, with
    twice the optimizer state per rank (sharded over 2, not 4)."""
    common = [*SMALL_GPT, "--dtype", "fp32", "--steps", "10", "--eval-every", "0", "--comm-every", "5"]
    flat, flat_summary, _ = train(tmp_path / "flat", *common, nproc=4)
    hybrid, hybrid_summary, proc = train(tmp_path / "hybrid", *common, "--mesh", "2,2", nproc=4)
    assert "1/2 each: 2 replicas x 2 shards" in proc.stdout
    for a, b in zip(flat, hybrid, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
    assert abs(flat_summary["final_val_loss"] - hybrid_summary["final_val_loss"]) < 1e-5
    ratio = hybrid_summary["opt_state_bytes_per_rank"] / flat_summary["opt_state_bytes_per_rank"]
    assert 1.9 < ratio < 2.1


@pytest.mark.e2e
def test_master_remainder_trains_the_main_job_bit_for_bit(tmp_path):
    """--keep-master remainder (BF16 params + int16 remainders) against the FP32 master: the same
    losses and bitwise the same params after 20 steps on 2 ranks, 2 bytes less state per
    element. Eager: the compiled main job's train step is held to the same, bit for bit over 100
    steps with skips and clipping, in tests/test_remainder.py."""
    common = [*SMALL_GPT, "--dtype", "bf16", "--steps", "20", "--eval-every", "10"]
    fp32, fp32_summary, _ = train(tmp_path / "fp32", *common, nproc=2)
    rem, rem_summary, proc = train(tmp_path / "rem", *common, "--keep-master", "remainder", nproc=2)
    assert "int16 master remainder" in proc.stdout
    assert [r["loss"] for r in fp32] == [r["loss"] for r in rem]
    assert fp32_summary["final_val_loss"] == rem_summary["final_val_loss"]
    assert fp32_summary["params_sha256"] == rem_summary["params_sha256"]
    S = (fp32_summary["opt_state_bytes_per_rank"] - rem_summary["opt_state_bytes_per_rank"]) / 2
    assert S >= fp32_summary["param_count"] / 2  # 2 bytes per element of the shard


BAD_FLAGS = [  # (flags, ranks, what the one line must say)
    (["--data", "/nonexistent"], 1, "--data /nonexistent: no such file"),
    (["--data", "{empty}"], 1, "empty.txt: the file is empty"),
    (["--data", "/dev/zero"], 1, "--data /dev/zero: not a regular file but a character device; give a text file"),
    (["--data", "{fifo}"], 1, "fifo: not a regular file but a FIFO (named pipe); give a text file"),
    (["--data", "{tmp}"], 1, "--data {tmp}: is a directory"),
    (["--data", "{short}", "--block-size", "32"], 1, "--block-size 32 needs more"),
    (["--resume", "/nonexistent"], 1, "--resume /nonexistent: not a checkpoint"),
    (["--model", "mlp", "--mlp-dims", "64,abc"], 1, "--mlp-dims '64,abc' must be two or more positive integers, e.g. --mlp-dims 64,256,256,64"),
    (["--model", "mlp", "--mlp-dims", "64"], 1, "--mlp-dims '64' must be two or more positive integers"),
    (["--mlp-dims", "64,64"], 1, "--mlp-dims applies to --model mlp only"),
    (["--model", "mlp", "--block-size", "8"], 1, "--block-size applies to --model gpt only"),
    (["--lr", "-1"], 1, "--lr must be a positive number, got -1 (e.g. --lr 3e-3)"),
    (["--lr", "nan"], 1, "--lr must be a positive number, got nan"),
    (["--grad-clip", "0"], 1, "--grad-clip must be a positive number, got 0"),
    (["--block-size", "100000"], 1, "--block-size 100000 is outside 1..64, the context the nano config is built for"),
    (["--steps", "0"], 1, "--steps must be >= 1, got 0"),
    (["--batch-size", "0"], 1, "--batch-size must be >= 1, got 0"),
    (["--warmup", "-5"], 1, "--warmup must be >= 0, got -5"),
    (["--eval-every", "-1"], 1, "--eval-every must be >= 0, got -1"),
    (["--weight-decay", "-0.1"], 1, "--weight-decay must be >= 0, got -0.1"),
    ([], 3, "--batch-size 16 must be divisible by the number of ranks (3): --batch-size 15 or 18"),
    (["--mesh", "3,2"], 4, "--mesh 3,2 needs 6 ranks, this run has 4"),
    (["--mesh", "2"], 2, "--mesh 2 must be two positive integers R,S"),
    (["--keep-master", "remainder"], 1, "--keep-master remainder keeps the master below BF16 params: it needs --dtype bf16, got --dtype fp16"),
    (["--optimizer", "muon", "--model", "mlp"], 1, "--optimizer muon trains the GPT's blocks' matrices with Muon: it needs --model gpt"),
    (["--optimizer", "muon", "--moments", "int8"], 1, "--moments int8 keeps AdamW's moments in blocks of 256 elements"),
    (["--optimizer", "lion", "--moments", "int8"], 1, "--optimizer lion keeps one momentum in fp32 or bf16"),
    (["--optimizer", "ademamix", "--moments", "bf16"], 1, "--optimizer ademamix keeps its moments in fp32"),
    (["--optimizer", "lamb", "--moments", "int8"], 1, "--optimizer lamb keeps its moments in fp32"),
    (["--optimizer", "schedule_free", "--moments", "bf16"], 1, "--optimizer schedule_free keeps its moments in fp32"),
    (["--optimizer", "adafactor", "--moments", "int8"], 1, "--optimizer adafactor keeps its moments in fp32"),
    # flags that fix the model and its optimizer state, against the checkpoint's (RESUMABLE)
    (["--resume", "{ckpt}", "--dtype", "fp16"], 1,
     "--resume {ckpt}: --dtype fp16 (checkpoint: bf16): these flags fix the model and its optimizer state; "
     "drop them to continue with the checkpoint's"),
    (["--resume", "{ckpt}", "--model", "gpt"], 1, "--resume {ckpt}: --model gpt (checkpoint: mlp): these flags"),
    (["--resume", "{ckpt}", "--mlp-dims", "8,16,4", "--dtype", "fp32"], 1,
     "--resume {ckpt}: --mlp-dims 8,16,4 (checkpoint: 8,32,4), --dtype fp32 (checkpoint: bf16): these flags"),
    (["--resume", "{ckpt}", "--grad-clip", "inf"], 1,
     "--resume {ckpt}: --grad-clip inf (checkpoint: 0.5) turns clipping off, which changes the optimizer state; "
     "drop it to keep 0.5 (a large --grad-clip such as 1e9 clips nothing)"),
    (["--resume", "{ckpt}", "--steps", "6"], 1, "--resume {ckpt} is at step 6; --steps must be more than that"),
    (["--resume", "{legacy}", "--dtype", "fp16"], 1, "--resume {legacy}: --dtype fp16 (checkpoint: bf16): these flags"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--device", "cuda"], 1, "--device cuda: this torch"))


@pytest.mark.parametrize("flags,ranks,message", [
    # a flag checked against a saved run needs one, which the main job writes: the e2e tier
    pytest.param(f, r, m, id=" ".join(f) or f"{r} ranks", marks=[pytest.mark.e2e] if "{ckpt}" in f else [])
    for f, r, m in BAD_FLAGS])
def test_a_bad_flag_stops_the_run_before_any_work_with_one_line(flags, ranks, message, tmp_path, monkeypatch, capsys,
                                                              request):
    """Checked before any rank joins a group, builds a model or reads the corpus: exit code 2
    and one line on stderr naming the flag (and a valid value where there is one), from rank 0
    only; the other ranks say nothing."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("def f(x):\n    return x\n" * 3)
    os.mkfifo(tmp_path / "fifo")
    paths = {"empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt", "fifo": tmp_path / "fifo", "tmp": tmp_path}
    if "{ckpt}" in flags:
        paths["ckpt"] = request.getfixturevalue("saved_run") / "ckpt" / "step-6"
    if "{legacy}" in flags:
        paths["legacy"] = request.getfixturevalue("legacy_checkpoint")
    flags, message = [f.format(**paths) for f in flags], message.format(**paths)
    train_py = load_train_module()
    monkeypatch.setattr(train_py, "init_distributed", lambda *a: pytest.fail("joined a group before checking"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # not a torchrun worker
    for rank in range(min(ranks, 2)):
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as exit:
            train_py.main(["--device", "cpu", "--out", str(tmp_path / "run"), *flags])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        if rank == 0:
            assert err.count("\n") == 1 and err.startswith("train.py: error: ") and message in err, err
        else:
            assert err == ""
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_rank_that_rank_0_did_not_stop_reports_the_bad_flag_itself(tmp_path, monkeypatch, capsys):
    """Under torchrun a rank other than 0 leaves the report to rank 0 and waits to be stopped;
    still running after the wait (rank 0 was given other flags and did not fail), it reports
    the error itself, naming its rank."""
    train_py = load_train_module()
    waits = []
    monkeypatch.setattr(train_py.time, "sleep", waits.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit:
        train_py.main(["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "7"])
    assert exit.value.code == 2 and waits == [RANK_0_REPORT_WAIT_S]
    assert capsys.readouterr().err == (
        "train.py: error (rank 1): --batch-size 7 must be divisible by the number of ranks (2): --batch-size 6 or 8\n")


def train_after(script: Path, prelude: str) -> Path:
    """Write ``script``: ``prelude``, then train.py as ``python train.py`` runs it (to pass to ``train``)."""
    script.write_text(f"{prelude}\nimport runpy, sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nsys.argv[0] = {str(TRAIN)!r}\n"
                      f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n")
    return script


# train.py with rank 0 held back, so that rank 1 finds the bad flag first.
LAGGING_RANK_0 = """
import os, time
if os.environ["RANK"] == "0":
    time.sleep({lag})
"""


@pytest.mark.e2e
@pytest.mark.parametrize("rank_0_lag_s", [0.0, 3.0])
def test_a_bad_flag_under_torchrun_is_one_line_from_rank_0(rank_0_lag_s, tmp_path):
    """Under torchrun the one line comes from rank 0, also when another rank finds the bad flag
    first (torchrun stops every worker once one has failed, so that rank waits to be stopped).
    ``make train`` checks the flags with ``--check-args`` before it starts torchrun."""
    script = train_after(tmp_path / "lagging_rank_0.py", LAGGING_RANK_0.format(lag=rank_0_lag_s))
    t0 = time.perf_counter()
    _, _, proc = train(tmp_path / "bad", *SMALL_GPT, "--batch-size", "7", "--steps", "1", nproc=2, check=False,
                       script=script)
    assert proc.returncode != 0
    # Rank 1 was stopped by torchrun, not by its own fallback after RANK_0_REPORT_WAIT_S.
    assert time.perf_counter() - t0 < 45, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "train.py: error:" in line]
    assert lines == ["train.py: error: --batch-size 7 must be divisible by the number of ranks (2): --batch-size 6 or 8"]
    assert "File \"" + str(TRAIN) not in proc.stderr  # no traceback from train.py itself


@pytest.mark.e2e
def test_check_args_exits_0_for_good_flags_and_2_for_bad_ones(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "3"}
    for flags, code in (([], 2), (["--batch-size", "15"], 0)):
        proc = run_script([sys.executable, str(TRAIN), "--check-args", "--device", "cpu", *flags], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "" and (proc.stderr == "") == (code == 0), proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory


@pytest.mark.e2e
def test_mlp_bf16_trains_with_8_bit_moments(tmp_path):
    """(BF16 with FP32 moments trains in test_fp16_and_bf16_track_fp32.)"""
    records, summary, proc = train(
        tmp_path / "mlp", "--model", "mlp", "--mlp-dims", "32,128,32", "--dtype", "bf16", "--steps", "60",
        "--batch-size", "32", "--eval-every", "30", "--moments", "int8",
    )
    config = json.loads((tmp_path / "mlp" / "metrics.jsonl").read_text().splitlines()[0])["config"]
    assert config["args"]["moments"] == summary["moments"] == "int8" and "2 int8 moments" in proc.stdout
    assert all(r["loss_scale"] == 1.0 for r in records)  # no loss scaling for BF16
    assert mean([r["loss"] for r in records[-5:]]) < 0.6 * mean([r["loss"] for r in records[:5]])
    assert summary["final_val_loss"] < 0.6 * records[0]["loss"]


@pytest.mark.e2e
def test_profile_trace_and_plot(tmp_path):
    trace_dir = tmp_path / "trace"
    out = tmp_path / "run"
    _, summary, proc = train(out, *SMALL_GPT, "--dtype", "fp32", "--steps", "6", "--profile", str(trace_dir))
    assert summary["steps"] == 6
    trace = json.loads((trace_dir / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    profiled = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert profiled == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"], profiled  # wait 1, warm up 1, record 3
    assert "aten::mm" in names
    assert str(trace_dir) in proc.stdout
    plot = out / "loss.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert not plot.exists() and "matplotlib is not installed" in proc.stdout
    else:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
        assert str(plot) in proc.stdout


def test_data_vocab_encoding_and_deterministic_batches():
    assert len(data.VOCAB) == data.CharCorpus.vocab_size == 97
    text = "def f(x):\n    return x ~ 1\n"
    assert data.decode(data.encode(text).tolist()) == text
    unk = data.VOCAB.index(data.UNK)
    assert data.encode("a\tb\u00e9\u20ac").tolist() == [data.VOCAB.index("a"), unk, data.VOCAB.index("b"), unk, unk]

    corpus = data.CharCorpus(data.stdlib_text(max_bytes=200_000), block_size=16)
    n_train, n_val = len(corpus.splits["train"]), len(corpus.splits["val"])
    assert n_train + n_val == 200_000 and n_val == 20_000
    x, y = corpus.get_batch("train", 5, 8, 0)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    again, _ = corpus.get_batch("train", 5, 8, 0)
    assert torch.equal(x, again)  # a function of (split, step, batch_size, seed) only
    assert not torch.equal(x, corpus.get_batch("train", 6, 8, 0)[0])
    assert not torch.equal(x, corpus.get_batch("train", 5, 8, 1)[0])
    assert not torch.equal(x, corpus.get_batch("val", 5, 8, 0)[0])

    teacher = data.TeacherRegression((8, 16, 4))
    x, y = teacher.get_batch("train", 0, 2048, 0)
    assert x.shape == (2048, 8) and y.shape == (2048, 4)
    assert 0.8 < y.std().item() < 1.2
    assert torch.equal(y, teacher.get_batch("train", 0, 2048, 0)[1])


@pytest.mark.e2e
def test_trains_on_a_user_text_file(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)  # 9,000 characters
    records, summary, proc = train(
        tmp_path / "run", *SMALL_GPT, "--data", str(text), "--dtype", "fp32", "--steps", "20", "--lr", "1e-2",
    )
    assert "train=8,100 chars, val=900 chars" in proc.stdout
    assert summary["final_val_loss"] < 2.0  # a repeated sentence is easy to predict


@pytest.mark.e2e
def test_save_every_and_resume_at_another_world_size_continue_exactly(two_rank_run, tmp_path):
    """Train 25 steps on 2 ranks saving every 8 (and at the last step); resume step 8's
    checkpoint on 1 rank: the remaining 17 steps give the same loss curve as the straight run
    (within FP32 rounding). Resumed with other --weight-decay/--grad-clip, the run uses those
    and says so."""
    args = FP32_RUN
    run, straight, summary, stdout = two_rank_run
    ckpt = run / "ckpt" / "step-8"
    saved = [line for line in stdout.splitlines() if line.startswith("saved checkpoint")]
    assert len(saved) == 4 and saved[0].startswith(f"saved checkpoint {ckpt} (") and " MiB, " in saved[0]
    assert summary["checkpoints"] == [str(run / "ckpt" / f"step-{s}") for s in (8, 16, 24, 25)]
    assert read_manifest(ckpt)["extra"]["step"] == 8 and read_manifest(run / "ckpt" / "step-16")["extra"]["step"] == 16
    assert read_manifest(run / "ckpt" / "step-25")["extra"]["step"] == 25
    resumed, summary, proc = train(tmp_path / "b", *args, "--resume", str(ckpt))
    hyperparams = {"max_norm": 1.0, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0.01}  # train.py's defaults
    assert summary["resumed"] == {"from": str(ckpt), "step": 8, "hyperparams": hyperparams}
    assert f"resumed from {ckpt} at step 8 with hyperparameters {json.dumps(hyperparams)}" in proc.stdout
    assert "hyperparameters differ" not in proc.stderr
    # hyperparameters given on resume take effect; load warns about each one that differs
    changed, summary, proc = train(tmp_path / "c", *args, "--resume", str(ckpt), "--weight-decay", "0.5", "--grad-clip", "0.01")
    assert summary["resumed"]["hyperparams"] == {**hyperparams, "weight_decay": 0.5, "max_norm": 0.01}
    assert "weight_decay: checkpoint 0.01, engine 0.5" in proc.stderr and "max_norm: checkpoint 1.0, engine 0.01" in proc.stderr
    assert changed[0]["loss"] == resumed[0]["loss"] and changed[-1]["loss"] != resumed[-1]["loss"]
    assert [r["step"] for r in resumed] == list(range(9, 26))
    for a, b in zip(straight[8:], resumed):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * a["loss"], (a, b)


# A run whose every training flag differs from train.py's default: BF16 params over the int16
# remainder master, another seed, batch, length, schedule, decay and clipping.
RESUMABLE = ["--model", "mlp", "--mlp-dims", "8,32,4", "--dtype", "bf16", "--keep-master", "remainder", "--seed", "3",
             "--batch-size", "8", "--steps", "12", "--lr", "0.01", "--warmup", "2", "--weight-decay", "0.05",
             "--grad-clip", "0.5"]
LOGGING = ["--eval-every", "6", "--log-every", "3"]  # not training flags: a resume gives them again


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """The run directory of RESUMABLE, 12 steps with checkpoints at steps 6 and 12, run once
    per test session (``helpers.made_once``)."""
    return made_once(tmp_path_factory, "saved_run", lambda path: train(path / "run", *RESUMABLE, *LOGGING,
                                                                        "--save-every", "6")) / "run"


@pytest.fixture(scope="module")
def legacy_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of RESUMABLE's model and optimizer as train.py saved them before checkpoints
    recorded the training flags: ``extra`` holds the step and the seed only."""
    path = tmp_path_factory.mktemp("legacy") / "ckpt"
    train_py = load_train_module()
    args = train_py.parse_args(RESUMABLE)
    train_py.check_args(args, 1)
    params, *_ = train_py.build(args, train_py.load_data(args), torch.device("cpu"))
    engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.bfloat16, master="remainder")
    fzero.checkpoint.save(path, *engine.init(params), engine, extra={"step": 6, "seed": 3})
    return path


@pytest.mark.e2e
def test_resume_into_its_own_run_directory_continues_its_metrics_and_plot(saved_run, tmp_path):
    """Resumed from step 6 into the run's own directory: metrics.jsonl keeps the records up to
    step 6 as they were, drops the later ones (the steps being replaced), and goes on after a
    config record that says so; loss.png plots the whole run, the same picture as the straight run."""
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    ckpt = out / "ckpt" / "step-6"
    before = (out / "metrics.jsonl").read_text().splitlines()
    straight_png = (out / "loss.png").read_bytes() if importlib.util.find_spec("matplotlib") else None
    train(out, *RESUMABLE, *LOGGING, "--resume", str(ckpt))
    after = (out / "metrics.jsonl").read_text().splitlines()
    assert after[:7] == before[:7]  # the config record and steps 1-6, byte for byte
    lines = [json.loads(line) for line in after]
    assert [line.get("step") for line in lines] == [None, *range(1, 7), None, *range(7, 13), None]
    assert lines[7]["config"]["resumed"] == {"from": str(ckpt), "step": 6, "from_checkpoint": {}, "changed": {}}
    assert "summary" in lines[-1] and lines[-1]["summary"]["resumed"]["step"] == 6
    straight = [json.loads(line) for line in before[7:13]]
    assert [r["loss"] for r in lines[8:14]] == [r["loss"] for r in straight]  # the same run, continued exactly
    if straight_png is not None:
        assert (out / "loss.png").read_bytes() == straight_png


# FP16 with a loss scale that starts at its maximum and grows after every clean step: overflow
# skips at the start and every other step after.
OVERFLOWING = """
import functools
import fzero
fzero.DynamicLossScale = functools.partial(fzero.DynamicLossScale, init_scale=2.0**24, growth_interval=1)
"""


@pytest.mark.e2e
def test_a_resumed_run_counts_skipped_steps_over_the_whole_run(tmp_path):
    """The checkpoint keeps the count of skipped steps, so each record's skipped_total goes on
    from it after a resume as in the straight run; the summary counts the steps of its process."""
    script = train_after(tmp_path / "overflowing.py", OVERFLOWING)
    args = ["--model", "mlp", "--mlp-dims", "8,32,4", "--dtype", "fp16", "--steps", "12", "--log-every", "3"]
    straight, _, _ = train(tmp_path / "run", *args, "--save-every", "6", script=script)
    resumed, summary, _ = train(tmp_path / "b", *args, "--resume", str(tmp_path / "run" / "ckpt" / "step-6"), script=script)
    assert any(r["found_inf"] for r in straight[:6]) and any(r["found_inf"] for r in straight[6:])
    assert [r["skipped_total"] for r in resumed] == [r["skipped_total"] for r in straight[6:]]
    assert summary["skipped_steps"] == sum(r["found_inf"] for r in resumed)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_long_compiled_run_with_skips_and_a_resume_compiles_each_graph_once_per_process(tmp_path):
    """2,000 compiled steps of the main job -- warmup then cosine, a loss scale that overflows and
    backs off again and again, a checkpoint at step 1,000 and a resume from it in a new process
    -- and each process compiled two graphs, the loss and the step: nothing recompiled as the
    learning rate, the loss scale, the step count or the loaded state changed (dynamo's count)."""
    script = train_after(tmp_path / "overflowing.py", OVERFLOWING.replace("growth_interval=1", "growth_interval=20"))
    args = ["--model", "mlp", "--mlp-dims", "8,32,4", "--dtype", "fp16", "--log-every", "100", "--eval-every", "500"]
    first, s1, _ = train(tmp_path / "run", *args, "--steps", "1000", "--save-every", "1000", compile=True, script=script)
    second, s2, _ = train(tmp_path / "b", *args, "--steps", "2000", "--resume", str(tmp_path / "run" / "ckpt" / "step-1000"),
                          compile=True, script=script)
    records = first + second
    assert [r["step"] for r in records] == list(range(1, 2001))
    assert records[-1]["skipped_total"] > 2 * 20 and s2["skipped_steps"] > 10  # skips all along, after the resume too
    lrs = [r["lr"] for r in records]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs) / 5  # warmup, then the cosine's decay
    assert s1["compiled_graphs"] == s2["compiled_graphs"] == 2


@pytest.mark.e2e
def test_resume_takes_the_training_flags_it_is_not_given_from_the_checkpoint(saved_run, tmp_path):
    """``--resume`` alone continues the saved run exactly -- model, BF16 over the remainder master,
    seed, batch, schedule, clipping -- and says on one line which flags it took from the
    checkpoint; into another directory, metrics.jsonl starts afresh with a config record that
    says it resumed. Flags given with other values than the checkpoint's (but not ones that
    fix the model) take effect and are named on one line."""
    ckpt = saved_run / "ckpt" / "step-6"
    straight = [r for r in metrics(saved_run) if "step" in r]
    records, summary, proc = train(tmp_path / "b", *LOGGING, "--resume", str(ckpt))
    taken = ("--model mlp --mlp-dims 8,32,4 --dtype bf16 --keep-master remainder --seed 3 --batch-size 8 --steps 12 "
             "--lr 0.01 --warmup 2 --weight-decay 0.05 --grad-clip 0.5")
    assert proc.stdout.splitlines()[0] == f"resuming {ckpt} at step 6 with the checkpoint's {taken}"
    assert "int16 master remainder" in proc.stdout
    assert [r["step"] for r in records] == list(range(7, 13))
    assert [r["loss"] for r in records] == [r["loss"] for r in straight[6:]]
    config = metrics(tmp_path / "b")[0]["config"]
    assert config["args"]["dtype"] == "bf16" and config["args"]["seed"] == 3
    assert config["resumed"]["from"] == str(ckpt) and config["resumed"]["step"] == 6 and config["resumed"]["changed"] == {}
    assert config["resumed"]["from_checkpoint"]["keep_master"] == "remainder"

    records, summary, proc = train(tmp_path / "c", *LOGGING, "--resume", str(ckpt), "--seed", "4", "--steps", "14",
                                   "--lr", "0.02", "--keep-master", "fp32")
    assert proc.stdout.splitlines()[0] == (
        f"resuming {ckpt} at step 6 with the checkpoint's --model mlp --mlp-dims 8,32,4 --dtype bf16 --batch-size 8 "
        "--warmup 2 --weight-decay 0.05 --grad-clip 0.5, and with flags that differ from it: --keep-master fp32 "
        "(checkpoint: remainder), --seed 4 (checkpoint: 3), --steps 14 (checkpoint: 12), --lr 0.02 (checkpoint: 0.01)")
    assert [r["step"] for r in records] == list(range(7, 15)) and records[0]["loss"] != straight[6]["loss"]
    changed = metrics(tmp_path / "c")[0]["config"]["resumed"]["changed"]
    assert changed == {"keep_master": ["remainder", "fp32"], "seed": [3, 4], "steps": [12, 14], "lr": [0.01, 0.02]}


@pytest.mark.e2e
def test_a_checkpoint_without_training_flags_resumes_with_its_dtype_and_seed(legacy_checkpoint, tmp_path):
    """A checkpoint whose ``extra`` has only the step and the seed: its param dtype (in every
    manifest) and its seed are taken as the flags not given."""
    records, _, proc = train(tmp_path / "run", *RESUMABLE[:4], "--keep-master", "remainder", "--batch-size", "8",
                             "--steps", "8", "--resume", str(legacy_checkpoint))
    assert proc.stdout.splitlines()[0] == f"resuming {legacy_checkpoint} at step 6 with the checkpoint's --dtype bf16 --seed 3"
    assert [r["step"] for r in records] == [7, 8] and all(r["loss_scale"] == 1.0 for r in records)  # BF16: no scaling



def test_a_checkpoint_linked_from_its_run_directory_continues_that_runs_metrics(tmp_path):
    """``<run>/ckpt/step-N`` (or ``<run>/ckpt``) a symlink to another volume is still the run's
    own checkpoint: the resume keeps the log's records up to step N (reporting.open_metrics)."""
    from reporting import in_run, open_metrics

    run, volume = tmp_path / "run", tmp_path / "volume"
    (volume / "ckpt" / "step-2").mkdir(parents=True)
    (run / "ckpt").mkdir(parents=True)
    os.symlink(volume / "ckpt" / "step-2", run / "ckpt" / "step-2")
    lines = [{"config": {}}, {"step": 1}, {"step": 2}, {"step": 3}, {"summary": {}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    log, earlier = open_metrics(str(run), str(run / "ckpt" / "step-2"), 2)
    log.close()
    assert earlier == lines[1:3] and metrics(run) == lines[:3]
    shutil.rmtree(run / "ckpt")
    os.symlink(volume / "ckpt", run / "ckpt")  # the whole ckpt directory elsewhere
    assert in_run(str(run / "ckpt" / "step-2"), str(run))
    assert not in_run(str(volume / "ckpt" / "step-2"), str(run))  # another run's checkpoint, given by its real path
    assert not in_run(str(run / "ckpt" / "step-2"), str(tmp_path / "other"))


def with_extra(extra: str):
    """An ``edit_manifest`` edit: the manifest's text with the JSON text ``extra`` as its extra
    (and a null step if it has none, as a save writes it)."""
    def change(text):
        start, end = text.index('"extra": ') + len('"extra": '), text.index('\n "files": ')
        text = text[:start] + extra + "," + text[end:]
        return text if '"step"' in extra else text.replace('"step": 6,', '"step": null,', 1)

    return change


@pytest.mark.parametrize("extra,message", [
    ('{"seed": 3}', 'its manifest.json has no extra["step"]'),
    ('{"step": "6", "seed": 3}', "manifest field extra.step = '6': must be an integer"),
    ('{"step": 6, "deep": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested more than 100 deep"),
], ids=["no step", "step not a number", "nested 200,000 deep"])
def test_resume_from_a_checkpoint_without_a_valid_step_is_one_flag_error(legacy_checkpoint, tmp_path, monkeypatch,
                                                                         capsys, extra, message):
    """A tampered ``extra``: one line naming the checkpoint's file and the key, before any work."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(legacy_checkpoint, ckpt)
    edit_manifest(str(ckpt), with_extra(extra))
    train_py = load_train_module()
    monkeypatch.setattr(train_py, "init_distributed", lambda *a: pytest.fail("joined a group before checking"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit:
        train_py.main(["--device", "cpu", "--out", str(tmp_path / "run"), "--resume", str(ckpt)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"train.py: error: --resume {ckpt}: ") and message in err and "manifest.json" in err, err


# ---------------------------------------------------------------- the optimizer train.py builds
def nano_gpt_params():
    config = gpt.GPTConfig(97, block_size=16, n_layer=1, n_head=2, n_embd=16)
    return gpt.init(torch.Generator().manual_seed(0), config)


def decayed_args(train_py, *more):
    # the peak lr from the first step (no warmup), so that one step shows the decay
    return train_py.parse_args(["--lr", "0.1", "--weight-decay", "0.5", "--warmup", "0", "--steps", "10", *more])


def assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, *, lr, weight_decay):
    """One step with zero grads: an optimizer whose update of zero grads from a zero state is
    zero moves the decayed matrices (every one here) by the decay alone, the 1-D params not at all."""
    new, *_ = engine.step(p, optree.tree_map(torch.zeros_like, p), state, scaler_state)
    for old, x in zip(optree.tree_leaves(p), optree.tree_leaves(new)):
        if old.ndim >= 2:
            torch.testing.assert_close(x, old * (1 - lr * weight_decay), rtol=1e-6, atol=0)
        else:
            assert torch.equal(x, old)


def test_weight_decay_mask_is_the_ndim_rule():
    """train.py decays matrices (weights, embeddings), not biases or norm gains (nanoGPT's
    ndim >= 2 rule): the mask adamw keeps, on the params pytree."""
    train_py = load_train_module()
    tx = train_py.make_optimizer(decayed_args(train_py))
    params = nano_gpt_params()
    assert {x.ndim for x in optree.tree_leaves(params)} == {1, 2}
    state = tx.init(params)
    is_masked = lambda x: isinstance(x, transforms.MaskedState)  # noqa: E731
    (masked,) = [s for s in optree.tree_leaves(state, is_leaf=is_masked) if is_masked(s)]
    assert masked.mask == optree.tree_map(lambda x: x.ndim >= 2, params)
    assert transforms.get_hyperparams(state)["weight_decay"].item() == 0.5


def test_engine_step_decays_matrices_only():
    """One engine step of train.py's optimizer with zero grads at lr 0.1, weight decay 0.5: every
    matrix moves by exactly -lr * wd * p, every 1-D param (bias, norm gain) stays as it was."""
    train_py = load_train_module()
    engine = fzero.zero1(train_py.make_optimizer(decayed_args(train_py)), param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, lr=0.1, weight_decay=0.5)


def test_muon_optimizer_trains_the_blocks_matrices_with_muon_and_the_rest_with_adamw():
    """--optimizer muon: one engine step with zero grads at lr 0.1, weight decay 0.5. Muon's
    update of a zero momentum is zero, so its matrices move by the decay alone, as AdamW's
    decayed matrices (the embeddings) do; 1-D params stay. Muon's state holds the blocks'
    matrices only, AdamW's the rest."""
    train_py = load_train_module()
    engine = fzero.zero1(train_py.make_optimizer(decayed_args(train_py, "--optimizer", "muon")), param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    labels = optree.tree_leaves(gpt.muon_labels(p))
    assert labels.count("muon") == 4 and {x.ndim for x, l in zip(optree.tree_leaves(p), labels) if l == "muon"} == {2}
    inner = state.tx_state[1].inner_states  # chain(clip, partition)
    muon_numel = sum(x.numel() for x, l in zip(optree.tree_leaves(p), labels) if l == "muon")
    assert inner["muon"][0].momentum_buffer.numel() == muon_numel
    assert inner["adamw"][0].mu.numel() == engine.layout.numel - muon_numel
    assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, lr=0.1, weight_decay=0.5)


@pytest.mark.parametrize("moments, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_lion_optimizer_trains_every_param_with_lion_and_the_usual_decay_mask(moments, dtype):
    """--optimizer lion: one engine step with zero grads at lr 0.1, weight decay 0.5. Lion's sign
    of a zero interpolation is zero, so the matrices move by the decay alone and the 1-D params
    stay; its state is one momentum over every param, stored as --moments says."""
    train_py = load_train_module()
    args = decayed_args(train_py, "--optimizer", "lion", "--moments", moments)
    engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    lion_state = state.tx_state[1][0]  # chain(clip, lion = chain(scale_by_lion, decay, lr))
    assert isinstance(lion_state, transforms.ScaleByLionState)
    assert lion_state.mu.numel() == state.master.numel() and lion_state.mu.dtype == dtype
    assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, lr=0.1, weight_decay=0.5)


def test_ademamix_optimizer_trains_every_param_with_ademamix_and_the_usual_decay_mask():
    """--optimizer ademamix: one engine step with zero grads at lr 0.1, weight decay 0.5. Its
    direction from zero moments is zero, so the matrices move by the decay alone and the 1-D
    params stay; its state is three FP32 moments over every param, betas (0.9, 0.99, 0.999)."""
    train_py = load_train_module()
    engine = fzero.zero1(train_py.make_optimizer(decayed_args(train_py, "--optimizer", "ademamix")),
                         param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    ademamix_state = state.tx_state[1][0]  # chain(clip, ademamix = chain(scale_by_ademamix, decay, lr))
    assert isinstance(ademamix_state, transforms.ScaleByAdemamixState)
    moments = (ademamix_state.m1, ademamix_state.m2, ademamix_state.nu)
    assert all(m.numel() == state.master.numel() and m.dtype == torch.float32 for m in moments)
    hyper = transforms.get_hyperparams(state)
    assert (hyper["b1"], hyper["b2"], hyper["b3"], hyper["alpha"]) == (0.9, 0.99, 0.999, 5.0)
    assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, lr=0.1, weight_decay=0.5)


def test_lamb_optimizer_scales_each_matrix_step_to_lr_times_its_norm():
    """--optimizer lamb: one engine step with zero grads at lr 0.1, weight decay 0.5. The step of
    a decayed matrix is its decay, which the trust ratio rescales to lr times the matrix's norm:
    each matrix becomes (1 - lr) of itself, whatever the decay; the 1-D params stay."""
    train_py = load_train_module()
    engine = fzero.zero1(train_py.make_optimizer(decayed_args(train_py, "--optimizer", "lamb")), param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    new, *_ = engine.step(p, optree.tree_map(torch.zeros_like, p), state, scaler_state)
    for old, x in zip(optree.tree_leaves(p), optree.tree_leaves(new)):
        if old.ndim >= 2:
            torch.testing.assert_close(x, old * (1 - 0.1), rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(x, old)


def test_schedule_free_optimizer_warms_up_without_decay_and_is_evaluated_at_its_averaged_params():
    """--optimizer schedule_free: the learning rate warms up to --lr and stays there (no cosine);
    after a few steps the params evaluated are the averaged sequence x gathered from the state
    (``engine.params_from``), which differs from the params y the gradients are taken at."""
    train_py = load_train_module()
    args = train_py.parse_args(["--optimizer", "schedule_free", "--lr", "0.01", "--warmup", "2", "--steps", "10"])
    lr = train_py.lr_schedule(args)
    assert [round(float(lr(torch.tensor(c))), 6) for c in (0, 1, 2, 9)] == [0.0, 0.005, 0.01, 0.01]
    engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    for seed in range(3):
        p, state, scaler_state, _ = engine.step(p, grads_like(p, seed), state, scaler_state)
    x = train_py.eval_params(engine, args)(p, state)
    sf = state.tx_state[1]  # chain(clip, schedule_free_adamw)
    want = fzero.unflatten((state.master - 0.1 * sf.z) / 0.9, engine.layout)
    tree_assert_close(x, want, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(x), optree.tree_leaves(p)))


def test_adafactor_optimizer_factors_the_matrices_and_decays_them_only():
    """--optimizer adafactor: one engine step with zero grads at lr 0.1, weight decay 0.5. Its
    update of a zero grad is zero, so the matrices move by the decay alone and the 1-D params
    stay (torch's Adafactor has no mask: the decayed leaves are a group of their own). Every
    matrix keeps a row and a column statistic whole, the 1-D params a second moment of their
    elements."""
    train_py = load_train_module()
    engine = fzero.zero1(train_py.make_optimizer(decayed_args(train_py, "--optimizer", "adafactor")),
                         param_dtype=torch.float32)
    p, state, scaler_state = engine.init(nano_gpt_params())
    groups = state.tx_state[1].inner_states  # chain(clip, partition({"decay": adafactor, "rest": adafactor}))
    matrices = [x for x in optree.tree_leaves(p) if x.ndim >= 2]
    factored = groups["decay"].moments.inner_states["factored"]
    assert [(f.row.shape, f.col.shape) for f in factored] == [((*x.shape[:-1], 1), (1, x.shape[-1])) for x in matrices]
    assert set(groups["decay"].moments.inner_states) == {"factored"} and set(groups["rest"].moments.inner_states) == {"full"}
    assert groups["rest"].moments.inner_states["full"].numel() == sum(x.numel() for x in optree.tree_leaves(p) if x.ndim < 2)
    assert_zero_grads_move_the_matrices_by_the_decay_alone(engine, p, state, scaler_state, lr=0.1, weight_decay=0.5)


# ---------------------------------------------------------------- the compiled, sync-free main job
@pytest.mark.e2e
def test_compiled_main_job_follows_the_eager_loss_curve(tmp_path):
    """100 steps of the same run, --compile and --no-compile: the train loss agrees at every
    step within 1e-4 (measured: 1e-6 to 5e-6 over seeds 1-3), and so does the final val loss.

    In FP32: the compiled update (inductor's) and the eager one (torch's fused AdamW kernel)
    round differently in the last bit, and FP16/BF16 params amplify that chaotically -- a param
    that flips by one FP16 step, a loss-scale overflow one step earlier -- so two FP16 runs of
    100 steps differ by 5e-4 to 0.03 depending on the seed, as would any two implementations
    of the same update (docs/performance.md). The compiled FP16 main job on 2 ranks is the
    first test of this file."""
    common = [*SMALL_GPT, "--dtype", "fp32", "--steps", "100", "--eval-every", "0", "--log-every", "25"]
    eager, eager_summary, _ = train(tmp_path / "eager", *common)
    compiled, compiled_summary, _ = train(tmp_path / "compiled", *common, compile=True)
    assert [r["step"] for r in compiled] == [r["step"] for r in eager] == list(range(1, 101))
    # One host sync per 25 steps: the steps of a window share its mean step time.
    assert [len({r["step_time_s"] for r in compiled[i : i + 25]}) for i in range(0, 100, 25)] == [1] * 4
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(eager, compiled)]
    assert max(diffs) <= 1e-4, max(diffs)
    assert eager[-1]["loss"] < eager[0]["loss"] - 1.0  # it trained, so the curves say something
    assert abs(eager_summary["final_val_loss"] - compiled_summary["final_val_loss"]) <= 1e-4


@contextlib.contextmanager
def guards_may_read_scalars():
    """Inside ``forbid_host_syncs``: let dynamo's guards call ``Tensor.item``. Every call of a
    compiled function checks that its 0-d CPU float64 inputs (the hyperparameters) are not NaN,
    by reading them (torch 2.13 traces such inputs as symbolic floats): host memory, not a
    device sync, and on a GPU these tensors live on the device and get no such guard. The
    guard is generated code (function ``guard`` in file ``<string>``); every other caller still
    trips the trap."""
    trap = torch.Tensor.item

    def item(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        in_guard = (caller.co_filename, caller.co_name) == ("<string>", "guard")
        return (torch._C.TensorBase.item if in_guard else trap)(self, *args, **kwargs)

    torch.Tensor.item = item
    try:
        yield
    finally:
        torch.Tensor.item = trap


@pytest.mark.slow
def test_train_step_makes_no_host_sync_and_compiles_once():
    """What the loop runs between log steps -- the batch, the compiled train step, adding to the
    log window -- under a trap that makes every Tensor -> Python conversion raise and with
    recompiles as errors, while the lr warms up and the loss scale backs off and grows; the
    window then turns into the log records outside the trap."""
    train_py = load_train_module()
    args = train_py.parse_args([*SMALL_GPT, "--dtype", "fp16", "--steps", "100"])
    train_py.check_args(args, 1)
    data = train_py.load_data(args)
    params_fp32, loss_fn, seq_items = train_py.build(args, data, torch.device("cpu"))
    lr_fn = train_py.lr_schedule(args)
    # A scale that overflows at first and grows after every clean step: backoffs and growths.
    scaling = fzero.DynamicLossScale(init_scale=2.0**24, growth_interval=1)
    engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.float16, loss_scale=scaling)
    params, state, scaler_state = engine.init(params_fp32)
    train_step = train_py.make_train_step(engine, loss_fn, compile=True)
    window = train_py.LogWindow(args.batch_size * seq_items, engine.state_bytes(state))

    def run(steps):
        nonlocal params, state, scaler_state
        for step in steps:
            batch = data.get_batch("train", step, args.batch_size, args.seed)
            lr = lr_fn(train_py.schedule_count(state))
            params, state, scaler_state, loss, info = train_step(params, state, scaler_state, batch)
            window.add(step, loss, info, lr)

    run([1])  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True), forbid_host_syncs(), guards_may_read_scalars():
        run(range(2, 13))
    records, stuck = window.drain()
    assert [r["step"] for r in records] == list(range(1, 13)) and not stuck
    scales = [r["loss_scale"] for r in records]
    assert any(r["found_inf"] for r in records) and any(b > a for a, b in zip(scales, scales[1:])), scales
    assert records[-1]["skipped_total"] == sum(r["found_inf"] for r in records)
    assert all(r["loss"] > 0 for r in records)
    assert all((r["grad_norm"] is None) == r["found_inf"] for r in records)


@pytest.mark.slow
def test_train_step_keeps_its_grads_buffer_and_trains_as_with_a_new_one_each_step():
    """``make_train_step`` (compiled, one bucket) has backward write the flat grads into one
    buffer kept across steps (``grads_into``); with ``keep_grads=False`` it takes ``flat.grad``,
    a new buffer from each backward. The same params, bit for bit, step after step."""
    train_py = load_train_module()
    args = train_py.parse_args([*SMALL_GPT, "--dtype", "fp16", "--steps", "5"])
    train_py.check_args(args, 1)
    data = train_py.load_data(args)
    results = {}
    for keep in (True, False):
        params_fp32, loss_fn, _ = train_py.build(args, data, torch.device("cpu"))
        engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.float16, donate=True)
        params, state, scaler_state = engine.init(params_fp32)
        train_step = train_py.make_train_step(engine, loss_fn, compile=True, keep_grads=keep)
        history = []
        for step in range(1, 5):
            batch = data.get_batch("train", step, args.batch_size, args.seed)
            params, state, scaler_state, loss, info = train_step(params, state, scaler_state, batch)
            history.append(fzero.flatten(params, engine.layout).clone())
        results[keep] = history
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    assert not torch.equal(results[True][0], results[True][-1])  # it trained
