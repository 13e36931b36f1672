"""Functional MLP (default 1024 -> 4096 -> 4096 -> 1024, GELU between layers).

Params pytree: ``{"layers": [{"w": Tensor[d_in, d_out], "b": Tensor[d_out]}, ...]}``.
Weights are stored [in, out] so the forward is ``x @ w + b``.
"""

import math

import torch
import torch.nn.functional as F

DIMS = (1024, 4096, 4096, 1024)


def init(generator, dims=DIMS, dtype=torch.float32, device=None):
    """Initialise like ``nn.Linear``: w, b ~ U(-1/sqrt(d_in), 1/sqrt(d_in)).

    ``generator`` must be a CPU ``torch.Generator``. Values are drawn in fp32 on CPU and
    only then cast/moved, so a given seed gives the same params on every device and dtype.
    """
    layers = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        bound = 1.0 / math.sqrt(d_in)
        w = torch.empty(d_in, d_out).uniform_(-bound, bound, generator=generator)
        b = torch.empty(d_out).uniform_(-bound, bound, generator=generator)
        layers.append({"w": w.to(device, dtype), "b": b.to(device, dtype)})
    return {"layers": layers}


def apply(params, x):
    """x: [..., d_in] (any float dtype) -> [..., d_out] in the params' dtype."""
    layers = params["layers"]
    x = x.to(layers[0]["w"].dtype)
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            x = F.gelu(x)
    return x


def loss(params, batch):
    """batch = (x [..., d_in], y [..., d_out]) -> mean squared error, 0-d fp32."""
    x, y = batch
    # Reduce in fp32: a half-precision sum over a large batch loses the small terms.
    return F.mse_loss(apply(params, x).float(), y.float())
