"""fzero.storage: the master storages, used through one interface (``dtype``, ``numel``, ``full``,
``store``, ``reads_params``) the way the engine and the checkpoint package use them; the params'
own FP32 shard as the master (``master="params"``) trains bit for bit like an FP32 master."""

import optree
import pytest
import torch

import fzero
import fzero.checkpoint
from fzero import transforms
from distributed import run_ranks
from fzero.storage import MASTERS, FP32Master, ParamsMaster, RemainderMaster, master_storage
from fzero.cast import cast_params
from helpers import grads_like, odd_params, train_with_master


def masters(n=4096, seed=0):
    """FP32 masters over many magnitudes, with BF16's exact ties and values past BF16's range
    kept out (``split`` saturates those: ``test_remainder``)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * torch.logspace(-30, 30, n)
    ties = (m.view(torch.int32) & ~0xFFFF | 0x8000).view(torch.float32)  # exactly between two BF16 values
    return torch.cat([m, ties, torch.tensor([0.0, -0.0, 1e-45, -3.0e38])])


@pytest.mark.parametrize("name,param_dtype", [("fp32", torch.bfloat16), ("remainder", torch.bfloat16),
                                              ("params", torch.float32)])
def test_store_then_full_gives_back_the_fp32_master_bitwise(name, param_dtype):
    storage = MASTERS[name]
    master = masters()
    params_shard = cast_params(master, param_dtype)  # what the step casts and the params hold
    stored = storage.store(master, params_shard)
    assert stored.dtype == storage.dtype and stored.shape == (storage.numel(master.numel()),)
    back = storage.full(stored, lambda: params_shard)
    assert back.dtype == torch.float32 and torch.equal(back.view(torch.int32), master.view(torch.int32))


def test_the_remainder_is_the_low_16_bits_and_the_params_the_high_ones():
    master = masters()
    params_shard = cast_params(master, torch.bfloat16)
    stored = RemainderMaster().store(master, params_shard)
    high = params_shard.view(torch.int16).to(torch.int32) * 0x10000
    assert torch.equal(high + stored.to(torch.int32), master.view(torch.int32))
    assert RemainderMaster.dtype == torch.int16 and RemainderMaster.reads_params


def test_only_a_storage_that_reads_the_params_asks_for_them():
    def no_params():
        raise AssertionError("read the params")

    master = masters()
    assert not FP32Master.reads_params and FP32Master().full(master, no_params) is master
    assert FP32Master().store(master, cast_params(master, torch.bfloat16)) is master
    with pytest.raises(AssertionError, match="read the params"):
        RemainderMaster().full(torch.zeros(3, dtype=torch.int16), no_params)


def test_master_storage_validates_the_option_as_zero1_does():
    assert isinstance(master_storage("fp32", torch.float16), FP32Master)
    assert isinstance(master_storage("remainder", torch.bfloat16), RemainderMaster)
    with pytest.raises(ValueError, match="master must be 'fp32', 'remainder' or 'params', got 'int8'"):
        master_storage("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="master='remainder'.*needs param_dtype=torch.bfloat16, got torch.float16"):
        fzero.zero1(transforms.adamw(), param_dtype=torch.float16, master="remainder")
    assert isinstance(master_storage("params", torch.float32), ParamsMaster) and ParamsMaster.reads_params
    with pytest.raises(ValueError, match="master='params' takes the FP32 params' own shard.*needs "
                                         "param_dtype=torch.float32, got torch.bfloat16"):
        fzero.zero1(transforms.adamw(), param_dtype=torch.bfloat16, master="params")


@pytest.mark.parametrize("name,param_dtype", [("fp32", torch.bfloat16), ("remainder", torch.bfloat16),
                                              ("params", torch.float32)])
def test_the_engine_keeps_what_its_storage_stores(name, param_dtype):
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=param_dtype, master=name)
    params, state, ss = engine.init({"w": torch.randn(300), "b": torch.randn(7)})
    assert engine.storage is MASTERS[name] and engine.master == name and state.master.dtype == engine.storage.dtype
    params, state, ss, _ = engine.step(params, {"w": torch.randn(300).to(param_dtype), "b": torch.ones(7).to(param_dtype)},
                                       state, ss)
    full = engine.with_fp32_master(params, state)
    shard = cast_params(full.master, param_dtype)
    assert torch.equal(shard, engine.flat_params(params))  # world size 1: the shard is the whole buffer
    assert torch.equal(engine.stored(full, shard).master, state.master)  # what the checkpoint package calls


# ---------------------------------------------------------------- master="params"
STEPS, BAD_STEP = 12, 5


def train_fp32(master, *, compiled=False, donate=False, rank=0, steps=STEPS):
    """FP32 params with ``master``: ``(engine, params, state, scaler_state, flat params after each step)``."""
    engine, params, state, history, ss = train_with_master(master, torch.float32, steps=steps, bad_step=BAD_STEP,
                                                           compiled=compiled, donate=donate, rank=rank)
    assert [bool(f) for _, f in history] == [s == BAD_STEP for s in range(steps)]
    return engine, params, state, ss, [p for p, _ in history]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_the_params_as_master_train_bit_for_bit_like_an_fp32_master_in_4s_less(compiled, donate):
    ref_engine, _, ref_state, _, ref = train_fp32("fp32", compiled=compiled, donate=donate)
    engine, params, state, _, got = train_fp32("params", compiled=compiled, donate=donate)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))  # the params at every step, the skipped one too
    assert state.master.shape == (0,)
    assert torch.equal(engine.with_fp32_master(params, state).master, ref_state.master)
    for a, b in zip(optree.tree_leaves(ref_state.tx_state), optree.tree_leaves(state.tx_state)):
        assert torch.equal(a, b)
    assert ref_engine.state_bytes(ref_state) - engine.state_bytes(state) == 4 * engine.layout.shard_numel


def two_ranks_fp32(rank, world_size):
    return {m: train_fp32(m, rank=rank, steps=6)[4][-1] for m in ("fp32", "params")}


@pytest.mark.multirank
def test_the_params_as_master_on_two_ranks_equal_an_fp32_master():
    for r in run_ranks(two_ranks_fp32, 2):
        assert torch.equal(r["fp32"], r["params"])


@pytest.mark.parametrize("saved,loaded", [("params", "fp32"), ("fp32", "params")])
def test_a_checkpoint_of_the_params_as_master_loads_into_an_fp32_master_and_back(tmp_path, saved, loaded):
    """The checkpoint holds the FP32 master in either mode: loaded into the other, the next
    steps follow the run that went straight on, bit for bit."""
    engine, params, state, ss, _ = train_fp32(saved, steps=4)
    fzero.checkpoint.save(str(tmp_path / "ckpt"), params, state, ss, engine)
    other, _, _, _, _ = train_fp32(loaded, steps=0)
    p2, s2, ss2, _ = fzero.checkpoint.load(str(tmp_path / "ckpt"), other)
    assert s2.master.shape == (other.storage.numel(other.layout.shard_numel),)
    for s in range(4, 7):
        grads = grads_like(odd_params(), 10 * s)
        params, state, ss, _ = engine.step(params, grads, state, ss)
        p2, s2, ss2, _ = other.step(p2, grads, s2, ss2)
        assert torch.equal(fzero.flatten(params, engine.layout), fzero.flatten(p2, other.layout))
    with pytest.raises(fzero.checkpoint.CheckpointError, match="with_fp32_master"):
        fzero.checkpoint.export_full(str(tmp_path / "full.safetensors"), state if saved == "params" else s2,
                                     engine if saved == "params" else other)


def test_the_params_as_master_refuse_params_of_another_step():
    """The master is the params: init's params with a later step's state would train from the
    wrong weights, so the step refuses them, as with the remainder."""
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, master="params")
    p0, state, ss = engine.init(odd_params())
    params, state, ss, _ = engine.step(p0, grads_like(odd_params(), 1), state, ss)
    with pytest.raises(ValueError, match="not written together with this state"):
        engine.step(p0, grads_like(odd_params(), 2), state, ss)


@pytest.mark.parametrize("chunk_numel", [None, 64], ids=["whole", "chunks"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_the_params_as_master_with_a_transform_that_has_no_fused_form(chunk_numel, donate):
    """SGD with momentum runs the generic update (whole or chunk by chunk), writing the params'
    own buffer with ``donate``: the same params, bit for bit, as an FP32 master."""
    out = {}
    for master in ("fp32", "params"):
        engine = fzero.zero1(transforms.sgd(lr=0.1, momentum=0.9), param_dtype=torch.float32, master=master,
                             donate=donate, chunk_numel=chunk_numel)
        params, state, ss = engine.init(odd_params())
        for s in range(4):
            params, state, ss, _ = engine.step(params, grads_like(odd_params(), s), state, ss)
        out[master] = fzero.flatten(params, engine.layout)
    assert torch.equal(out["fp32"], out["params"])
