"""Property-based tests (hypothesis): random pytrees, world sizes, dtypes, buckets.

Bounded example counts and ``derandomize=True`` keep CI fast and reproducible. The
multi-rank property runs on simulated ranks (``zero1(simulate=(r, N))``: the real layout and
shard arithmetic of rank r, every rank holding the same grads, no processes); real gloo ranks
with *different* grads per rank run on random trees in ``test_random_trees_on_gloo_ranks``.
"""
import math

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fzero
from fzero import transforms
from distributed import run_ranks
from fzero.flat import flatten, tree_shard, unflatten
from fzero.layout import make_layout

PROFILE = settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)  # () is a 0-d leaf
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@st.composite
def pytrees(draw, dtype=None):
    """A dict/list pytree with 1-30 leaves, 0-d and 1-element leaves included."""
    n = draw(st.integers(1, 30))
    leaf_shapes = draw(st.lists(shapes, min_size=n, max_size=n))
    dtype = dtype or draw(dtypes)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    leaves = [torch.randn(s, generator=g).to(dtype) for s in leaf_shapes]
    cut = draw(st.integers(0, n))
    return {"a": leaves[:cut], "b": {f"k{i}": x for i, x in enumerate(leaves[cut:])}}


@PROFILE
@given(tree=pytrees(), world_size=st.integers(1, 4), alignment=st.sampled_from([1, 4, 64]),
       bucket_numel=st.sampled_from([None, 1, 7, 50]))
def test_flatten_unflatten_round_trip_and_shards_partition(tree, world_size, alignment, bucket_numel):
    layout = make_layout(tree, world_size, alignment=alignment, bucket_numel=bucket_numel)
    flat = flatten(tree, layout)
    back = unflatten(flat, layout)
    assert optree.tree_structure(back) == optree.tree_structure(tree)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(tree), optree.tree_leaves(back)))
    owned = torch.zeros(layout.padded_numel, dtype=torch.int64)
    for r in range(world_size):
        for a, b in layout.shard_ranges(r):
            owned[a:b] += 1
        shard = tree_shard(tree, layout, r, dtype=flat.dtype)
        assert torch.equal(shard, torch.cat([flat[a:b] for a, b in layout.shard_ranges(r)]))
    assert torch.all(owned == 1)
    assert layout.numel == sum(math.prod(s) for s in layout.shapes)
    for b in layout.buckets:
        assert b.shard % alignment == 0 and 0 <= world_size * b.shard - b.numel < world_size * alignment


@settings(PROFILE, max_examples=20)
@given(tree=pytrees(dtype=torch.float32), world_size=st.integers(2, 4), bucket_bytes=st.sampled_from([None, 16, 200]),
       param_dtype=dtypes)
def test_every_simulated_rank_holds_its_slice_of_the_one_rank_result(tree, world_size, bucket_bytes, param_dtype):
    g = torch.Generator().manual_seed(1)
    grads = [optree.tree_map(lambda x: torch.randn(x.shape, generator=g).to(param_dtype), tree) for _ in range(2)]
    kw = dict(param_dtype=param_dtype, loss_scale=None, bucket_bytes=bucket_bytes)

    def run(**extra):
        engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), **kw, **extra)
        params, state, ss = engine.init(tree)
        for gr in grads:
            params, state, ss, _ = engine.step(params, gr, state, ss)
        return engine, params, state

    ref_engine, _, ref_state = run()
    ref_master = fzero.flatten(fzero.unflatten(ref_state.master, ref_engine.layout), ref_engine.layout)
    for r in range(world_size):
        engine, params, state = run(simulate=(r, world_size))
        # its master shard, mapped back to leaves, equals the 1-rank master on those elements
        mine = torch.zeros(engine.layout.padded_numel)
        pos = 0
        for a, b in engine.layout.shard_ranges(r):
            mine[a:b] = state.master[pos : pos + b - a]
            pos += b - a
        sim_leaves = optree.tree_leaves(unflatten(mine, engine.layout))
        mask_leaves = optree.tree_leaves(unflatten(_owned_mask(engine.layout, r), engine.layout))
        ref_leaves = optree.tree_leaves(unflatten(ref_master, ref_engine.layout))
        for s, m, want in zip(sim_leaves, mask_leaves, ref_leaves):
            torch.testing.assert_close(s[m], want[m], rtol=1e-6, atol=1e-7)
        # and the params it gathered hold its own shard, cast to the param dtype
        own = fzero.flatten(params, engine.layout)[_owned_mask(engine.layout, r)]
        assert torch.equal(own, state.master.to(param_dtype))


def _owned_mask(layout, rank):
    m = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for a, b in layout.shard_ranges(rank):
        m[a:b] = True
    return m


def random_trees(seed, count):
    """Random pytrees drawn without hypothesis (they travel to spawned ranks as shapes)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(1, 31, (), generator=g))
        out.append([tuple(int(d) for d in torch.randint(1, 6, (int(torch.randint(0, 3, (), generator=g)),), generator=g))
                    for _ in range(n)])
    return out


def gloo_random(rank, world_size, tree_shapes):
    results = []
    for t, leaf_shapes in enumerate(tree_shapes):
        g = torch.Generator().manual_seed(t)
        tree = [torch.randn(s, generator=g) for s in leaf_shapes]
        engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None, bucket_bytes=64 if t % 2 else None)
        params, state, ss = engine.init(tree)
        gr = torch.Generator().manual_seed(1000 * t + rank)  # different grads on every rank
        for _ in range(2):
            params, state, ss, _ = engine.step(params, [torch.randn(s, generator=gr) for s in leaf_shapes], state, ss)
        results.append(torch.cat([x.reshape(-1) for x in params]))
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_random_trees_on_gloo_ranks_equal_one_process_fed_the_mean(world_size):
    tree_shapes = random_trees(world_size, 6)
    out = run_ranks(gloo_random, world_size, tree_shapes)
    for t, leaf_shapes in enumerate(tree_shapes):
        assert all(torch.equal(o[t], out[0][t]) for o in out)  # ranks bitwise identical
        g = torch.Generator().manual_seed(t)
        tree = [torch.randn(s, generator=g) for s in leaf_shapes]
        engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None)
        params, state, ss = engine.init(tree)
        grs = [torch.Generator().manual_seed(1000 * t + r) for r in range(world_size)]
        for _ in range(2):
            per_rank = [[torch.randn(s, generator=gr) for s in leaf_shapes] for gr in grs]
            mean = [torch.stack(xs).double().mean(0).float() for xs in zip(*per_rank)]
            params, state, ss, _ = engine.step(params, mean, state, ss)
        torch.testing.assert_close(out[0][t], torch.cat([x.reshape(-1) for x in params]), rtol=1e-5, atol=1e-6)
