"""The compiled step from a grads pytree, leaf by leaf (``fzero.cpu.leafwise``): the same results as
the compiled step on the flat buffer, in place, one graph for the update, no flat copy of grads."""
import optree
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fzero
import fzero.cpu.leafwise
from fzero import transforms
from helpers import compiled_buffers, grads_like, grads_seq, odd_params


@pytest.fixture(autouse=True)
def leaf_by_leaf_at_any_size(monkeypatch):
    """The test params are small: every engine here runs its update leaf by leaf, unless a test
    says otherwise (``fzero.cpu.leafwise.worthwhile``)."""
    monkeypatch.setattr(fzero.cpu.leafwise, "MIN_MEAN_NUMEL", 0)
    monkeypatch.setattr(fzero.cpu.leafwise, "MIN_NUMEL", 0)


def adamw():
    """Clipping (the grads' norm goes into each leaf's update) and AdamW with decay on matrices."""
    return transforms.chain(
        transforms.clip_by_global_norm(5.0),
        transforms.adamw(lr=1e-2, weight_decay=0.1, weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)))


def engine_for(param_dtype, donate=True, **kw):
    scaling = fzero.DynamicLossScale(init_scale=2.0**10, growth_interval=2) if param_dtype == torch.float16 else None
    return fzero.zero1(adamw(), param_dtype=param_dtype, loss_scale=scaling, donate=donate, **kw)


def train(p0, seq, param_dtype, *, flat, lr_at=None, **kw):
    """Compiled steps over ``seq``, from the grads pytree or (``flat``) from the flat buffer, lr
    raised before step ``lr_at``; returns ``(params as a pytree, state, infos)``. A pure step
    (``donate=False``) is checked to leave every bit of its inputs as they were."""
    engine = engine_for(param_dtype, **kw)
    params, state, ss = engine.init(p0)
    step = torch.compile(engine.step, fullgraph=True)
    carry = engine.flat_params(params) if flat else params
    infos = []
    for i, g in enumerate(seq):
        if i == lr_at:
            state = transforms.set_hyperparams(state, lr=3e-2)
        g = fzero.flatten(g, engine.layout) if flat else g
        given = None if engine.donate else optree.tree_leaves((carry, state))
        before = None if given is None else [x.clone() for x in given]
        carry, state, ss, info = step(carry, g, state, ss)
        assert given is None or all(torch.equal(a, b) for a, b in zip(given, before))
        infos.append(info)
    if not flat:  # it ran leaf by leaf, and the params are views of one flat buffer again
        assert engine._kernels.leaves._compiled
        assert torch.equal(engine.flat_params(carry), fzero.flatten(carry, engine.layout))
    return (fzero.unflatten(carry, engine.layout) if flat else carry), state, infos


# Donated and pure, each with buckets (padding between leaves: where each writes), one dtype each.
# Without buckets, donated, in both dtypes: the two tests after this one, bit for bit too.
@pytest.mark.slow
@pytest.mark.parametrize("param_dtype,donate", [(torch.bfloat16, True), (torch.float16, False)])
def test_leaf_by_leaf_equals_the_flat_step_bitwise(param_dtype, donate, monkeypatch):
    """Every param, the master and the moments, padding included (several buckets: padding
    between leaves), bit for bit, donated (in place) and pure (new tensors, the inputs untouched);
    an inf skips the step in both, so does a NaN (the clipping norm NaN); lr and the loss scale
    change without a recompile. In groups of 2 leaves, several groups share a graph (dynamic
    sizes) and a 1-element leaf has one of its own, none compiled twice."""
    monkeypatch.setattr(fzero.cpu.leafwise, "GROUP", 2)
    p0 = odd_params()
    seq = grads_seq(p0, param_dtype, 2.0**10 if param_dtype == torch.float16 else 1.0)
    seq[4]["blocks"][0]["g"][3] = float("nan")
    with torch._dynamo.config.patch(error_on_recompile=True):
        leaf = train(p0, seq, param_dtype, flat=False, lr_at=3, bucket_bytes=48, donate=donate)
    flat = train(p0, seq, param_dtype, flat=True, lr_at=3, bucket_bytes=48, donate=donate)
    assert [bool(i["found_inf"]) for i in leaf[2]] == [bool(i["found_inf"]) for i in flat[2]] == [False, False, True, False, True]
    assert len({float(i["loss_scale"]) for i in leaf[2]}) > 1 or param_dtype != torch.float16
    for a, b in zip(optree.tree_leaves(leaf[:2]), optree.tree_leaves(flat[:2])):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
