"""The device tier: the checks that prove fzero's CUDA paths (docs/devices.md lists them), each
run on the test device against a reference that does not share the path under test.

    make test-gpu                                   # on a GPU: FZERO_TEST_DEVICES=cuda pytest -m device
    pytest -m device                                # here: the CPU half; CUDA too where one is present

``FZERO_TEST_DEVICES`` (comma-separated, ``cpu`` and/or ``cuda``) picks the devices; unset, the
tier runs on the CPU and, when ``torch.cuda.is_available()``, on CUDA (skipped, with the reason,
elsewhere). A CUDA named in it that is not there stops the collection: a GPU run never passes by
skipping. ``benchmarks/gpu_suite.sh`` runs this tier first and times nothing if it fails.

On the CPU every check runs its CPU-meaningful part (the same code, a CPU reference), so the
tier cannot rot where no GPU is; the comparisons of a device's results with the CPU's run on
the device only.
"""
from __future__ import annotations

import contextlib
import copy
import os

import optree
import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import checkpoint as ck
from fzero import transforms
from distributed import run_ranks
from helpers import (assert_compiled_state_close, ckpt_engine, ckpt_params, ckpt_steps, forbid_host_syncs,
                     grads_like, master_tx, odd_params, torch_adamw, torch_optimizer, tree_assert_close)

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False): the tier's CUDA half runs on a GPU, `make test-gpu`"


def devices_under_test() -> list:
    """The devices this run's tier covers (the module docstring)."""
    chosen = os.environ.get("FZERO_TEST_DEVICES")
    if chosen is None:
        return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    unknown = sorted(set(names) - {"cpu", "cuda"})
    if unknown or not names:
        raise pytest.UsageError(f"FZERO_TEST_DEVICES={chosen!r}: name cpu and/or cuda, comma-separated (got {unknown or 'none'})")
    if "cuda" in names and not torch.cuda.is_available():
        raise pytest.UsageError(f"FZERO_TEST_DEVICES={chosen!r} asks for CUDA, but {NO_CUDA.split(':')[0]}")
    return names


pytestmark = pytest.mark.device


@pytest.fixture(params=devices_under_test())
def dev(request) -> torch.device:
    return torch.device(request.param)


def on(dev, tree):
    return optree.tree_map(lambda x: x.to(dev), tree)


def to_cpu(tree):
    return optree.tree_map(lambda x: x.detach().cpu(), tree)


