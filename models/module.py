"""The ``(params, apply)`` form of an ``nn.Module``, for code that wants only a function of the
params: a thin wrapper over ``fzero.module`` (which also returns the buffers and their updates)."""

import fzero.module


def functional(module):
    """``(params, apply)`` with ``apply(params, *args, **kwargs) == module(*args, **kwargs)``.

    ``fzero.module.functional(module)``'s params (detached, a tied parameter once) and its
    ``apply`` on the module's current buffers, floating inputs cast to the params' dtype. The
    buffers' updates (BatchNorm's running statistics in training mode) are dropped: to keep
    them, use ``fzero.module`` directly."""
    fm = fzero.module.functional(module)

    def apply(params, *args, **kwargs):
        return fm.apply(params, fm.buffers, *args, **kwargs)[0]

    return fm.params, apply