def test_many_leaves_compile_two_graphs_and_match_the_flat_step(monkeypatch):
    """10 leaves of 10 sizes in groups of 4: the update compiles one graph for the full groups
    and one for the last, whatever the sizes (dynamic), none a recompile; the results are the
    flat step's, bit for bit."""
    monkeypatch.setattr(fzero.cpu.leafwise, "GROUP", 4)
    g = torch.Generator().manual_seed(3)
    p0 = {f"p{i}": torch.randn(2 + 7 * i, generator=g) for i in range(10)}
    seq = [optree.tree_map(lambda x: (torch.randn(x.shape, generator=g) * 64).half(), p0) for _ in range(2)]
    torch._dynamo.reset()
    engine = engine_for(torch.float16)
    params, state, ss = engine.init(p0)
    step = torch.compile(engine.step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for grads in seq:
            params, state, ss, _ = step(params, grads, state, ss)
    assert len(engine._kernels.leaves._compiled) == 2
    flat = train(p0, seq, torch.float16, flat=True)
    for a, b in zip(optree.tree_leaves((params, state)), optree.tree_leaves(flat[:2])):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
def test_leaf_by_leaf_with_bf16_moments_equals_the_flat_step_bitwise():
    """BF16 moments are ``[S]`` tensors too, elementwise: the same path, the same bits."""
    p0 = odd_params()
    seq = grads_seq(p0, torch.bfloat16, 1.0, n=3, bad_step=None)
    out = []
    for flat in (False, True):
        tx = transforms.adamw(lr=1e-2, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
        engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None, donate=True)
        params, state, ss = engine.init(p0)
        step = torch.compile(engine.step, fullgraph=True)
        carry = engine.flat_params(params) if flat else params
        for g in seq:
            carry, state, ss, _ = step(carry, fzero.flatten(g, engine.layout) if flat else g, state, ss)
        assert (engine._kernels.leaves._compiled != {}) == (not flat)
        out.append((fzero.flatten(carry, engine.layout) if not flat else carry, state))
    for a, b in zip(optree.tree_leaves(out[0]), optree.tree_leaves(out[1])):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
def test_leaf_by_leaf_writes_in_place_and_copies_no_grads():
    """The params come back as the very leaves given, and the step's graph allocates no flat
    buffer: the grads are read as leaves, not laid out into one."""
    torch._dynamo.reset()
    p0 = {"a": torch.randn(300, 7), "b": torch.randn(5), "c": torch.randn(2, 3, 4)}
    engine = engine_for(torch.float16)
    params, state, ss = engine.init(p0)
    grads = optree.tree_map(lambda x: (x * 64).half(), grads_like(p0, 0))
    given = optree.tree_leaves(params)
    counters.clear()
    out, buffers = compiled_buffers(torch.compile(engine.step, fullgraph=True), params, grads, state, ss)
    # the step, and its update's loops per leaf (compiled once per dispatch state it runs in)
    assert counters["stats"]["unique_graphs"] == 1 + len(engine._kernels.leaves._compiled)
    assert all(a is b for a, b in zip(optree.tree_leaves(out[0]), given))
    assert out[1].master is state.master
    big = [(n, dtype) for n, dtype in buffers if n >= 300 * 7]
    assert not big, f"the compiled step allocates {big}; the layout has {engine.layout.padded_numel} elements"


@pytest.mark.slow
def test_params_outside_their_buffer_raise_before_anything_is_written():
    """Params that are not views of one flat buffer (the engine's are) cannot be cast into in
    place: a clear error, and master and moments keep every bit."""
    p0 = odd_params()
    engine = engine_for(torch.float16)
    params, state, ss = engine.init(p0)
    grads = optree.tree_map(lambda x: (x * 64).half(), grads_like(p0, 0))
    step = torch.compile(engine.step, fullgraph=True)
    own = optree.tree_map(lambda x: x.clone(), params)  # each leaf its own memory
    before = optree.tree_map(lambda x: x.clone(), state)
    with pytest.raises(ValueError, match="params are not views of one flat buffer"):
        step(own, grads, state, ss)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(before)))
    step(params, grads, state, ss)  # the engine's params still step
    assert not torch.equal(state.master, before.master)


