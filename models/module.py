"""Adapter from an ``nn.Module`` to the ``(params, apply)`` functional form."""

import torch


def functional(module):
    """Return ``(params, apply)`` with ``apply(params, *args, **kwargs) == module(*args, **kwargs)``.

    ``params`` is a flat ``{qualified_name: Tensor}`` dict of detached parameters (tied
    parameters appear once). Buffers are captured from the module and not differentiated.
    """
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = dict(module.named_buffers())

    def apply(params, *args, **kwargs):
        return torch.func.functional_call(module, (params, buffers), args, kwargs)

    return params, apply
