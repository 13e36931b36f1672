"""Pure functional reference models: params are plain dict/list pytrees of tensors.

Each model module exposes ``init(generator, ...) -> params``, ``apply(params, x)`` and
``loss(params, batch) -> 0-d fp32 tensor``; none of them knows anything about fzero.
"""

if __name__ != "fzero.models":  # the folder imported by its own name, from a checkout on sys.path
    from fzero.transforms._alias import one_module

    one_module(__name__, "fzero.models")  # the import then returns fzero.models itself

from . import gpt, mlp, module

__all__ = ["gpt", "mlp", "module"]
