"""One module, one name, for the folders ``transforms/`` and ``models/``.

They are the packages ``fzero.transforms`` and ``fzero.models`` (pyproject's ``package-dir``). From
a checkout on ``sys.path`` each folder is importable by its own name too (``import transforms``):
its ``__init__`` then hands out the fzero package itself, under the folder's name and for every
submodule, so that whichever name is imported first there is one module object -- one
``Quantized`` class, one hyperparameter registry -- never two copies that do not know each other.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

__all__ = ["one_module"]


def one_module(name: str, package: str) -> None:
    """Make ``name`` (a folder's own name, e.g. ``"transforms"``) and ``name.<sub>`` the module
    objects of ``package`` (``"fzero.transforms"``) and ``package.<sub>`` in ``sys.modules``.
    Every submodule of ``package`` is imported first, so that no later ``import name.<sub>``
    finds the file again and makes a second module of it."""
    real = importlib.import_module(package)
    for info in pkgutil.walk_packages(real.__path__, package + "."):
        importlib.import_module(info.name)
    for key, module in list(sys.modules.items()):
        if key == package or key.startswith(package + "."):
            sys.modules[name + key[len(package):]] = module
