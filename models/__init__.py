"""Pure functional reference models: params are plain dict/list pytrees of tensors.

Each model module exposes ``init(generator, ...) -> params``, ``apply(params, x)`` and
``loss(params, batch) -> 0-d fp32 tensor``; none of them knows anything about fzero.
"""

from . import gpt, mlp, module

__all__ = ["gpt", "mlp", "module"]
