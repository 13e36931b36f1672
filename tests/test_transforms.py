import re
from typing import Any, NamedTuple

import optree
import pytest
import torch

from fzero import transforms
from fzero.transforms.hyperparams import register_holder
from helpers import run_tx


def tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "one": torch.randn(1, generator=g)}


def torch_adamw(params, grads_seq, **kw):
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), **kw)
    for grads in grads_seq:
        for k in ps:
            ps[k].grad = grads[k].clone()
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def grads_seq(n, seed=1):
    return [tree(seed + i) for i in range(n)]


@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)])
def test_adamw_matches_torch_on_a_pytree(kw):
    params, seq = tree(), grads_seq(12)
    tx = transforms.adamw(**kw)
    state = tx.init(params)
    p = params
    for grads in seq:
        updates, state = tx.update(grads, state, p)
        p = transforms.apply_updates(p, updates)
    ref = torch_adamw(params, seq, **kw)
    for k in ref:
        torch.testing.assert_close(p[k], ref[k], rtol=1e-5, atol=1e-7)


def test_adam_matches_float64_closed_form():
    g = torch.tensor([0.3, -2.0, 1e-4], dtype=torch.float64)
    b1, b2, eps = 0.9, 0.999, 1e-8
    tx = transforms.scale_by_adam(b1, b2, eps)
    s = tx.init(g.float())
    m = v = torch.zeros_like(g)
    for t in range(1, 6):
        u, s = tx.update(g.float() * t, s)
        m = b1 * m + (1 - b1) * g * t
        v = b2 * v + (1 - b2) * (g * t) ** 2
        want = (m / (1 - b1**t)) / (v.sqrt() / (1 - b2**t) ** 0.5 + eps)
        torch.testing.assert_close(u.double(), want, rtol=1e-6, atol=0)
    assert s.count.item() == 5 and s.mu.dtype == torch.float32


def test_hyperparams_are_tensors_and_changing_lr_takes_effect():
    tx = transforms.adamw(lr=1e-2, weight_decay=0.0)
    params = tree()
    state = tx.init(params)
    hp = transforms.get_hyperparams(state)
    assert set(hp) == {"b1", "b2", "eps", "weight_decay", "lr"}
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == torch.float64 for v in hp.values())
    u1, _ = tx.update(tree(1), state, params)
    state2 = transforms.set_hyperparams(state, lr=2e-2)
    assert optree.tree_structure(state2) == optree.tree_structure(state)
    u2, _ = tx.update(tree(1), state2, params)
    torch.testing.assert_close(u2["w"], 2 * u1["w"])
    with pytest.raises(KeyError, match="momentum"):
        transforms.set_hyperparams(state, momentum=0.9)


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)])
def test_sgd_matches_torch(kw):
    params, seq = tree(), grads_seq(10)
    p, _ = run_tx(transforms.sgd(**kw), params, seq)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.SGD(list(ps.values()), **kw)
    for grads in seq:
        for k in ps:
            ps[k].grad = grads[k].clone()
        opt.step()
    for k in ps:
        torch.testing.assert_close(p[k], ps[k].detach(), rtol=1e-5, atol=1e-6)


def test_weight_decay_mask_pytree_and_callable():
    params, seq = tree(), grads_seq(5)
    no_decay = lambda p: {k: v.ndim > 1 for k, v in p.items()}  # decay only matrices
    p_mask, _ = run_tx(transforms.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=no_decay), params, seq)
    p_tree, _ = run_tx(transforms.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=no_decay(params)), params, seq)
    p_wd, _ = run_tx(transforms.adamw(lr=1e-2, weight_decay=0.5), params, seq)
    p_0, _ = run_tx(transforms.adamw(lr=1e-2, weight_decay=0.0), params, seq)
    for k in params:
        torch.testing.assert_close(p_mask[k], p_tree[k], rtol=0, atol=0)
        torch.testing.assert_close(p_mask[k], (p_wd if params[k].ndim > 1 else p_0)[k], rtol=0, atol=0)
    assert not torch.equal(p_wd["b"], p_0["b"])


