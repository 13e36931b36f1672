"""fzero: functional mixed-precision AdamW with ZeRO-1 optimizer-state sharding."""
import os as _os

# The folders transforms/ and models/ beside fzero/ are its subpackages fzero.transforms and
# fzero.models: an install maps them (pyproject's package-dir); a checkout that is only on sys.path
# (a copy on a machine without pip's build tools) finds them through its root, which holds nothing
# else fzero imports. Never in an install: there fzero/transforms/ is a folder of its own.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "transforms")) and _os.path.isfile(
        _os.path.join(_ROOT, "transforms", "_alias.py")):
    __path__.append(_ROOT)

# fzero.comm first: its teardown notes whether a process group existed before fzero's import of
# torch._dynamo (fzero.comm.teardown), which other modules (fzero.remainder) would make earlier.
from .comm import CollectiveError, shutdown  # noqa: I001
from . import checkpoint, compile_cache, module
from .diagnostics import nonfinite_leaves
from .engine import Engine, ZeroState
from .flat import flatten, shard_of, tree_shard, unflatten
from .grad_forms import Accumulated
from .layout import Layout, make_layout
from .options import zero1
from .scaler import DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale, scale_loss

__all__ = [
    "Accumulated",
    "CollectiveError",
    "DynamicLossScale",
    "Engine",
    "Layout",
    "checkpoint",
    "compile_cache",
    "LossScaleState",
    "NoLossScale",
    "StaticLossScale",
    "ZeroState",
    "flatten",
    "make_layout",
    "module",
    "nonfinite_leaves",
    "scale_loss",
    "shard_of",
    "shutdown",
    "tree_shard",
    "unflatten",
    "zero1",
]
