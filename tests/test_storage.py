"""fzero.storage: the master storages, used through one interface (``dtype``, ``full``, ``store``,
``reads_params``) the way the engine and the checkpoint package use them."""

import pytest
import torch

import fzero
from fzero import transforms
from fzero.storage import MASTERS, FP32Master, RemainderMaster, master_storage
from fzero.update import cast_params


def masters(n=4096, seed=0):
    """FP32 masters over many magnitudes, with BF16's exact ties and values past BF16's range
    kept out (``split`` saturates those: ``test_remainder``)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * torch.logspace(-30, 30, n)
    ties = (m.view(torch.int32) & ~0xFFFF | 0x8000).view(torch.float32)  # exactly between two BF16 values
    return torch.cat([m, ties, torch.tensor([0.0, -0.0, 1e-45, -3.0e38])])


@pytest.mark.parametrize("name", ["fp32", "remainder"])
def test_store_then_full_gives_back_the_fp32_master_bitwise(name):
    storage = MASTERS[name]
    master = masters()
    params_shard = cast_params(master, torch.bfloat16)  # what the step casts and the params hold
    stored = storage.store(master, params_shard)
    assert stored.dtype == storage.dtype and stored.shape == master.shape
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
    with pytest.raises(ValueError, match="master must be 'fp32' or 'remainder', got 'int8'"):
        master_storage("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="master='remainder'.*needs param_dtype=torch.bfloat16, got torch.float16"):
        fzero.zero1(transforms.adamw(), param_dtype=torch.float16, master="remainder")


@pytest.mark.parametrize("name", ["fp32", "remainder"])
def test_the_engine_keeps_what_its_storage_stores(name):
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.bfloat16, master=name)
    params, state, ss = engine.init({"w": torch.randn(300), "b": torch.randn(7)})
    assert engine.storage is MASTERS[name] and engine.master == name and state.master.dtype == engine.storage.dtype
    params, state, ss, _ = engine.step(params, {"w": torch.randn(300).bfloat16(), "b": torch.ones(7).bfloat16()},
                                       state, ss)
    full = engine.with_fp32_master(params, state)
    shard = cast_params(full.master, torch.bfloat16)
    assert torch.equal(shard, engine.flat_params(params))  # world size 1: the shard is the whole buffer
    assert torch.equal(engine.stored(full, shard).master, state.master)  # what the checkpoint package calls