def test_clip_by_global_norm_matches_torch_clip_grad_norm():
    grads = {k: v * 10 for k, v in tree(3).items()}
    clip = transforms.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    ps = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in grads.items()}
    for k in ps:
        ps[k].grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(list(ps.values()), 1.0)
    for k in ps:
        torch.testing.assert_close(clipped[k], ps[k].grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(transforms.global_norm(clipped), torch.tensor(1.0), rtol=1e-5, atol=0)
    small = {k: v * 1e-3 for k, v in grads.items()}
    same, _ = clip.update(small, clip.init(small))
    assert all(torch.equal(same[k], small[k]) for k in small)


def test_mu_nu_dtypes():
    params = tree()
    state = transforms.scale_by_adam(mu_dtype=torch.bfloat16, nu_dtype=torch.float32).init(params)
    assert state.mu["w"].dtype == torch.bfloat16 and state.nu["w"].dtype == torch.float32
    u, state = transforms.scale_by_adam(mu_dtype=torch.bfloat16).update(tree(1), state)
    assert state.mu["w"].dtype == torch.bfloat16 and u["w"].dtype == torch.float32


def test_identity_and_chain():
    g = tree(2)
    u, s = transforms.chain(transforms.identity(), transforms.identity()).update(g, transforms.identity().init(g))
    assert all(torch.equal(u[k], g[k]) for k in g)


INF, NAN = float("inf"), float("nan")
T = transforms


@pytest.mark.parametrize(
    "make, where, name, value",
    [
        (lambda: T.adamw(lr=-1e-3), "adamw", "lr", "-0.001"),
        (lambda: T.adamw(lr=INF), "adamw", "lr", "inf"),
        (lambda: T.adamw(lr=NAN), "adamw", "lr", "nan"),
        (lambda: T.adamw(lr=torch.tensor(-0.5)), "adamw", "lr", "-0.5"),
        (lambda: T.adamw(eps=-1e-8), "adamw", "eps", "-1e-08"),
        (lambda: T.adamw(eps=INF), "adamw", "eps", "inf"),
        (lambda: T.adamw(betas=(1.0, 0.999)), "adamw", "betas[0]", "1.0"),
        (lambda: T.adamw(betas=(-0.1, 0.999)), "adamw", "betas[0]", "-0.1"),
        (lambda: T.adamw(betas=(0.9, 1.0)), "adamw", "betas[1]", "1.0"),
        (lambda: T.adamw(betas=(0.9, NAN)), "adamw", "betas[1]", "nan"),
        (lambda: T.adamw(weight_decay=-0.01), "adamw", "weight_decay", "-0.01"),
        (lambda: T.adamw(weight_decay=NAN), "adamw", "weight_decay", "nan"),
        (lambda: T.scale_by_adam(b1=1.5), "scale_by_adam", "b1", "1.5"),
        (lambda: T.scale_by_adam(b2=-0.5), "scale_by_adam", "b2", "-0.5"),
        (lambda: T.scale_by_adam(eps=-1.0), "scale_by_adam", "eps", "-1.0"),
        (lambda: T.sgd(lr=-0.1), "sgd", "lr", "-0.1"),
        (lambda: T.sgd(lr=0.1, momentum=-0.9), "sgd", "momentum", "-0.9"),
        (lambda: T.sgd(lr=0.1, momentum=INF), "sgd", "momentum", "inf"),
        (lambda: T.sgd(lr=0.1, weight_decay=-1e-4), "sgd", "weight_decay", "-0.0001"),
        (lambda: T.sgd(lr=0.1, nesterov=True), "sgd", "momentum", "0.0"),
        (lambda: T.trace(-0.5), "trace", "momentum", "-0.5"),
        (lambda: T.trace(NAN), "trace", "momentum", "nan"),
        (lambda: T.add_decayed_weights(-0.1), "add_decayed_weights", "weight_decay", "-0.1"),
        (lambda: T.add_decayed_weights(-0.1, mask=lambda p: p), "add_decayed_weights", "weight_decay", "-0.1"),
        (lambda: T.scale_by_learning_rate(-1.0), "scale_by_learning_rate", "lr", "-1.0"),
        (lambda: T.scale_by_learning_rate(INF), "scale_by_learning_rate", "lr", "inf"),
        (lambda: T.clip_by_global_norm(0.0), "clip_by_global_norm", "max_norm", "0.0"),
        (lambda: T.clip_by_global_norm(-1.0), "clip_by_global_norm", "max_norm", "-1.0"),
        (lambda: T.clip_by_global_norm(INF), "clip_by_global_norm", "max_norm", "inf"),
        (lambda: T.clip_by_global_norm(NAN), "clip_by_global_norm", "max_norm", "nan"),
    ],
)
def test_invalid_hyperparameters_raise_at_construction(make, where, name, value):
    # naming the factory, the argument, what it must be and its value (all of it: "got 1.0" is not "got 1.05")
    with pytest.raises(ValueError, match=re.escape(f"{where}: {name} must be ") + ".+" + re.escape(f", got {value}") + "$"):
        make()


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9])
def test_adamw_betas_must_be_a_pair(betas):
    with pytest.raises(ValueError, match=r"adamw: betas must be a pair"):
        T.adamw(betas=betas)