@contextlib.contextmanager
def no_host_syncs(dev):
    """Any host sync in the block raises: CUDA's sync debug mode on a GPU (a blocking copy, an
    ``.item()``, a ``bool(tensor)``); on the CPU, traps on every Tensor -> Python conversion."""
    if dev.type != "cuda":
        with forbid_host_syncs():
            yield
        return
    torch.cuda.synchronize(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------- the update against torch.optim


def fp32_steps(engine, dev, steps=5):
    params, state, ss = engine.init(on(dev, odd_params()))
    grads = [grads_like(odd_params(), s) for s in range(steps)]
    for g in grads:
        params, state, ss, _ = engine.step(params, on(dev, g), state, ss)
    return params, grads


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fp32_step_matches_torch_optim_on_the_cpu(dev, name):
    """FP32 params and master: AdamW (on CUDA ``torch._fused_adamw_`` on the shard) and SGD with
    momentum and weight decay against torch.optim run on the CPU."""
    if name == "adamw":
        tx, ref = transforms.adamw(lr=1e-2, weight_decay=0.1), dict(optimizer=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        tx, ref = (transforms.sgd(lr=1e-2, momentum=0.9, weight_decay=0.1),
                   dict(optimizer=torch.optim.SGD, lr=1e-2, momentum=0.9, weight_decay=0.1))
    params, grads = fp32_steps(fzero.zero1(tx, param_dtype=torch.float32), dev)
    assert all(x.device.type == dev.type for x in optree.tree_leaves(params))
    want = torch_optimizer(ref.pop("optimizer"), odd_params(), grads, **ref)
    tree_assert_close(to_cpu(params), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- compiled, loss scale, host syncs


def fp16_run(dev, *, compiled: bool, steps=4, bad_step=1):
    """FP16 params, dynamic loss scale, clipping + AdamW with decay; the grads of ``bad_step``
    hold an inf. ``(params, state, scaler_state, found_inf per step)``."""
    engine = fzero.zero1(master_tx(), param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=2.0**10))
    params, state, ss = engine.init(on(dev, odd_params()))
    step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
    found = []
    for s in range(steps):
        grads = on(dev, optree.tree_map(lambda g: (g * ss.scale.cpu()).half(), grads_like(odd_params(), s)))
        if s == bad_step:
            grads["w"][2, 3] = float("inf")
        params, state, ss, info = step(params, grads, state, ss)
        found.append(info["found_inf"].clone())
    return params, state, ss, [bool(f) for f in found]


@pytest.mark.slow
def test_compiled_step_equals_the_eager_one_and_skips_the_same(dev):
    eager = fp16_run(dev, compiled=False)
    torch._dynamo.reset()
    compiled = fp16_run(dev, compiled=True)
    assert eager[3] == compiled[3] == [False, True, False, False]
    tree_assert_close(compiled[0], eager[0], rtol=1e-3, atol=1e-5)  # FP16 params: a rounding apart at most
    assert_compiled_state_close(compiled[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled[2], eager[2]))  # the loss-scale state


def test_overflow_skips_the_step_and_halves_the_scale_with_no_host_sync(dev):
    """Eager FP16 steps with an overflow in the middle: the step is skipped (params and state
    unchanged, bit for bit), the scale halves, and no step syncs with the host."""
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=100))
    params, state, ss = engine.init(on(dev, odd_params()))
    grads = [on(dev, optree.tree_map(lambda g: (g * 2.0**8).half(), grads_like(odd_params(), s))) for s in range(3)]
    grads[1]["blocks"][0]["g"][4] = float("nan")
    history = []
    with no_host_syncs(dev):
        for g in grads:
            params, state, ss, info = engine.step(params, g, state, ss)
            history.append((optree.tree_map(torch.clone, params), optree.tree_map(torch.clone, state), ss, info["found_inf"]))
    assert [bool(h[3]) for h in history] == [False, True, False]
    assert [float(h[2].scale) for h in history] == [2.0**8, 2.0**7, 2.0**7]
    (p0, s0, *_), (p1, s1, *_), (p2, *_) = history
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((p0, s0)), optree.tree_leaves((p1, s1))))
    assert not torch.equal(p1["w"], p2["w"])


# ---------------------------------------------------------------- master storage and moments


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_remainder_master_trains_bit_for_bit_like_the_fp32_master(dev, compiled):
    """BF16 params with an int16 remainder (compiled for a GPU: the int32-bits rounding, run by
    triton) against an FP32 master: the same params at every step, the same master."""
    runs = {}
    for master in ("fp32", "remainder"):
        torch._dynamo.reset()
        engine = fzero.zero1(master_tx(), param_dtype=torch.bfloat16, master=master)
        params, state, ss = engine.init(on(dev, odd_params()))
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        history = []
        for s in range(5):
            grads = on(dev, optree.tree_map(lambda g: (g * 3).bfloat16(), grads_like(odd_params(), s)))
            params, state, ss, _ = step(params, grads, state, ss)
            history.append(fzero.flatten(params, engine.layout).clone())
        runs[master] = history, engine.with_fp32_master(params, state).master
    (ref, ref_master), (got, got_master) = runs["fp32"], runs["remainder"]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.equal(got_master, ref_master)


