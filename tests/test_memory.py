"""fzero.memory: which memory tensors occupy, read from their storages and offsets."""

import optree
import pytest
import torch

from fzero.flat import flat_buffer, flatten, leaf_views, unflatten
from fzero.layout import make_layout
from fzero.memory import check_in_buffer, marked_buffer, shared_memory, viewed_buffer


def params():
    return {"w": torch.arange(12.0).reshape(4, 3), "b": torch.arange(3.0), "s": torch.tensor(7.0)}


def test_shared_memory_names_two_overlapping_tensors_and_no_others():
    base = torch.zeros(10)
    assert shared_memory([torch.zeros(3), base[:4], torch.zeros(2), base[3:6]]) == (1, 3)
    assert shared_memory([base[:3], base[3:6], torch.zeros(3)]) is None  # adjacent, not overlapping
    x = torch.ones(2)
    assert shared_memory([x, torch.zeros(0), x]) == (0, 2)  # one tensor twice; empty ones occupy nothing


def test_viewed_buffer_is_the_flat_buffer_whose_views_the_leaves_are():
    layout = make_layout(params(), 2, alignment=4)
    flat = flatten(params(), layout)
    leaves = leaf_views(flat, layout)
    got = viewed_buffer(leaves, layout.offsets, layout.padded_numel)
    assert got.data_ptr() == flat.data_ptr() and got.shape == (layout.padded_numel,)
    # leaves that share the buffer with no view link (a compiled step's output): the same memory
    unlinked = [flat.new_empty(0).set_(flat.untyped_storage(), o, x.shape) for x, o in zip(leaves, layout.offsets)]
    assert all(x._base is None for x in unlinked)
    again = viewed_buffer(unlinked, layout.offsets, layout.padded_numel)
    assert again.data_ptr() == flat.data_ptr() and torch.equal(again, flat)
    assert flat_buffer(unlinked, layout).data_ptr() == flat.data_ptr()


def test_viewed_buffer_is_none_where_the_leaves_are_not_views_of_one_buffer():
    layout = make_layout(params(), 2, alignment=4)
    flat = flatten(params(), layout)
    leaves = leaf_views(flat, layout)
    copies = [x.clone() for x in leaves]
    assert viewed_buffer(copies, layout.offsets, layout.padded_numel) is None  # each its own memory
    moved = leaves[:-1] + [flat[: leaves[-1].numel()].view(leaves[-1].shape)]  # one leaf off its offset
    assert viewed_buffer(moved, layout.offsets, layout.padded_numel) is None
    # the views of a buffer one element short of the layout's: the buffer would run past their storage
    short = leaf_views(torch.cat([flat, flat[:3]])[3:], layout)  # storage: padded_numel + 3, leaves from 3
    assert viewed_buffer(short, layout.offsets, layout.padded_numel + 1) is None
    assert viewed_buffer(short, layout.offsets, layout.padded_numel) is not None
    with pytest.raises(ValueError, match="not views of one flat buffer of this engine's layout"):
        flat_buffer(copies, layout)


def test_check_in_buffer_names_the_first_leaf_off_its_offset():
    layout = make_layout(params(), 1, alignment=4)
    flat = flatten(params(), layout)
    leaves = leaf_views(flat, layout)
    check_in_buffer(flat, leaves, list(layout.offsets))  # in place: no error
    swapped = [leaves[0], leaves[0].new_zeros(leaves[1].shape), leaves[2]]
    with pytest.raises(ValueError, match="params leaf 1 is not at its offset"):
        check_in_buffer(flat, swapped, list(layout.offsets))
    with pytest.raises(ValueError, match=f"params leaf 0 is not at its offset {layout.offsets[1]} "):  # starts one late
        check_in_buffer(flat[1:], leaves[1:2], [layout.offsets[1]])


def test_grads_into_sharing_the_params_memory_is_refused():
    layout = make_layout(params(), 1, alignment=4)
    flat = flatten(params(), layout)
    with pytest.raises(ValueError, match="grads_into shares memory with the flat params"):
        unflatten(flat, layout, grads_into=flat.view_as(flat))


def test_marked_buffer_is_the_object_viewed_buffer_finds_again():
    """fzero.lineage marks the object ``marked_buffer`` gives for params an engine returned, and
    reads the mark from what the params' door finds (``viewed_buffer``): the same object."""
    layout = make_layout(params(), 1)
    flat = flatten(params(), layout)
    tree = unflatten(flat, layout)
    assert marked_buffer(flat) is flat and marked_buffer(tree) is flat
    assert viewed_buffer(optree.tree_leaves(tree), layout.offsets, layout.padded_numel) is flat
    assert marked_buffer({"w": torch.zeros(2)}) is None  # a leaf that views nothing
