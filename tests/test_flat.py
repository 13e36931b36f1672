import math
from typing import NamedTuple

import optree
import pytest
import torch

import fzero
from fzero import flat, transforms
from fzero.flat import flatten, shard_of, tree_shard, unflatten
from fzero.layout import make_layout


def odd_tree(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    # dict keys deliberately unsorted: optree orders them b, c, z
    return {"z": r(7, 3), "b": [r(1), r(5)], "c": {"w": r(2, 3, 4), "s": r(())}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [None, 8])
def test_round_trip_padding_and_shards(dtype, world_size, bucket_numel):
    tree = odd_tree(dtype)
    layout = make_layout(tree, world_size, alignment=4, bucket_numel=bucket_numel)
    P = sum(x.numel() for x in optree.tree_leaves(tree))
    assert layout.numel == P == 21 + 1 + 5 + 24 + 1
    assert layout.padded_numel == world_size * layout.shard_numel
    assert layout.shard_numel % 4 == 0
    for b in layout.buckets:  # each bucket pads less than N * alignment
        assert 0 <= world_size * b.shard - b.numel < world_size * 4
    flat = flatten(tree, layout)
    assert flat.dtype == dtype and flat.shape == (layout.padded_numel,)
    back = unflatten(flat, layout)
    assert optree.tree_structure(back) == optree.tree_structure(tree)
    for a, b in zip(optree.tree_leaves(tree), optree.tree_leaves(back)):
        assert a.shape == b.shape and torch.equal(a, b)
    # padding is zero; leaves cover the rest exactly once
    covered = torch.zeros(layout.padded_numel, dtype=torch.int32)
    for o, s in zip(layout.offsets, layout.shapes):
        covered[o : o + math.prod(s)] += 1
    assert covered.sum() == P and covered.max() == 1
    assert torch.all(flat[covered == 0] == 0)
    # shards partition the buffer; tree_shard builds the same shard without the buffer
    owned = torch.zeros(layout.padded_numel, dtype=torch.int32)
    for r in range(world_size):
        for a, b in layout.shard_ranges(r):
            owned[a:b] += 1
        assert torch.equal(tree_shard(tree, layout, r, dtype=torch.float32), shard_of(flat, layout, r).float())
    assert torch.all(owned == 1)


def test_leaf_order_is_optree_sorted_and_views_write_through():
    tree = odd_tree()
    layout = make_layout(tree, 2, alignment=4)
    assert layout.paths == ("b/0", "b/1", "c/s", "c/w", "z")
    flat = flatten(tree, layout)
    views = unflatten(flat, layout)
    views["z"].fill_(7.0)
    assert torch.all(flat[layout.offsets[4] : layout.offsets[4] + 21] == 7.0)
    assert views["c"]["w"].data_ptr() == flat[layout.offsets[3] :].data_ptr()


def test_flatten_casts_and_rejects_wrong_buffer():
    tree = odd_tree(torch.float16)
    layout = make_layout(tree, 3)
    flat = flatten(tree, layout, dtype=torch.float32)
    assert flat.dtype == torch.float32
    assert torch.equal(flat[: 21 + 7].half(), flatten(tree, layout)[: 21 + 7])
    with pytest.raises(ValueError, match="layout needs"):
        unflatten(flat[:-1], layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("bucket_numel", [None, 8])
def test_flatten_into_out_overwrites_it_in_place(dtype, world_size, bucket_numel):
    layout = make_layout(odd_tree(), world_size, alignment=4, bucket_numel=bucket_numel)
    # stale values everywhere, padding included: a buffer reused from the step before
    out = torch.full((layout.padded_numel,), float("nan"), dtype=dtype)
    for seed_tree in (odd_tree(torch.float32), optree.tree_map(lambda x: 2 * x, odd_tree(torch.float32))):
        got = flatten(seed_tree, layout, out=out)
        assert got is out
        assert torch.equal(out, flatten(seed_tree, layout, dtype=dtype))  # cast while copying, padding zero
    with pytest.raises(ValueError, match=r"out has shape \(\d+,\), the layout needs"):
        flatten(odd_tree(), layout, out=out[:-1])


def test_parameter_straddles_ranks():
    tree = {"a": torch.arange(10.0)}
    layout = make_layout(tree, 4, alignment=1)
    assert layout.shard_numel == 3
    assert [tree_shard(tree, layout, r, dtype=torch.float32).tolist() for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("bucket_numel", [None, 8])
def test_owned_tiles_the_global_vector_and_agrees_with_tree_shard(world_size, bucket_numel):
    tree = odd_tree()
    tree["empty"] = torch.zeros(0, 3)  # a leaf with no elements
    layout = make_layout(tree, world_size, alignment=4, bucket_numel=bucket_numel)
    assert bucket_numel is None or len(layout.buckets) > 1
    global_vec = torch.cat([x.reshape(-1) for x in optree.tree_leaves(tree)])
    assert layout.global_offsets == tuple(int(sum(math.prod(s) for s in layout.shapes[:i])) for i in range(len(layout.shapes)))
    ranges = []
    for r in range(world_size):
        owned = layout.owned(r)
        assert owned == sorted(owned)
        assert all(a[1] < b[0] or a[2] + a[1] - a[0] != b[2] for a, b in zip(owned, owned[1:]))  # merged
        shard = tree_shard(tree, layout, r, dtype=torch.float32)
        real = torch.zeros(layout.shard_numel, dtype=torch.bool)
        for g0, g1, pos in owned:
            assert torch.equal(shard[pos : pos + g1 - g0], global_vec[g0:g1])
            real[pos : pos + g1 - g0] = True
        assert not shard[~real].any()  # the rest is padding, zero
        ranges += [(g0, g1) for g0, g1, _ in owned]
    end = 0  # the ranges of all ranks tile [0, P)
    for g0, g1 in sorted(ranges):
        assert g0 == end and g1 > g0
        end = g1
    assert end == layout.numel


def odd_loss(tree):
    """A loss that uses every leaf of ``odd_tree`` but ``b/0`` (whose grad is zero)."""
    return ((tree["z"].float().sin() * 3).sum() + (tree["b"][1].float() ** 3).sum()
            + (tree["c"]["w"].float() * tree["c"]["s"].float()).sum())


# Compiled: each dtype on the layout with the most padding (3 ranks, buckets); the others'
# offsets are the same Python ints compiled or not.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size,bucket_numel,compiled", [
    (1, None, False), (1, 8, False), (3, None, False), (3, 8, False), (3, 8, True)])
def test_grads_into_is_the_flat_grad_written_in_place(dtype, world_size, bucket_numel, compiled):
    """Backward through ``unflatten(..., grads_into=buf)`` writes into ``buf`` what it would
    give the flat buffer as its grad, bit for bit, every element (stale values, padding and
    the unused leaf's zeros included), and leaves ``flat.grad`` unset."""
    tree = odd_tree(dtype)
    layout = make_layout(tree, world_size, alignment=4, bucket_numel=bucket_numel)
    flat = flatten(tree, layout)
    run = torch.compile if compiled else (lambda f: f)
    plain = run(lambda f, like: odd_loss(unflatten(f, layout, like=like)))
    into = run(lambda f, buf, like: odd_loss(unflatten(f, layout, like=like, grads_into=buf)))
    leaf = flat.detach().requires_grad_()
    plain(leaf, tree).backward()
    expected = leaf.grad
    buf = torch.full_like(flat, float("nan"))
    for factor in (2.0, 1.0):  # the second backward overwrites the first one's grads
        leaf = flat.detach().requires_grad_()
        (into(leaf, buf, tree) * factor).backward()
    assert leaf.grad is None
    assert torch.equal(buf, expected)
    b0 = layout.offsets[0]
    assert torch.all(buf[b0 : b0 + 1] == 0)


def test_compiled_grads_into_writes_no_buffer_of_the_whole_size():
    """Compiled, the leaves' grads are concatenated into ``grads_into``: the backward
    allocates nothing of the flat buffer's size (without it, its grad is a new buffer)."""
    from helpers import compiled_buffers

    tree = odd_tree()
    layout = make_layout(tree, 2, alignment=4)
    flat = flatten(tree, layout)
    buf = torch.zeros_like(flat)
    step = lambda f, g: torch.compile(lambda f, g, like: odd_loss(unflatten(f, layout, like=like, grads_into=g)))(  # noqa: E731
        f, g, tree).backward()
    _, made = compiled_buffers(step, flat.detach().requires_grad_(), buf)
    assert (layout.padded_numel, "float32") not in made
    _, made = compiled_buffers(lambda f: torch.compile(lambda f, like: odd_loss(unflatten(f, layout, like=like)))(
        f, tree).backward(), flat.detach().requires_grad_())
    assert (layout.padded_numel, "float32") in made  # the check sees the buffer where there is one


def test_grads_into_rejects_a_buffer_unlike_the_params():
    tree = odd_tree(torch.float16)
    layout = make_layout(tree, 2, alignment=4)
    flat = flatten(tree, layout)
    for bad, what in [(torch.zeros(layout.padded_numel - 1, dtype=torch.float16), "of shape"),
                      (torch.zeros_like(flat, dtype=torch.float32), "torch.float32"),
                      (torch.zeros_like(flat).requires_grad_(), "requiring grad")]:
        with pytest.raises(ValueError, match=what):
            unflatten(flat, layout, grads_into=bad)
    both = torch.zeros(2 * layout.padded_numel, dtype=torch.float16)
    flat, overlapping = both[: layout.padded_numel], both[1 : layout.padded_numel + 1]
    for alias in (flat[:], overlapping):
        with pytest.raises(ValueError, match="shares memory with the flat params"):
            unflatten(flat, layout, grads_into=alias)
    unflatten(flat, layout, grads_into=both[layout.padded_numel :])  # beside it in one storage: fine
    with pytest.raises(ValueError, match="under a torch.func transform"):
        torch.func.grad(lambda f: unflatten(f, layout, grads_into=torch.zeros_like(f))["z"].float().sum())(flat)


class Foreign(NamedTuple):  # a NamedTuple fzero does not own: optree walks it
    a: torch.Tensor
    b: torch.Tensor


def test_traced_walks_of_fzeros_own_nodes_equal_optrees_and_leave_others_to_it():
    """``fzero.flat.tree_leaves``/``tree_map`` walk fzero's own nodes (tuples, lists, its
    NamedTuple states, ``Quantized``) themselves when traced: the same leaves, in the same
    order, and the same mapped tree as optree's; a dict or a foreign NamedTuple goes to optree,
    and so does a mismatch of structures (optree names it)."""
    engine = fzero.zero1(transforms.chain(transforms.clip_by_global_norm(1.0),
                                          transforms.adamw(mu_dtype=torch.int8, nu_dtype=torch.int8)))
    _, state, _ = engine.init({"w": torch.randn(300), "b": torch.randn(7)})
    other = {"z": torch.ones(2), "a": [torch.zeros(1), None]}
    trees = [state, (state.master, state.tx_state), other, Foreign(torch.ones(1), torch.zeros(2))]

    def both(tree):
        return flat.tree_leaves(tree), flat.tree_map(lambda x, y: x + 2 * y, tree, tree)

    compiled = torch.compile(both, fullgraph=True)
    for tree in trees:
        leaves, mapped = compiled(tree)
        want = optree.tree_leaves(tree)
        assert len(leaves) == len(want) and all(torch.equal(a, b) for a, b in zip(leaves, want))
        assert optree.tree_structure(mapped) == optree.tree_structure(tree)
        assert all(torch.equal(a, 3 * b) for a, b in zip(optree.tree_leaves(mapped), want))
    assert type(compiled(state)[1].tx_state[1][0].mu) is transforms.quantize.Quantized
    with pytest.raises(Exception, match="(?i)structure|arity|length|mismatch"):
        torch.compile(lambda a, b: flat.tree_map(torch.add, a, b))((torch.ones(1),), (torch.ones(1), torch.ones(1)))


def test_traced_unflatten_rebuilds_optrees_tree_with_or_without_like():
    """Traced, ``unflatten`` gives optree's tree -- a dict in its key order, the same views --
    for a tree of dicts, lists, tuples and ``None`` from the layout's generated builder (with
    ``like`` or without), and for a tree with a foreign node (a NamedTuple, int keys) from
    ``like``'s structure."""
    trees = [odd_tree(), {"b": (torch.ones(2), None, [torch.zeros(3)]), "a": torch.ones(4)},
             [Foreign(torch.ones(1), torch.zeros(2))], {2: torch.ones(1), 1: torch.zeros(2)}]
    for tree in trees:
        layout = make_layout(tree, world_size=1)
        buf = flatten(tree, layout)
        want = unflatten(buf, layout)
        runs = [torch.compile(lambda f, like: unflatten(f, layout, like=like), fullgraph=True)(buf, tree)]
        if layout.tree_builder is not None:
            runs.append(torch.compile(lambda f: unflatten(f, layout), fullgraph=True)(buf))
        for got in runs:
            assert optree.tree_structure(got) == optree.tree_structure(want) == optree.tree_structure(tree)
            if isinstance(tree, dict):
                assert list(got) == list(tree)  # the key order kept
            assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))
    assert [make_layout(t, world_size=1).tree_builder is None for t in trees] == [False, False, True, True]
