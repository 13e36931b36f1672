import math

import pytest
import torch
from optree import tree_leaves, tree_map

from fzero.models import mlp
from fzero.models.module import functional

DIMS = (16, 32, 32, 8)
LOW = [torch.float16, torch.bfloat16]


def _init(dtype=torch.float32, dims=DIMS, seed=0):
    return mlp.init(torch.Generator().manual_seed(seed), dims, dtype=dtype)


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _batch(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIMS[0], generator=g), torch.randn(n, DIMS[-1], generator=g)


def test_default_dims_shapes():
    params = mlp.init(torch.Generator().manual_seed(0))
    shapes = [(tuple(l["w"].shape), tuple(l["b"].shape)) for l in params["layers"]]
    assert shapes == [((1024, 4096), (4096,)), ((4096, 4096), (4096,)), ((4096, 1024), (1024,))]
    assert sum(t.numel() for t in tree_leaves(params)) == 25_175_040


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_shapes_and_dtypes(dtype):
    params = _init(dtype)
    assert all(t.dtype == dtype for t in tree_leaves(params))
    x, y = _batch()
    out = mlp.apply(params, x)
    assert out.shape == (8, DIMS[-1]) and out.dtype == dtype
    loss = mlp.loss(params, (x, y))
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)


def test_init_is_nn_linear_like_and_dtype_independent():
    params = _init()
    for layer in params["layers"]:
        bound = 1 / math.sqrt(layer["w"].shape[0])
        for t in layer.values():
            assert t.abs().max() <= bound and t.abs().max() > 0.9 * bound
    # Same seed -> same draws; the dtype only casts.
    for dtype in LOW:
        for a, b in zip(tree_leaves(_init(dtype)), tree_leaves(params)):
            assert torch.equal(a, b.to(dtype))
    assert not torch.equal(_init(seed=1)["layers"][0]["w"], params["layers"][0]["w"])


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_matches_fp32(dtype):
    x, _ = _batch()
    ref = mlp.apply(_init(), x)
    # Measured relative error is ~0.5 eps for both fp16 and bf16.
    assert _rel_err(mlp.apply(_init(dtype), x), ref) < 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_grad_and_value(dtype):
    params, batch = _init(dtype), _batch()
    grads, value = torch.func.grad_and_value(mlp.loss)(params, batch)
    assert value.dtype == torch.float32 and torch.equal(value, mlp.loss(params, batch))
    for g, p in zip(tree_leaves(grads), tree_leaves(params)):
        assert g.shape == p.shape and g.dtype == dtype and torch.isfinite(g).all()
    # Cross-check against eager autograd.
    eager = tree_map(lambda p: p.detach().requires_grad_(), params)
    ref = torch.autograd.grad(mlp.loss(eager, batch), tree_leaves(eager))
    for g, r in zip(tree_leaves(grads), ref):
        torch.testing.assert_close(g, r)


def test_vmap():
    params, (x, y) = _init(), _batch()
    torch.testing.assert_close(torch.func.vmap(mlp.apply, in_dims=(None, 0))(params, x), mlp.apply(params, x))
    # Per-example gradients average to the batch gradient (MSE is a mean over examples).
    per_ex = torch.func.vmap(torch.func.grad(mlp.loss), in_dims=(None, 0))(params, (x, y))
    batch_grad = torch.func.grad(mlp.loss)(params, (x, y))
    for pe, g in zip(tree_leaves(per_ex), tree_leaves(batch_grad)):
        assert pe.shape == (x.shape[0], *g.shape)
        torch.testing.assert_close(pe.mean(0), g)


def test_module_adapter_matches_functional_mlp():
    params = _init()
    layers = []
    for d_in, d_out in zip(DIMS[:-1], DIMS[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.GELU()]
    module = torch.nn.Sequential(*layers[:-1])
    mod_params, apply = functional(module)
    assert list(mod_params) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    # nn.Linear stores [out, in]; models.mlp stores [in, out].
    mod_params = {f"{2 * i}.{k}": (l["w"].T if k == "weight" else l["b"])
                  for i, l in enumerate(params["layers"]) for k in ("weight", "bias")}
    x, y = _batch()
    torch.testing.assert_close(apply(mod_params, x), mlp.apply(params, x))

    def loss(p, batch):
        return torch.nn.functional.mse_loss(apply(p, batch[0]), batch[1])

    grads = torch.func.grad(loss)(mod_params, (x, y))
    ref = torch.func.grad(mlp.loss)(params, (x, y))
    torch.testing.assert_close(grads["2.weight"], ref["layers"][1]["w"].T)