def test_boundary_hyperparameters_are_accepted():
    params = tree()
    for tx in (
        T.adamw(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0),
        T.adamw(lr=torch.tensor(1e-3)),
        T.adamw(lr=T.constant(1e-3)),
        T.sgd(lr=0.0, momentum=0.0),
        T.sgd(lr=0.1, momentum=0.5, nesterov=True),
        T.clip_by_global_norm(1e-6),
        T.scale_by_learning_rate(0.0),
    ):
        updates, _ = tx.update(tree(1), tx.init(params), params)
        assert all(torch.isfinite(u).all() for u in optree.tree_leaves(updates))


def all_hyperparams_state():
    tx = T.chain(T.clip_by_global_norm(1.0), T.trace(0.9), T.adamw(lr=1e-2))
    return tx.init(tree())


@pytest.mark.parametrize(
    "name, value, shown",
    [
        ("lr", -1e-3, "-0.001"),
        ("lr", INF, "inf"),
        ("lr", NAN, "nan"),
        ("lr", torch.tensor(-2.0), "-2.0"),
        ("b1", 1.0, "1.0"),
        ("b1", -0.1, "-0.1"),
        ("b2", 1.0, "1.0"),
        ("b2", torch.tensor(1.5, dtype=torch.float64), "1.5"),
        ("eps", -1e-8, "-1e-08"),
        ("weight_decay", -0.1, "-0.1"),
        ("momentum", -0.9, "-0.9"),
        ("max_norm", 0.0, "0.0"),
        ("max_norm", -1.0, "-1.0"),
        ("max_norm", INF, "inf"),
    ],
)
def test_set_hyperparams_validates_known_names(name, value, shown):
    state = all_hyperparams_state()
    with pytest.raises(ValueError, match=re.escape(f"set_hyperparams: {name} must be ") + ".+" + re.escape(f", got {shown}") + "$"):
        T.set_hyperparams(state, **{name: value})


def test_set_hyperparams_accepts_boundaries_and_tensors():
    state = all_hyperparams_state()
    new = T.set_hyperparams(state, lr=0.0, b1=0.0, b2=0.0, eps=0.0, weight_decay=0.0, momentum=0.0, max_norm=1e-6)
    hp = T.get_hyperparams(new)
    assert hp["lr"].item() == 0.0 and hp["max_norm"].item() == 1e-6
    new = T.set_hyperparams(state, lr=torch.tensor(3e-4), b2=torch.tensor(0.95, dtype=torch.float64))
    hp = T.get_hyperparams(new)
    assert hp["lr"].dtype == torch.float64 and hp["b2"].item() == 0.95
    assert optree.tree_structure(new) == optree.tree_structure(state)



def test_set_hyperparams_on_a_scheduled_lr_says_it_follows_the_schedule():
    """``set_hyperparams(lr=...)`` on a scheduled lr raised a bare ``KeyError`` ("no
    hyperparameter(s) ['lr']"). It says that the lr follows a schedule and what to do instead;
    the stored hyperparameters still change, and the state keeps its schedule."""
    sched = T.linear_warmup(0.0, 1e-2, 4)
    tx = T.adamw(lr=sched)
    state = tx.init(tree())
    want = (r"set_hyperparams: lr follows a schedule \(the state stores its count only, in ScaleByScheduleState\), "
            r"which set_hyperparams cannot change: build the transform with a new schedule, or with a constant lr to "
            r"set it between steps")
    for values in (dict(lr=1e-3), dict(lr=1e-3, b1=0.5)):
        with pytest.raises(ValueError, match="^" + want + "$"):
            T.set_hyperparams(state, **values)
    with pytest.raises(ValueError, match="lr follows a schedule"):
        T.set_hyperparams(T.sgd(lr=lambda count: sched(count)).init(tree()), lr=1e-3)
    new = T.set_hyperparams(state, b1=0.5)
    hp = T.get_hyperparams(new, tx)
    assert hp["b1"].item() == 0.5 and torch.equal(hp["lr"], sched(torch.zeros((), dtype=torch.int32)))
    assert optree.tree_structure(new) == optree.tree_structure(state)
    with pytest.raises(KeyError, match=re.escape("no hyperparameter(s) ['momentum'] in state; have ['b1', 'b2', 'eps', 'weight_decay']")):
        T.set_hyperparams(state, momentum=0.9)


