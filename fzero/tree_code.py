"""A pytree structure as generated Python: ``builder(spec)`` is a function ``leaves -> tree``
whose body is one expression -- ``{'wte': l[0], 'blocks': [{...}, ...], ...}`` -- so that
``torch.compile`` traces a few bytecode instructions per node where rebuilding the tree by a walk
(optree's, or any Python loop) costs dynamo some forty (docs/startup.md). The technique of
``collections.namedtuple`` and ``torch.fx``: source text compiled once.
"""
from __future__ import annotations

from typing import Any, Callable

import optree

__all__ = ["builder"]


class _Foreign(Exception):
    """A node the generated code does not build (optree rebuilds such trees)."""


def builder(spec: optree.PyTreeSpec) -> Callable[[list], Any] | None:
    """``leaves -> spec.unflatten(leaves)`` as generated code, for a structure of plain dicts
    with ``str`` keys (built in their insertion order, their leaves in optree's sorted-key
    order), lists, tuples and ``None``; ``None`` for any other node (a NamedTuple, an
    ``OrderedDict``, a registered class) or a tree too deep for one expression."""
    template = spec.unflatten(list(range(spec.num_leaves)))  # each leaf replaced by its index

    def expr(node) -> str:
        t = type(node)
        if t is int:
            return f"l[{node}]"
        if node is None:
            return "None"
        if t is dict and all(type(k) is str for k in node):
            return "{" + ", ".join(f"{k!r}: {expr(v)}" for k, v in node.items()) + "}"
        if t is list:
            return "[" + ", ".join(expr(c) for c in node) + "]"
        if t is tuple:
            return "(" + "".join(expr(c) + ", " for c in node) + ")"
        raise _Foreign

    try:
        source = f"def build(l):\n    return {expr(template)}\n"
        namespace: dict = {}
        exec(compile(source, "<fzero.tree_code>", "exec"), namespace)  # noqa: S102 -- our own text, no input in it
    except (_Foreign, RecursionError, SyntaxError, MemoryError):
        return None
    return namespace["build"]