def moments_run(dev, moments, steps=6):
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments),
                         param_dtype=torch.float32)
    params, state, ss = engine.init(on(dev, ckpt_params()))
    grads = [grads_like(ckpt_params(), s) for s in range(steps)]
    for g in grads:
        params, state, ss, _ = engine.step(params, on(dev, g), state, ss)
    return to_cpu(params), to_cpu(state.tx_state), grads


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_low_precision_moments_track_torch_adamw_and_match_the_cpu(dev, moments):
    """BF16 and 8-bit block-quantized moments: near torch.optim.AdamW's FP32 ones after a few
    steps (the storage's error, on any device); on a GPU also the CPU's run, to rounding (8-bit
    codes at most a level apart, rarely)."""
    params, tx_state, grads = moments_run(dev, moments)
    want = torch_adamw(ckpt_params(), grads, lr=1e-2, weight_decay=0.1)
    tree_assert_close(params, want, rtol=0, atol=2e-3)  # steps of lr=1e-2: a moment's storage error, not a wrong update
    if dev.type != "cpu":
        cpu_params, cpu_state, _ = moments_run(torch.device("cpu"), moments)
        tree_assert_close(params, cpu_params, rtol=1e-5, atol=1e-6)
        assert_compiled_state_close(tx_state, cpu_state)


# ---------------------------------------------------------------- checkpoints, offload, the module


@pytest.mark.parametrize("save", ["save", "async_save"])
def test_checkpoint_round_trip_and_reshard_keep_every_bit(dev, tmp_path, save):
    """Save the device's state (``async_save``: staged on a side stream into pinned memory, and
    the next, donated step run at once); load it back (every state leaf and the loss scale, bit
    for bit, on the device), and into another layout (buckets, so other shard boundaries): the
    same master."""
    path = str(tmp_path / "ckpt")
    engine = ckpt_engine(moments=torch.int8, donate=True)
    params, state, ss = engine.init(on(dev, ckpt_params()))
    params, state, ss = ckpt_steps(engine, params, state, ss, range(3))
    saved = optree.tree_map(torch.clone, (params, state, ss))
    if save == "save":
        ck.save(path, params, state, ss, engine, extra={"step": 3})
    else:
        future = ck.async_save(path, params, state, ss, engine, extra={"step": 3})
        ckpt_steps(engine, params, state, ss, [3])  # overwrites params and state in place while it writes
        assert future.result() is None
    fresh = ckpt_engine(moments=torch.int8)
    fresh.init(on(dev, ckpt_params(seed=1)))
    p2, s2, ss2, extra = ck.load(path, fresh)
    assert extra == {"step": 3}
    for a, b in zip(optree.tree_leaves(saved), optree.tree_leaves((p2, s2, ss2))):
        assert b.device.type == dev.type and torch.equal(a, b)
    other = ckpt_engine(moments=torch.int8, bucket_bytes=300)
    other.init(on(dev, ckpt_params(seed=1)))
    p3, s3, _, _ = ck.load(path, other)
    assert len(other.layout.buckets) > 1 and s3.master.device.type == dev.type
    want, got = fzero.unflatten(saved[1].master, engine.layout), fzero.unflatten(s3.master, other.layout)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(want), optree.tree_leaves(got)))
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(saved[0]), optree.tree_leaves(p3)))


