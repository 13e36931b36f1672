import optree
import pytest
import torch

import transforms


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
