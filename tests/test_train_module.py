"""examples/train_module.py: an ``nn.Module`` with BatchNorm trained through fzero equals the same
module trained with DDP and ``torch.optim.AdamW``, buffers included, and the net holds the result;
``export_full`` loads back into the module."""
import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero.checkpoint
import train_module as example
from distributed import run_ranks
from helpers import run_script

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_module.py"
STEPS, BATCH, LR, WD = 20, 32, 3e-3, 0.01  # 16 images per rank: BatchNorm's batch statistics stay well-conditioned


def fzero_and_torch(rank, world_size, steps=STEPS):
    """The same initial module trained twice on the same rows: by the example (fzero, FP32, no
    loss scale) and by DDP + torch's AdamW; both modules' params and buffers after STEPS."""
    torch.manual_seed(0)
    net = example.make_net()
    ref = copy.deepcopy(net)
    args = argparse.Namespace(steps=steps, batch_size=BATCH, lr=LR, weight_decay=WD, dtype="fp32", seed=0, log_every=10**9)
    _, params, _, losses = example.train(args, net, rank, world_size)

    model = torch.nn.parallel.DistributedDataParallel(ref) if dist.is_initialized() else ref
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    lo, hi = rank * BATCH // world_size, (rank + 1) * BATCH // world_size
    ref_losses = []
    for step in range(1, steps + 1):
        images, labels = example.batch(step, BATCH)
        loss = F.cross_entropy(model(images[lo:hi]), labels[lo:hi])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.detach())
    assert all(torch.equal(p.detach(), params[k]) for k, p in net.named_parameters())  # written back (FP32 run)
    return {"params": {k: v.clone() for k, v in params.items()}, "ref_params": dict(ref.named_parameters()),
            "buffers": dict(net.named_buffers()), "ref_buffers": dict(ref.named_buffers()),
            "losses": losses, "ref_losses": torch.stack(ref_losses)}


def check_equal(r):
    torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)
    assert r["params"].keys() == r["ref_params"].keys()
    for name, p in r["params"].items():
        torch.testing.assert_close(p, r["ref_params"][name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert r["buffers"].keys() == r["ref_buffers"].keys() and any("running_mean" in k for k in r["buffers"])
    for name, b in r["buffers"].items():
        torch.testing.assert_close(b, r["ref_buffers"][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_one_process_equals_torch_adamw():
    check_equal(fzero_and_torch(0, 1))


@pytest.mark.multirank
def test_two_ranks_equal_ddp_buffers_included():
    out = run_ranks(fzero_and_torch, 2)
    for r in out:
        # DDP broadcasts rank 0's buffers before each forward; the last forward then leaves each
        # rank's own. The example broadcasts once more at the end: every rank holds rank 0's.
        check_equal({**r, "ref_buffers": out[0]["ref_buffers"]})
    for name, b in out[0]["buffers"].items():
        assert torch.equal(b, out[1]["buffers"][name]), name


def test_export_full_loads_into_the_module(tmp_path):
    torch.manual_seed(0)
    net = example.make_net()
    args = argparse.Namespace(steps=5, batch_size=BATCH, lr=LR, weight_decay=WD, dtype="bf16", seed=0, log_every=10**9)
    engine, params, state, _ = example.train(args, net, 0, 1)
    path = tmp_path / "master.safetensors"
    fzero.checkpoint.export_full(path, state, engine)
    fresh = example.make_net()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    result = fresh.load_state_dict(safetensors_torch.load_file(path), strict=False)
    assert not result.unexpected_keys
    # the buffers are the module's own, not in the export (BatchNorm tolerates a missing counter)
    assert set(result.missing_keys) == {k for k, _ in fresh.named_buffers() if "running_" in k}
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float32
        # the FP32 master rounds to the BF16 params the run trained with
        assert torch.equal(p.detach().to(torch.bfloat16), params[name]), name


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [None, 2])
def test_the_example_runs_and_learns(tmp_path, nproc):
    launcher = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                       f"--nproc_per_node={nproc}"]
    proc = run_script([*launcher, str(EXAMPLE), "--steps", "60", "--out", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if "accuracy" in line]
    assert len(summary) == 1
    first, last = (float(x) for x in summary[0].split("loss ")[1].split(", accuracy")[0].split(" -> "))
    accuracy = float(summary[0].split("accuracy ")[1].split(" ")[0])
    assert last < 0.7 * first and accuracy > 0.5, summary
    net = example.make_net()
    net.load_state_dict(torch.load(tmp_path / "net.pt"))  # the trained net, buffers included
    assert int(net[1].num_batches_tracked) == 60