def test_offload_keeps_the_state_on_the_host_and_trains_like_the_device_state(dev):
    """``offload="cpu"``: master and moments in (pinned, with CUDA params) host memory, the
    params on the device; the same training as the state on the device, to rounding (the update
    runs on the host's kernels instead of the device's)."""
    runs = {}
    for offload in (None, "cpu"):
        engine = fzero.zero1(master_tx(), param_dtype=torch.float16, offload=offload)
        params, state, ss = engine.init(on(dev, odd_params()))
        for s in range(4):
            grads = on(dev, optree.tree_map(lambda g: (g * ss.scale.cpu()).half(), grads_like(odd_params(), s)))
            params, state, ss, _ = engine.step(params, grads, state, ss)
        runs[offload] = params, state
    params, state = runs["cpu"]
    assert all(x.device.type == dev.type for x in optree.tree_leaves(params))
    assert state.master.device.type == "cpu" and state.master.is_pinned() == (dev.type == "cuda")
    tree_assert_close(to_cpu(params), to_cpu(runs[None][0]), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(state.master, runs[None][1].master.cpu(), rtol=1e-6, atol=1e-7)


def test_an_nn_module_trains_like_torch_adamw_buffers_included(dev):
    """The front door: ``fzero.module.functional`` + ``grad_and_value`` + ``step`` on a module with
    BatchNorm (no bias before it: Adam would turn that bias's zero grad's rounding into steps), FP32, against the same module trained by torch.optim.AdamW on the same device."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32, bias=False), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4)).to(dev)
    ref = copy.deepcopy(net)
    fm = fzero.module.functional(net)
    engine = fzero.zero1(transforms.adamw(lr=3e-3, weight_decay=0.01), param_dtype=torch.float32)
    params, state, ss = engine.init(fm.params)
    buffers = fm.buffers

    def loss_fn(params, buffers, x, y):
        logits, buffers = fm.apply(params, buffers, x)
        return F.cross_entropy(logits, y), buffers

    grad_fn = engine.grad_and_value(loss_fn, has_aux=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, y = torch.randn(16, 12, generator=g).to(dev), torch.randint(4, (16,), generator=g).to(dev)
        grads, (loss, buffers) = grad_fn(params, ss, buffers, x, y)
        params, state, ss, _ = engine.step(params, grads, state, ss)
        ref_loss = F.cross_entropy(ref(x), y)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    fm.load_into(params, buffers, engine=engine, state=state)
    for (name, p), q in zip(net.state_dict().items(), ref.state_dict().values()):
        assert p.device.type == dev.type, name
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- two processes


def two_process_run(rank, world_size, device_type):
    """Rank ``rank`` training FP16 AdamW on ``device_type`` in 4-element buckets over the test's
    gloo group (with CUDA tensors: gloo's CUDA collectives, all ranks on one GPU; NCCL needs a
    GPU per rank): its params after the steps, on the CPU."""
    dev = torch.device(device_type)
    engine = fzero.zero1(master_tx(), param_dtype=torch.float16, bucket_bytes=256)
    params, state, ss = engine.init(on(dev, odd_params()))
    for s in range(4):
        grads = on(dev, optree.tree_map(lambda g: (g * ss.scale.cpu()).half(), grads_like(odd_params(), 10 * s + rank)))
        if s == 1 and rank == world_size - 1:
            grads["one"][0] = float("inf")
        params, state, ss, info = engine.step(params, grads, state, ss)
    return to_cpu(params)


def one_process_mean(device_type, world_size=2):
    """The same steps on one process, each step's grads the mean of the ranks' (an inf on one
    rank: the step skipped)."""
    dev = torch.device(device_type)
    engine = fzero.zero1(master_tx(), param_dtype=torch.float16)
    params, state, ss = engine.init(on(dev, odd_params()))
    for s in range(4):
        per_rank = [optree.tree_map(lambda g: g * ss.scale.cpu(), grads_like(odd_params(), 10 * s + r)) for r in range(world_size)]
        mean = optree.tree_map(lambda *gs: (torch.stack([g.half().float() for g in gs]).mean(0)).half(), *per_rank)
        if s == 1:
            mean["one"][0] = float("inf")
        params, state, ss, _ = engine.step(params, on(dev, mean), state, ss)
    return to_cpu(params)


@pytest.mark.multirank
def test_two_processes_on_the_device_train_like_one(dev):
    """Two ranks (on one GPU: gloo with CUDA tensors, the collectives fzero's gloo path uses)
    give each the params of one process stepping on the mean of their grads; an inf on one
    rank skips the step on both."""
    out = run_ranks(two_process_run, 2, dev.type)
    want = one_process_mean(dev.type)
    for r in out:
        tree_assert_close(r, want, rtol=1e-3, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(out[0]), optree.tree_leaves(out[1])))
