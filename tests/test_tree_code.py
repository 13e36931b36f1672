"""fzero.tree_code: the generated builder of a pytree structure equals optree's unflatten (dict
insertion order kept, leaves in optree's order), declines structures it does not build, and a
layout carrying one still pickles; traced, ``unflatten`` needs no ``like`` for such trees."""
import collections
import pickle
from typing import NamedTuple

import optree
import torch

from fzero.flat import flatten, unflatten
from fzero.layout import make_layout
from fzero.tree_code import builder


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_the_builder_is_optrees_unflatten_and_declines_other_nodes():
    built = [{"z": 1, "b": [2, None, (3,)], "c": {"w": 4, "s": (5, 6)}}, [1, (2, [3])], (1,), {"k": {}}, [], 7]
    for tree in built:
        spec = optree.tree_structure(tree)
        leaves = [f"leaf{i}" for i in range(spec.num_leaves)]
        got, want = builder(spec)(leaves), spec.unflatten(leaves)
        assert got == want and repr(got) == repr(want)  # the same tree, dict keys in the same order
    for foreign in [Pair(1, 2), {1: 1, 2: 2}, collections.OrderedDict(a=1), {"a": Pair(1, 2)}]:
        assert builder(optree.tree_structure(foreign)) is None


def test_a_layout_with_its_builder_pickles_and_unflatten_traced_needs_no_like():
    tree = {"z": torch.randn(3, 2), "b": [torch.randn(4), None], "c": {"w": torch.randn(1)}}
    layout = make_layout(tree, world_size=2)
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout and again.tree_builder is not None
    buf = flatten(tree, layout)
    got = torch.compile(lambda f: unflatten(f, layout), fullgraph=True)(buf)
    assert list(got) == list(tree) and optree.tree_structure(got) == optree.tree_structure(tree)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(tree)))
