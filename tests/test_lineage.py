"""fzero.lineage: params edited behind the engine's back, params of another step, a donated
state used twice; ``Engine.load_params``, the supported way to set weights after ``init``."""

import copy

import optree
import pytest
import torch

import fzero
from fzero import transforms
from fzero.lineage import ParamsEditedError
from helpers import grads_like, master_tree, tree_equal
from fzero.models import mlp

MODES = ["fp32", "remainder"]


def engine_and_init(master="fp32", **kw):
    p0 = mlp.init(torch.Generator().manual_seed(0), (8, 16, 4))
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.bfloat16, master=master, **kw)
    return engine, p0, *engine.init(p0)


def bf16_grads(p0, seed):
    return optree.tree_map(lambda g: g.to(torch.bfloat16), grads_like(p0, seed))


@pytest.mark.parametrize("master", MODES)
@pytest.mark.parametrize("edit", ["copy_", "zero_", "flat buffer"])
def test_a_write_into_the_param_views_raises_in_both_master_modes(master, edit):
    """Both modes refuse, where the FP32 master silently undid the write and the remainder mixed
    it into the master (a zeroed leaf became NaN)."""
    engine, p0, params, state, ss = engine_and_init(master)
    params, state, ss, _ = engine.step(params, bf16_grads(p0, 1), state, ss)
    with torch.no_grad():
        if edit == "copy_":
            params["layers"][0]["w"].copy_(torch.ones_like(params["layers"][0]["w"]))
        elif edit == "zero_":
            params["layers"][1]["b"].zero_()
        else:
            engine.flat_params(params)[:3] = 1.0
    before = master_tree(engine, state) if master == "fp32" else state.master.clone()
    with pytest.raises(ParamsEditedError, match=r"engine.step: the params were written in place.*load_params"):
        engine.step(params, bf16_grads(p0, 2), state, ss)
    with pytest.raises(ParamsEditedError, match="checkpoint.save"):
        engine.with_fp32_master(params, state, where="checkpoint.save")
    after = master_tree(engine, state) if master == "fp32" else state.master
    assert tree_equal(before, after)  # nothing was written


@pytest.mark.parametrize("donate", [False, True])
def test_load_params_sets_the_master_exactly_and_keeps_the_moments_in_both_modes(donate):
    """``load_params`` = the master ``init`` would build from the new values, the params its
    cast, Adam's moments and count kept; the two master modes stay bitwise equal after it."""
    new_values = mlp.init(torch.Generator().manual_seed(7), (8, 16, 4))
    out = {}
    for master in MODES:
        engine, p0, params, state, ss = engine_and_init(master, donate=donate)
        for i in range(3):
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        moments = copy.deepcopy(state.tx_state)
        params, state = engine.load_params(state, new_values)
        fresh_params, fresh_state, _ = engine.init(new_values)
        assert tree_equal(params, fresh_params)
        assert torch.equal(engine.with_fp32_master(params, state).master,
                           engine.with_fp32_master(fresh_params, fresh_state).master)
        assert tree_equal(state.tx_state, moments)
        for i in range(3, 6):  # steps after it are accepted: the new params are the engine's own
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        out[master] = (fzero.flatten(params, engine.layout), engine.with_fp32_master(params, state).master)
    assert torch.equal(out["fp32"][0], out["remainder"][0]) and torch.equal(out["fp32"][1], out["remainder"][1])


def test_params_of_another_step_raise_with_the_remainder_master():
    """With the remainder the master is rebuilt from the params: init's params with the state of
    five steps later gave a wrong master (0.049 off). The FP32 master does not read them."""
    for master in MODES:
        engine, p0, params0, state, ss = engine_and_init(master)
        params = params0
        for i in range(5):
            params, state, ss, _ = engine.step(params, bf16_grads(p0, i), state, ss)
        if master == "remainder":
            with pytest.raises(ValueError, match="checkpoint.save: these params were not written together with this state"):
                engine.with_fp32_master(params0, state, where="checkpoint.save")
            with pytest.raises(ValueError, match="engine.step: these params were not written together"):
                engine.step(params0, bf16_grads(p0, 5), state, ss)
        else:  # the new params come from the master alone
            a = engine.step(params0, bf16_grads(p0, 5), state, ss)
            b = engine.step(params, bf16_grads(p0, 5), state, ss)
            assert tree_equal(a[:2], b[:2])


def test_a_donated_state_used_twice_raises():
    engine, p0, params, state, ss = engine_and_init(donate=True)
    new_params, new_state, new_ss, _ = engine.step(params, bf16_grads(p0, 0), state, ss)
    count = int(new_state.tx_state[0].count)
    with pytest.raises(ValueError, match="donated to an earlier step"):
        engine.step(params, bf16_grads(p0, 1), state, ss)
    assert int(new_state.tx_state[0].count) == count  # nothing counted again
    engine.step(new_params, bf16_grads(p0, 1), new_state, new_ss)  # the returned state steps on


def test_a_clone_or_deepcopy_of_the_state_is_not_refused():
    """Unmarked tensors (a clone) are not checked; a deepcopy keeps the marks, so it pairs with
    the same params: saving or stepping from a kept copy works."""
    engine, p0, params, state, ss = engine_and_init("remainder")
    params, state, ss, _ = engine.step(params, bf16_grads(p0, 0), state, ss)
    for kept in (optree.tree_map(torch.clone, state), copy.deepcopy(state)):
        ref = engine.with_fp32_master(params, state).master
        assert torch.equal(engine.with_fp32_master(params, kept).master, ref)