class Holder(NamedTuple):
    """A caller's state that holds a transform state beside its own (as fzero's ``ZeroState``
    holds its master): readable while ``own`` is not negative."""

    own: torch.Tensor
    tx_state: Any


def holder_transform_state(holder: Holder, where: str):
    if holder.own < 0:
        raise ValueError(f"{where}: this holder may not be read")
    return holder.tx_state


def test_the_hyperparameter_functions_read_a_registered_holder_through_its_function():
    """``get_hyperparams(holder, tx)`` of a chain gave the stored values but no scheduled ``lr``
    (the chain's members were paired with the holder's fields): a registered holder is read as
    its transform state by ``get_hyperparams`` and ``iter_hyperparams``; ``set_hyperparams``
    returns a holder; a holder its function refuses raises in all three, naming the function."""
    register_holder(Holder, holder_transform_state)
    sched = T.linear_warmup(1e-3, 1e-2, 4)
    tx = T.chain(T.clip_by_global_norm(1.0), T.adamw(lr=sched))
    inner = tx.init(tree())
    holder = Holder(torch.tensor(1.0), inner)
    shown = T.get_hyperparams(holder, tx)
    assert set(shown) == {"max_norm", "b1", "b2", "eps", "weight_decay", "lr"}
    assert torch.equal(shown["lr"], sched(torch.zeros((), dtype=torch.int32)))
    assert [n for n, _ in T.iter_hyperparams(holder)] == [n for n, _ in T.iter_hyperparams(inner)]
    new = T.set_hyperparams(holder, b1=0.5)
    assert type(new) is Holder and new.own is holder.own and T.get_hyperparams(new, tx)["b1"].item() == 0.5
    gone = Holder(torch.tensor(-1.0), inner)
    for name, call in (("get_hyperparams", lambda: T.get_hyperparams(gone, tx)),
                       ("iter_hyperparams", lambda: list(T.iter_hyperparams(gone))),
                       ("set_hyperparams", lambda: T.set_hyperparams(gone, b1=0.5))):
        with pytest.raises(ValueError, match=f"^{name}: this holder may not be read$"):
            call()


# ---------------------------------------------------------------- ShardContext: a flat tensor standing for a pytree
def flat_context(params, lo, hi):
    """``(shard, context)``: elements ``[lo, hi)`` of the concatenated leaves of ``params`` and
    the ``ShardContext`` that lays a per-leaf pytree out like that shard (as fzero's engine does
    for one rank)."""
    leaves, spec = optree.tree_flatten(params)

    def to_shard(per_leaf):
        masks = spec.flatten_up_to(per_leaf)
        return torch.cat([torch.as_tensor(m, dtype=torch.bool).expand(p.shape).reshape(-1) for m, p in zip(masks, leaves)])[lo:hi]

    return flatten_tree(params)[lo:hi], T.ShardContext(optree.tree_map(torch.empty_like, params), to_shard)


def flatten_tree(tree):
    return torch.cat([x.reshape(-1) for x in optree.tree_leaves(tree)])


def is_masked(x):
    return isinstance(x, T.MaskedState)


def matrices(p):
    return optree.tree_map(lambda x: x.ndim >= 2, p)


