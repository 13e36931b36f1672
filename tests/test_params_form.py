"""fzero.params_form: the params' door -- their form built once per call, read by the plan, the
stages, the lineage checks and the master's storage."""
import unittest.mock

import optree
import pytest
import torch

import fzero
import fzero.plan
from fzero import transforms
from fzero.params_form import ParamsForm
from helpers import odd_params


@pytest.fixture
def bound():
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    params, state, ss = engine.init(odd_params())
    return engine, params, state


def test_flat_params_are_their_own_buffer(bound):
    engine, params, _ = bound
    flat = engine.flat_params(params)
    form = ParamsForm.of(flat, engine.grad_path.check(flat, "params"), engine.layout, traced=False)
    assert form.flat_in and form.leaves is None and form.buffer is flat and form.given is flat
    assert torch.equal(form.shard(engine.layout, 0), flat)


@pytest.mark.parametrize("traced", [False, True])
def test_a_pytree_of_views_finds_its_buffer_eagerly_only(bound, traced):
    engine, params, _ = bound
    leaves = engine.grad_path.check(params, "params")
    form = ParamsForm.of(params, leaves, engine.layout, traced=traced)
    assert not form.flat_in and form.leaves is leaves and form.given is params
    if traced:  # a traced tensor has no storage to read: the shard is laid out anew
        assert form.buffer is None
    else:
        assert form.buffer.shape == (engine.layout.padded_numel,)
        assert form.buffer.data_ptr() == engine.flat_params(params).data_ptr()
    assert torch.equal(form.shard(engine.layout, 0), fzero.flatten(params, engine.layout))


def test_separate_tensors_have_no_buffer_and_their_shard_is_laid_out_anew(bound):
    engine, params, _ = bound
    copies = optree.tree_map(torch.clone, params)  # same values, each leaf its own memory
    form = ParamsForm.of(copies, engine.grad_path.check(copies, "params"), engine.layout, traced=False)
    assert form.buffer is None
    assert torch.equal(form.shard(engine.layout, 0), fzero.flatten(params, engine.layout))


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_with_fp32_master_and_checkpoint_save_build_no_step_plan(tmp_path, master):
    """The checkpoint finds this rank's params shard through the door, not through a whole step's
    plan: ``fzero.plan.choose`` is never called by ``with_fp32_master`` or ``checkpoint.save``."""
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.bfloat16, master=master)
    params, state, ss = engine.init(odd_params())
    with unittest.mock.patch.object(fzero.plan, "choose", side_effect=AssertionError("a plan was built")):
        full = engine.with_fp32_master(params, state)
        fzero.checkpoint.save(tmp_path / "ck", params, state, ss, engine)
    # the FP32 values init was given, exactly (the remainder rebuilds them from the params shard)
    assert torch.equal(full.master, fzero.flatten(odd_params(), engine.layout, dtype=torch.float32))