@pytest.mark.slow
def test_leaf_by_leaf_takes_accumulated_grads():
    """An ``Accumulated`` FP32 sum is one piece: each leaf's update reads its slice of it."""
    p0 = odd_params()
    out = []
    for compiled in (False, True):
        engine = engine_for(torch.float16)
        params, state, ss = engine.init(p0)
        seq = grads_seq(p0, torch.float16, 2.0**10, n=2, bad_step=None)
        acc = engine.accumulate(engine.accumulate(None, seq[0]), seq[1])
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        out.append(step(params, acc, state, ss)[:2])
    for a, b in zip(optree.tree_leaves(out[1]), optree.tree_leaves(out[0])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_transform_with_blocks_keeps_the_update_in_the_steps_graph():
    """8-bit moments keep one scale per block of elements, across leaves: the update stays inside
    the step's graph."""
    p0 = odd_params()
    grads = optree.tree_map(lambda x: x.half(), grads_like(p0, 0))
    tx = transforms.adamw(lr=1e-2, mu_dtype=torch.int8, nu_dtype=torch.int8)
    engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=None, donate=True)
    params, state, ss = engine.init(p0)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(engine.step, fullgraph=True)(params, grads, state, ss)
    assert counters["stats"]["unique_graphs"] == 1 and engine._kernels.leaves is None


@pytest.mark.slow
def test_small_leaves_or_a_small_model_keep_the_update_in_the_steps_graph(monkeypatch):
    """Leaves below ``MIN_MEAN_NUMEL`` elements on average, or fewer than ``MIN_NUMEL`` elements
    in all: the host time per leaf would cost more than the step graph's concatenation, so the
    update stays in the step's graph; a model that reaches both runs leaf by leaf (as every other
    test of this file does)."""
    p0 = odd_params()  # 55 elements in 4 leaves
    for mean_numel, numel, leaf_by_leaf in ((14, 0, False), (13, 0, True), (0, 56, False), (0, 55, True)):
        monkeypatch.setattr(fzero.cpu.leafwise, "MIN_MEAN_NUMEL", mean_numel)
        monkeypatch.setattr(fzero.cpu.leafwise, "MIN_NUMEL", numel)
        assert fzero.cpu.leafwise.worthwhile(55, 4) == leaf_by_leaf
    # the engine asks with the model's elements and leaves (not the padded layout's), at its first
    # compiled step, and keeps the update in the step's graph when told no
    asked = []
    monkeypatch.setattr(fzero.cpu.leafwise, "worthwhile",
                        lambda numel, leaves, native: asked.append((numel, leaves, native)) or False)
    grads = optree.tree_map(lambda x: (x * 64).half(), grads_like(p0, 0))
    engine = engine_for(torch.float16)
    params, state, ss = engine.init(p0)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(engine.step, fullgraph=True)(params, grads, state, ss)
    assert set(asked) == {(55, 4, False)} and engine._kernels.leaves is None
    assert counters["stats"]["unique_graphs"] == 1


def test_shared_scalars_merges_identical_pure_nodes_only():
    """The post-grad pass keeps one of two identical pure computations, and every mutation,
    every random draw and every result that an op writes into."""
    def f(x, y):
        a = torch.ops.aten.add.Tensor(x, 1)
        b = torch.ops.aten.add.Tensor(x, 1)  # the same as a
        r1, r2 = torch.ops.aten.rand_like.default(x), torch.ops.aten.rand_like.default(x)
        z1, z2 = torch.ops.aten.zeros_like.default(x), torch.ops.aten.zeros_like.default(x)
        torch.ops.aten.add_.Tensor(z1, 1)
        torch.ops.aten.copy_.default(y, a)
        torch.ops.aten.copy_.default(y, a)
        return a * b + r1 + r2 + z1 + z2

    gm = torch.fx.symbolic_trace(f)
    fzero.cpu.leafwise._SharedScalars()(gm.graph)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.add.Tensor) == 1
    assert targets.count(torch.ops.aten.rand_like.default) == 2 and targets.count(torch.ops.aten.copy_.default) == 2
    assert targets.count(torch.ops.aten.zeros_like.default) == 2
    gm.recompile()
    x, y = torch.randn(2), torch.zeros(2)
    torch.manual_seed(0)
    out = gm(x, y)
    torch.manual_seed(0)
    assert torch.equal(out, f(x, torch.zeros(2))) and torch.equal(y, x + 1)