@pytest.mark.parametrize("as_callable", [True, False])
def test_masked_on_a_flat_shard_with_context_equals_masked_on_the_pytree(as_callable):
    params, seq = tree(), grads_seq(4)
    mask = matrices if as_callable else matrices(params)  # the mask always refers to the pytree

    def make():
        return T.chain(T.clip_by_global_norm(1.0), T.adamw(lr=1e-2, weight_decay=0.5, weight_decay_mask=mask))

    want, _ = run_tx(make(), params, seq)
    shards = []  # leaves in optree's order b (3), one (1), w (12): the first shard ends inside w
    for lo, hi in ((0, 6), (6, 16)):
        shard, context = flat_context(params, lo, hi)
        tx = make()
        state = tx.init(shard, context=context)
        (mask_state,) = [s for s in optree.tree_leaves(state, is_leaf=is_masked) if is_masked(s)]
        assert mask_state.mask.dtype == torch.bool and mask_state.mask.shape == shard.shape
        for grads in seq:
            updates, state = tx.update(flatten_tree(grads)[lo:hi], state, shard, grad_norm=T.global_norm(grads))
            shard = T.apply_updates(shard, updates)
        shards.append(shard)
    torch.testing.assert_close(torch.cat(shards), flatten_tree(want), rtol=0, atol=0)


def test_masked_without_context_keeps_the_pytree_mask():
    """Plain use is unchanged: the state holds the mask pytree itself (or the callable's result
    on the params), and updates pass through where it is False."""
    params, zeros = tree(), optree.tree_map(torch.zeros_like, tree())
    broadcast = {"w": torch.tensor(True), "b": torch.ones(3, dtype=torch.bool), "one": False}  # bool tensors broadcast
    for mask, want in ((matrices, matrices(params)), (matrices(params), matrices(params)), (broadcast, broadcast)):
        tx = T.masked(T.add_decayed_weights(1.0), mask)
        for state in (tx.init(params), tx.init(params, context=None)):
            assert state.mask is mask if not callable(mask) else state.mask == want
            updates, _ = tx.update(zeros, state, params)
            for k in params:
                assert torch.equal(updates[k], params[k] if bool(torch.as_tensor(want[k]).all()) else zeros[k])


def test_resolve_per_leaf():
    params = tree()
    assert T.resolve_per_leaf(matrices, params) == {"w": True, "b": False, "one": False}
    fixed = {"w": False, "b": True, "one": True}
    assert T.resolve_per_leaf(fixed, params) is fixed
    shard, context = flat_context(params, 2, 6)  # b[2], one, w[0:2]
    for setting in (matrices, matrices(params)):
        got = T.resolve_per_leaf(setting, shard, context)
        assert torch.equal(got, torch.tensor([False, False, True, True]))
    # the callable sees context.tree (the pytree), never the flat tensor
    seen = []
    T.resolve_per_leaf(lambda p: seen.append(p) or fixed, shard, context)
    assert seen == [context.tree]


def test_every_init_takes_context_and_chain_passes_it_on():
    params = tree()
    shard, context = flat_context(params, 0, 16)
    seen = []

    def spy():
        def init(params, *, context=None):
            seen.append(context)
            return ()

        return T.GradientTransformation(init, T.identity().update)

    txs = [
        T.identity(), T.clip_by_global_norm(1.0), T.trace(0.9), T.scale_by_adam(),
        T.scale_by_learning_rate(0.1), T.scale_by_learning_rate(T.constant(0.1)),
        T.add_decayed_weights(0.1), T.add_decayed_weights(0.1, mask=matrices), T.adamw(weight_decay_mask=matrices),
        T.sgd(lr=0.1, momentum=0.9, weight_decay=0.1, weight_decay_mask=matrices),
        T.chain(spy(), T.masked(spy(), matrices)),
    ]
    for tx in txs:
        tx.init(shard, context=context)
        tx.init(params)
        with pytest.raises(TypeError):
            tx.init(shard, tree=params, to_flat=context.to_shard)  # the old keywords are gone
    assert seen == [context, context, None, None]


def test_scalar_and_hyperparam_are_public():
    x = torch.tensor(0.999, dtype=torch.float64)
    assert T.scalar(x).dtype == torch.float32 and T.scalar(x).item() == x.float().item()
    hp = T.hyperparam(0.999, tree())
    assert hp.dtype == torch.float64 and hp.ndim == 0 and hp.item() == 0.999
    assert {"ShardContext", "resolve_per_leaf", "scalar", "hyperparam"} <= set(T.__all__)


