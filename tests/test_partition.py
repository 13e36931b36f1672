"""transforms.partition: each group of leaves by its own transform, state for its leaves only."""
import optree
import pytest
import torch

import fzero
from fzero import transforms
from helpers import grads_like, run_tx, torch_adamw


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(11, 8, generator=g),
            "blocks": [{"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g),
                        "w2": torch.randn(16, 8, generator=g)}],
            "ln": torch.randn(8, generator=g)}


def hidden(p):
    """nanoGPT-speedrun style: Muon for the blocks' matrices, AdamW for the rest."""
    return {"embed": "adamw", "blocks": [{"w": "muon", "b": "adamw", "w2": "muon"}], "ln": "adamw"}


def by_ndim(p):
    return optree.tree_map(lambda x: "sgd" if x.ndim == 2 else "adamw", p)


def only(tree, keep):
    """``tree`` with the leaves for which ``keep(path)`` is false replaced by None."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return spec.unflatten([x if keep(p) else None for p, x in zip(paths, leaves)])


@pytest.mark.parametrize("labels", [by_ndim, by_ndim(model())], ids=["callable", "pytree"])
def test_each_group_is_updated_as_its_transform_alone_would(labels):
    params = model()
    seq = [grads_like(params, i) for i in range(5)]
    adamw, sgd = transforms.adamw(lr=1e-2, weight_decay=0.1), transforms.sgd(lr=0.1, momentum=0.9)
    got, state = run_tx(transforms.partition({"adamw": adamw, "sgd": sgd}, labels), params, seq)
    two_d = lambda path: params_at(params, path).ndim == 2
    want_sgd, _ = run_tx(sgd, only(params, two_d), [only(g, two_d) for g in seq])
    want_adamw, _ = run_tx(adamw, only(params, lambda p: not two_d(p)), [only(g, lambda p: not two_d(p)) for g in seq])
    paths, leaves, _ = optree.tree_flatten_with_path(got)
    want = dict(zip(optree.tree_paths(want_sgd), optree.tree_leaves(want_sgd)))
    want.update(zip(optree.tree_paths(want_adamw), optree.tree_leaves(want_adamw)))
    assert len(want) == len(leaves)
    for path, leaf in zip(paths, leaves):
        assert torch.equal(leaf, want[path]), path
    # each group's state holds its own leaves only: AdamW's moments for the 1-D leaves
    mu = state.inner_states["adamw"][0].mu
    assert [tuple(x.shape) for x in optree.tree_leaves(mu)] == [(16,), (8,)]
    # and SGD's momentum buffers for the three matrices (besides its 0-d hyperparameters)
    assert sorted(tuple(x.shape) for x in optree.tree_leaves(state.inner_states["sgd"]) if x.ndim) == [
        (8, 16), (11, 8), (16, 8)]


def params_at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_muon_for_hidden_matrices_and_adamw_for_the_rest_matches_torch():
    """The speedrun recipe against torch.optim.Muon + torch.optim.AdamW on the same leaves."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is torch >= 2.9")
    params = model()
    seq = [grads_like(params, i) for i in range(20)]
    tx = transforms.partition({"muon": transforms.muon(lr=0.02, weight_decay=0.01),
                               "adamw": transforms.adamw(lr=3e-3, weight_decay=0.01)}, hidden)
    got, _ = run_tx(tx, params, seq)
    is_muon = lambda path: path[0] == "blocks" and path[-1] in ("w", "w2")
    leaves_of = lambda tree, keep: [x for p, x in zip(optree.tree_paths(tree), optree.tree_leaves(tree)) if keep(p)]
    ps = {p: torch.nn.Parameter(x.clone()) for p, x in zip(optree.tree_paths(params), optree.tree_leaves(params))}
    opt_m = torch.optim.Muon([v for k, v in ps.items() if is_muon(k)], lr=0.02, weight_decay=0.01)
    opt_a = torch.optim.AdamW([v for k, v in ps.items() if not is_muon(k)], lr=3e-3, weight_decay=0.01)
    for grads in seq:
        for k, g in zip(optree.tree_paths(grads), optree.tree_leaves(grads)):
            ps[k].grad = g.clone()
        opt_m.step()
        opt_a.step()
    for k, x in zip(optree.tree_paths(got), optree.tree_leaves(got)):
        # Muon: see test_muon (one FP32 rounding per step); AdamW: as test_transforms
        torch.testing.assert_close(x, ps[k].detach(), rtol=4e-6, atol=1e-6)
    assert leaves_of(got, is_muon)  # both groups present


