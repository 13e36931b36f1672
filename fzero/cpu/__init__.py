"""The CPU wing: what only a CPU's step runs, behind the update's variant interface
(``fzero.update``: a small class per variant with ``run``).

* ``chunked``: the eager update of a CPU shard in cache-sized chunks (``FusedChunks``,
  ``Chunks``, ``CompiledChunks``);
* ``native`` (with ``native.cpp``): fzero's own CPU kernels, built at the first use; ``kernel``:
  them as the step's variants (``Native`` for the AdamW update, ``NativeNorm`` for the norm);
* ``leafwise``: the compiled step's update from a grads pytree, leaf by leaf, as one opaque op
  (``CompiledLeaves``).

The wing imports the general modules; of the general modules only ``fzero.plan``, which picks
the step's variants, imports the wing.
"""
from . import chunked, kernel, leafwise, native

__all__ = ["chunked", "kernel", "leafwise", "native"]