def test_chain_is_fused_only_when_its_last_member_updates_the_params():
    clip, adamw = T.clip_by_global_norm(1.0), T.adamw(lr=1e-3)
    assert T.chain(clip, adamw).fused is not None
    assert T.chain(T.chain(clip, adamw)).fused is not None
    # adamw writes the params in place; the clip after it could not take that back
    assert T.chain(adamw, clip).fused is None and T.chain(T.chain(clip, adamw), clip).fused is None
    assert T.chain(clip).fused is not None and T.sgd(lr=0.1).fused is None


def wide_tree(seed=0):
    """Leaves of several 256-element blocks, one with a partial last block."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g) * 1e-3}


@pytest.mark.parametrize("name", ["mu_dtype", "nu_dtype"])
@pytest.mark.parametrize("bad", [torch.float16, torch.uint8, "int8"])
def test_moment_dtypes_other_than_fp32_bf16_int8_raise_naming_the_argument(name, bad):
    with pytest.raises(ValueError, match=f"scale_by_adam: {name} must be None, torch.float32, torch.bfloat16 or torch.int8"):
        transforms.adamw(**{name: bad})


def test_the_block_of_8_bit_moments_reaches_the_engine_through_chain_and_masked():
    from fzero.transforms.quantize import BLOCK
    assert transforms.adamw().block == 1 and transforms.adamw(mu_dtype=torch.bfloat16).block == 1
    assert transforms.adamw(nu_dtype=torch.int8).block == BLOCK == 256
    tx = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(mu_dtype=torch.int8))
    assert tx.block == BLOCK and transforms.masked(tx, lambda p: p).block == BLOCK


def store_like(dtype):
    """How the transform stores a moment of ``dtype`` (the reference's rounding)."""
    from fzero.transforms import quantize as Q
    if dtype == torch.int8:
        return lambda x, signed: Q.dequantize(Q.quantize(x.float(), signed=signed)).double()
    return lambda x, signed: x.to(dtype).double()


@pytest.mark.parametrize("mu_dtype,nu_dtype", [(torch.bfloat16, torch.bfloat16), (torch.int8, torch.int8),
                                               (torch.int8, None), (None, torch.int8)])
def test_adamw_with_stored_moments_is_float64_adamw_on_the_rounded_moments(mu_dtype, nu_dtype):
    params, seq = wide_tree(), [wide_tree(s) for s in range(1, 13)]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    tx = transforms.adamw(**kw, mu_dtype=mu_dtype, nu_dtype=nu_dtype)
    state, p = tx.init(params), params
    for grads in seq:
        updates, state = tx.update(grads, state, p)
        p = transforms.apply_updates(p, updates)
    # reference: float64 AdamW whose stored moments are rounded as the transform stores them
    keep = lambda x, signed: x  # noqa: E731
    rm, rv = (store_like(d) if d is not None else keep for d in (mu_dtype, nu_dtype))
    (b1, b2), lr, wd = kw["betas"], kw["lr"], kw["weight_decay"]
    ref = {k: v.double() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in ref.items()}
    v = {k: torch.zeros_like(x) for k, x in ref.items()}
    for t, grads in enumerate(seq, 1):
        for k in ref:
            g = grads[k].double()
            m_new, v_new = b1 * m[k] + (1 - b1) * g, b2 * v[k] + (1 - b2) * g * g
            u = (m_new / (1 - b1**t)) / ((v_new / (1 - b2**t)).sqrt() + kw["eps"])  # this step: unrounded
            ref[k] = ref[k] * (1 - lr * wd) - lr * u
            m[k], v[k] = rm(m_new, True), rv(v_new, False)
    for k in ref:
        torch.testing.assert_close(p[k].double(), ref[k], rtol=1e-5, atol=1e-6)
    if torch.int8 in (mu_dtype, nu_dtype):
        assert isinstance(state[0].mu["w"] if mu_dtype else state[0].nu["w"], transforms.quantize.Quantized)


def test_8_bit_moments_on_a_shard_that_is_not_whole_blocks_raise():
    tx = transforms.adamw(mu_dtype=torch.int8)
    shard = torch.zeros(300)
    context = transforms.ShardContext({"w": torch.zeros(300)}, lambda per_leaf: torch.ones(300, dtype=torch.bool))
    with pytest.raises(ValueError, match="flat shard it runs on has 300 elements, not a whole number of blocks"):
        tx.init(shard, context=context)
    tx.init({"w": shard})  # plain use: a leaf of any size (its last block is partial)