def test_hyperparams_are_named_by_label_and_set_hyperparams_reaches_every_group():
    tx = transforms.partition({"a": transforms.adamw(lr=1e-3), "s": transforms.sgd(lr=transforms.linear_warmup(0.0, 0.1, 4))},
                              by_ndim_as({"a", "s"}))
    state = tx.init(model())
    hp = tx.hyperparams(state)
    assert float(hp["a/lr"]) == 1e-3 and float(hp["s/lr"]) == 0.0
    state = transforms.set_hyperparams(state, weight_decay=0.2)
    assert all(float(v) == 0.2 for k, v in transforms.iter_hyperparams(state) if k == "weight_decay")


def by_ndim_as(names):
    two, one = sorted(names, reverse=True)
    return lambda p: optree.tree_map(lambda x: two if x.ndim == 2 else one, p)


def test_a_group_without_leaves_keeps_an_empty_state_and_updates_nothing():
    params = {"b": torch.ones(3)}
    tx = transforms.partition({"adamw": transforms.adamw(lr=0.1), "sgd": transforms.sgd(lr=0.1)}, {"b": "adamw"})
    got, state = run_tx(tx, params, [grads_like(params, 0)])
    assert all(x.ndim == 0 for x in optree.tree_leaves(state.inner_states["sgd"]))  # its hyperparameters only
    want = torch_adamw(params, [grads_like(params, 0)], lr=0.1)
    torch.testing.assert_close(got["b"], want["b"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_compiled_partition_matches_eager():
    params = model()
    seq = [grads_like(params, i) for i in range(3)]
    tx = transforms.partition({"adamw": transforms.adamw(lr=1e-2), "sgd": transforms.sgd(lr=0.1, momentum=0.9)}, by_ndim)
    update = torch.compile(tx.update, fullgraph=True)
    state, p = tx.init(params), params
    for grads in seq:
        u, state = update(grads, state, p)
        p = transforms.apply_updates(p, u)
    want, _ = run_tx(tx, params, seq)
    for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("labels,match", [
    ({"embed": "adamw", "blocks": [{"w": "muon", "b": "adamw", "w2": "muon"}], "ln": "lion"}, r"'ln'.*'lion'"),
    ({"embed": "adamw", "ln": "adamw"}, "structure"),
    (lambda p: optree.tree_map(lambda x: 3, p), r"'blocks/0/b' has label 3"),
])
def test_bad_labels_name_the_leaf(labels, match):
    tx = transforms.partition({"adamw": transforms.adamw(), "muon": transforms.muon()}, labels)
    with pytest.raises(ValueError, match=match):
        tx.init(model())


def test_bad_transforms_by_label():
    with pytest.raises(ValueError, match="strings"):
        transforms.partition({1: transforms.adamw()}, lambda p: p)
    with pytest.raises(ValueError, match=r"transforms_by_label\['a'\]"):
        transforms.partition({"a": torch.optim.AdamW}, lambda p: p)


def test_a_group_with_8_bit_moments_under_the_engine_is_refused_naming_it():
    # A group's compacted shard is not aligned to the 8-bit moments' blocks of 256 elements.
    tx = transforms.partition({"a": transforms.adamw(mu_dtype=torch.int8, nu_dtype=torch.int8), "b": transforms.adamw()},
                              {"w": "a", "v": "b"})
    engine = fzero.zero1(tx, param_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"transforms_by_label\['a'\] keeps state in blocks of 256"):
        engine.init({"w": torch.zeros(4, 4), "v": torch.zeros(3)})
