"""fzero.blocks: the transform state of an ``[S]`` shard cut to a slice, ``[S]`` tensors element by
element and per-block ones (8-bit moments' scales) block by block."""
import optree
import torch

from fzero.blocks import per_block, sized, slices
from fzero.transforms.quantize import BLOCK, quantize


def test_slices_cut_elementwise_and_per_block_tensors_and_leave_0d_ones():
    S, block = 40, 8
    state = {"m": torch.arange(S, dtype=torch.float32), "scale": torch.arange(S // block, dtype=torch.float32),
             "count": torch.tensor(3), "other": torch.zeros(7)}
    assert sized(state["m"], S, block) and per_block(state["scale"], S, block) and not sized(state["other"], S, block)
    assert not per_block(state["scale"], S, 1)  # an elementwise transform has no per-block state
    cut = slices(state, S, block, 16, S)
    assert torch.equal(cut["m"], torch.arange(16, S, dtype=torch.float32))
    assert torch.equal(cut["scale"], torch.arange(2, 5, dtype=torch.float32))
    assert cut["count"] is state["count"] and cut["other"] is state["other"]
    cut["m"][0] = -1.0  # views: a chunk's update writes the full-size state
    assert state["m"][16] == -1.0


def test_slices_of_an_8_bit_moment_are_its_own_shard():
    """The generic cut and the 8-bit moment's own rule (``Quantized.shard``) give the same codes
    and scales, for a slice that ends inside the last, partial block."""
    S = 3 * BLOCK + 40
    q = quantize(torch.randn(S, generator=torch.Generator().manual_seed(0)), signed=True)
    lo, hi = BLOCK, S
    got, want = slices(q, S, BLOCK, lo, hi), q.shard(lo, hi)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))
